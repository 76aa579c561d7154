"""Test helpers: start a real stand-in process on a free port and always stop it."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
from pydantic import SecretStr

from datagen.engine.endpoints import ServerEndpoint

__all__ = ["StandinStartError", "free_port", "run_standin", "standin_command", "stop_process"]


class StandinStartError(RuntimeError):
    """The stand-in exited or did not become healthy in time (the message carries its log tail)."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago (bind to port 0, read it, release it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def standin_command(model_dir: Path, port: int, api_key: str | None, args: Sequence[str] = ()) -> list[str]:
    """The command line that starts a stand-in with this interpreter."""
    cmd = [sys.executable, "-m", "datagen.standin", "--model-path", str(model_dir), "--port", str(port)]
    if api_key is not None:
        cmd += ["--api-key", api_key]
    return cmd + list(args)


def _tail(path: Path, lines: int = 40) -> str:
    try:
        return "\n".join(path.read_text(encoding="utf-8", errors="replace").splitlines()[-lines:])
    except OSError:
        return "<no log>"


def stop_process(proc: subprocess.Popen[bytes], grace_s: float = 5.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; waits until the process is gone."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def run_standin(
    model_dir: Path,
    *,
    port: int | None = None,
    api_key: str | None = "test-key",
    args: Sequence[str] = (),
    env: Mapping[str, str] | None = None,
    log_path: Path | None = None,
    timeout_s: float = 240.0,
) -> Iterator[ServerEndpoint]:
    """Start `python -m datagen.standin` on 127.0.0.1, wait for /health 200, yield its endpoint, always kill it.

    `args` are extra SGLang flags (not --port/--host: use `port`). `env` is added to this process's
    environment (DATAGEN_STANDIN_* knobs). Output goes to `log_path` (a temporary file by default).
    `timeout_s` is a hang guard, not a speed requirement: on a loaded 2-core box (the suite's 3 processes and a CPU
    burner beside it) a start took more than 60 s, the old guard, while the stand-in was still loading.
    """
    port = port if port is not None else free_port()
    with ExitStack() as stack:
        if log_path is None:
            log_path = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="standin-"))) / "server.log"
        log_file = stack.enter_context(open(log_path, "wb"))
        proc = subprocess.Popen(
            standin_command(model_dir, port, api_key, args),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
        )
        stack.callback(stop_process, proc)
        url = f"http://127.0.0.1:{port}"
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        deadline = time.monotonic() + timeout_s
        with httpx.Client(base_url=url, headers=headers, timeout=5.0) as client:
            while True:
                if proc.poll() is not None:
                    raise StandinStartError(f"stand-in exited with {proc.returncode}:\n{_tail(log_path)}")
                try:
                    if client.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass  # port still closed while "loading"
                if time.monotonic() > deadline:
                    raise StandinStartError(f"stand-in not healthy after {timeout_s}s:\n{_tail(log_path)}")
                time.sleep(0.05)
            info = client.get("/server_info").json()
        yield ServerEndpoint(
            name=f"standin-{port}",
            url=url,
            api_key=SecretStr(api_key) if api_key is not None else None,
            max_running_requests=int(info["internal_states"][0]["effective_max_running_requests_per_dp"]),
            log_path=str(log_path),
        )
