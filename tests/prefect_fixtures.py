"""Real Prefect processes for end-to-end tests: a server, `infra/deploy.sh`, a process worker, a REST client.

Everything runs as the users run it: `infra/prefect-server.sh run` (basic auth with a fresh auth string, CSRF
protection, CORS limited to the UI's origin, loopback; PREFECT_HOME in a temp dir, PREFECT_SERVER_API_PORT on a
free port, set before start so the UI points at the right API), `infra/deploy.sh` (work pool with datagen's base
job template + `prefect deploy --all --no-prompt` from the repo root) and `infra/prefect-worker.sh`
(`python -m datagen.worker`, datagen's process worker, stopped with SIGINT; it runs what deploy.sh pinned in
the server's `pin_file`). Every client gets the auth string as PREFECT_API_AUTH_STRING.
"""

from __future__ import annotations

import base64
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Generator, Iterator, Mapping
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.local.localstack import LocalS3

__all__ = [
    "CLIENT_RETRY_ENV",
    "POOL",
    "REPO_ROOT",
    "RETRY_STATUS",
    "TERMINAL_STATES",
    "PrefectApi",
    "PrefectAuth",
    "PrefectProxy",
    "PrefectServer",
    "RetryingTransport",
    "free_port",
    "new_auth_string",
    "prefect_proxy",
    "prefect_server",
    "prefect_worker",
    "run_deploy",
    "session_prefect_server",
    "stop_process",
    "worker_env",
    "write_prompts",
]

REPO_ROOT = Path(__file__).resolve().parents[1]
POOL = "gpu-box-1"  # the work pool prefect.yaml names
TERMINAL_STATES = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}
_VENV_BIN = Path(sys.executable).parent


def free_port() -> int:
    """A TCP port that was free on loopback a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


# Prefect's client already retries 408/429/502/503, timeouts, dropped connections and (once it has connected)
# refused connections, with 2**n s backoff; its default of 5 retries gives a loaded SQLite server ~1 min. The
# processes under test (CLI, deploy, worker, flow runs) get 7 (~4 min) for a machine with both cores busy.
CLIENT_RETRY_ENV = {"PREFECT_CLIENT_MAX_RETRIES": "7"}
RETRY_STATUS = frozenset({408, 429, 502, 503, 504})


def _base_env() -> dict[str, str]:
    # The venv's bin first, so bash scripts and the worker's flow-run subprocesses use this interpreter;
    # no PREFECT_*/DATAGEN_* from the caller's shell leak into the processes under test.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env["PATH"] = f"{_VENV_BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PREFECT_SERVER_ANALYTICS_ENABLED"] = "false"
    env.update(CLIENT_RETRY_ENV)
    return env


class RetryingTransport(httpx.BaseTransport):
    """Retries what a busy Prefect server may answer (503 from a locked SQLite, 502/504/429) and connection errors.

    Backoff doubles from `base_s` (capped at 10 s), honouring Retry-After; after `attempts` tries the last
    response is returned, or the last error raised. Every call the tests make is safe to repeat: reads, filters,
    schedule PATCHes (idempotent) and create_flow_run with an idempotency key.
    """

    def __init__(self, attempts: int = 8, base_s: float = 0.5, inner: httpx.BaseTransport | None = None) -> None:
        self.attempts = attempts
        self.base_s = base_s
        self.inner = inner or httpx.HTTPTransport()
        self.retried = 0

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        for attempt in range(self.attempts):
            last = attempt == self.attempts - 1
            delay = min(10.0, self.base_s * 2**attempt)
            try:
                response = self.inner.handle_request(request)
            except (httpx.TransportError, httpx.TimeoutException):
                if last:
                    raise
            else:
                if response.status_code not in RETRY_STATUS or last:
                    return response
                with suppress(ValueError):
                    delay = max(delay, min(30.0, float(response.headers.get("Retry-After", ""))))
                response.read()
                response.close()
            self.retried += 1
            time.sleep(delay)
        raise AssertionError("unreachable: the last attempt returns or raises")

    def close(self) -> None:
        self.inner.close()


def stop_process(proc: subprocess.Popen[Any], sig: int = signal.SIGTERM, timeout: float = 30.0) -> None:
    """Send `sig` to a process (and its group), wait, and kill it if it is still there after `timeout`."""
    if proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, sig)
    except ProcessLookupError:
        return
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        with suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=10)


@dataclass
class PrefectServer:
    """A running `prefect server start`: where it listens and where its state lives."""

    port: int
    home: Path
    log_path: Path
    process: subprocess.Popen[bytes]
    auth_string: str

    @property
    def url(self) -> str:
        """Base URL (the UI is under /v2/)."""
        return f"http://127.0.0.1:{self.port}"

    @property
    def api_url(self) -> str:
        """The PREFECT_API_URL clients and workers use."""
        return f"{self.url}/api"

    @property
    def pin_file(self) -> Path:
        """The box's pin (`datagen pin`), written by infra/deploy.sh, read by the worker: one per server."""
        return self.home.parent / "box-pin" / "pin.json"

    def client_env(self, home: Path, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        """Environment for a CLI or worker process talking to this server."""
        home.mkdir(parents=True, exist_ok=True)
        env = _base_env()
        env.update(
            {
                "PREFECT_API_URL": self.api_url,
                "PREFECT_HOME": str(home),
                "PREFECT_API_AUTH_STRING": self.auth_string,
                "DATAGEN_PIN_FILE": str(self.pin_file),
            }
        )
        env.update(extra or {})
        return env

    def api(self) -> PrefectApi:
        """A REST client that authenticates to this server (basic auth + CSRF token)."""
        return PrefectApi(self.api_url, self.auth_string)

    def log_tail(self, n: int = 60) -> str:
        """Last lines of the server log, for failure messages."""
        return _tail(self.log_path, n)


def _tail(path: Path, n: int) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except FileNotFoundError:
        return f"({path} missing)"


class _PortTaken(Exception):
    """The server exited because its port was taken after free_port() chose it."""


def new_auth_string() -> str:
    """A fresh `user:password` auth string, as infra/prefect-auth.sh generates one."""
    return f"datagen:{secrets.token_urlsafe(30)}"


def _launch_server(state_dir: Path, extra_env: Mapping[str, str] | None) -> PrefectServer:
    port = free_port()
    auth_string = new_auth_string()
    env = _base_env()
    env.update(
        {
            "PREFECT_HOME": str(state_dir / "server-home"),
            # The UI computes its API URL from these settings, not from --port: set before start.
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_SERVER_API_AUTH_STRING": auth_string,
            "PREFECT_BIN": str(_VENV_BIN / "prefect"),
        }
    )
    env.update(extra_env or {})
    log_path = state_dir / "server.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            ["bash", str(REPO_ROOT / "infra" / "prefect-server.sh"), "run"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=state_dir,
            start_new_session=True,
        )
    return PrefectServer(
        port=port, home=state_dir / "server-home", log_path=log_path, process=proc, auth_string=auth_string
    )


def _wait_healthy(server: PrefectServer, startup_timeout: float) -> None:
    proc = server.process
    deadline = time.monotonic() + startup_timeout
    while True:
        if proc.poll() is not None:
            if "address already in use" in server.log_tail().lower():
                raise _PortTaken
            raise RuntimeError(f"prefect server exited with {proc.returncode}:\n{server.log_tail()}")
        try:
            if httpx.get(f"{server.api_url}/health", timeout=2).json() is True:
                return
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"prefect server not healthy after {startup_timeout:.0f} s:\n{server.log_tail()}")
        time.sleep(0.25)


@contextmanager
def prefect_server(
    state_dir: Path, extra_env: Mapping[str, str] | None = None, startup_timeout: float = 120.0
) -> Iterator[PrefectServer]:
    """Start a real Prefect server (SQLite under `state_dir`) on a free port; stop it on exit."""
    state_dir.mkdir(parents=True, exist_ok=True)
    # free_port() releases the port before the server binds it: another process can take it in between,
    # so a start that dies with "address already in use" is retried on a new port.
    for attempt in range(3):
        server = _launch_server(state_dir, extra_env)
        proc = server.process
        try:
            _wait_healthy(server, startup_timeout)
        except _PortTaken:
            stop_process(proc, signal.SIGTERM)
            if attempt == 2:
                raise RuntimeError(f"prefect server could not bind a port:\n{server.log_tail()}") from None
            continue
        except BaseException:
            stop_process(proc, signal.SIGTERM)
            raise
        break
    try:
        yield server
    finally:
        stop_process(proc, signal.SIGTERM)


@pytest.fixture(scope="session")
def session_prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One real Prefect server per test process, for flows that need an API but test no Prefect set-up of their own.

    Each test keeps its own PREFECT_HOME, work dir, S3 prefix and namespace; it only shares the server's database.
    """
    with prefect_server(tmp_path_factory.mktemp("session-prefect")) as server:
        yield server


def run_deploy(server: PrefectServer, home: Path, extra_env: Mapping[str, str] | None = None) -> str:
    """Run `infra/deploy.sh` from the repo root against `server`; return its output (raises on failure)."""
    env = server.client_env(home, extra_env)
    result = subprocess.run(
        ["bash", str(REPO_ROOT / "infra" / "deploy.sh")],
        env=env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    output = result.stdout + result.stderr
    if result.returncode != 0:
        raise RuntimeError(f"infra/deploy.sh exited with {result.returncode}:\n{output}")
    return output


@contextmanager
def prefect_worker(
    server: PrefectServer, home: Path, log_path: Path, extra_env: Mapping[str, str] | None = None
) -> Iterator[subprocess.Popen[bytes]]:
    """Run `infra/prefect-worker.sh` (a process worker on the pool); stop it with SIGINT on exit."""
    env = server.client_env(home, {"DATAGEN_HOME": str(REPO_ROOT), "PREFECT_WORKER_QUERY_SECONDS": "1"})
    env.update(extra_env or {})
    with log_path.open("wb") as log:
        proc = subprocess.Popen(
            ["bash", str(REPO_ROOT / "infra" / "prefect-worker.sh")],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=home,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        # SIGINT is how the worker is meant to be stopped (systemd KillSignal=SIGINT); its flow-run
        # subprocesses are in the same process group and get it too.
        stop_process(proc, signal.SIGINT, timeout=30)


def write_prompts(path: Path, prompts: list[str]) -> Path:
    """A tiny OpenAI-messages JSONL prompt set."""
    rows = [{"messages": [{"role": "user", "content": text}], "category": "test"} for text in prompts]
    lines = [json.dumps(row) for row in rows]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def worker_env(s3: LocalS3, s3_prefix: str, work_dir: Path, length_mean: int, length_max: int) -> dict[str, str]:
    """The worker's DATAGEN_* settings: stand-in servers on this CPU box, the local S3 server, short outputs."""
    return {
        **s3.env(),
        "DATAGEN_S3_PREFIX": s3_prefix,
        "DATAGEN_ENGINE": "standin",
        "DATAGEN_NUM_SERVERS": "1",
        "DATAGEN_SKIP_GPU_CHECKS": "true",
        "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
        "DATAGEN_SERVER_START_TIMEOUT_S": "120",
        "DATAGEN_WORK_DIR": str(work_dir),
        # Prompts and models of these tests live in temporary directories (tests/conftest.py names the roots).
        "DATAGEN_DATA_ROOTS": os.environ["DATAGEN_DATA_ROOTS"],
        "DATAGEN_MODEL_ROOTS": os.environ["DATAGEN_MODEL_ROOTS"],
        "DATAGEN_STANDIN_LOAD_S": "0",
        "DATAGEN_STANDIN_WARMUP_S": "0",
        "DATAGEN_STANDIN_LENGTH_MEAN": str(length_mean),
        "DATAGEN_STANDIN_LENGTH_MAX": str(length_max),
    }


class PrefectAuth(httpx.Auth):
    """What Prefect's own client does against a secured server: basic auth, and a CSRF token on every change.

    The token comes from `GET /csrf-token?client=<id>` (itself behind basic auth) and goes with each POST, PUT,
    PATCH and DELETE as Prefect-Csrf-Token / Prefect-Csrf-Client; it is fetched again when refused or expired.
    """

    requires_response_body = True
    _CHANGES = frozenset({"POST", "PUT", "PATCH", "DELETE"})

    def __init__(self, auth_string: str) -> None:
        self.header = "Basic " + base64.b64encode(auth_string.encode()).decode()
        self.client_id = uuid.uuid4().hex
        self.token: str | None = None

    def auth_flow(self, request: httpx.Request) -> Generator[httpx.Request, httpx.Response, None]:
        request.headers["Authorization"] = self.header
        if request.method not in self._CHANGES:
            yield request
            return
        for attempt in range(2):
            if self.token is None:
                url = request.url.copy_with(path=_api_root(request.url.path) + "/csrf-token", query=None)
                fetch = httpx.Request("GET", url, params={"client": self.client_id})
                fetch.headers["Authorization"] = self.header
                answer = yield fetch
                if answer.status_code != 200:
                    yield request  # let the server say why (401 with a wrong auth string)
                    return
                self.token = str(answer.json()["token"])
            request.headers["Prefect-Csrf-Token"] = self.token
            request.headers["Prefect-Csrf-Client"] = self.client_id
            response = yield request
            if response.status_code != 403 or "CSRF" not in response.text or attempt == 1:
                return
            self.token = None  # expired or forgotten by the server: fetch a new one, once


def _api_root(path: str) -> str:
    """`/api` from `/api/deployments/...` (the CSRF endpoint sits at the API's root)."""
    return path[: path.index("/api") + 4] if "/api" in path else ""


class PrefectApi:
    """The few REST calls the tests (and users' scripts) make against a Prefect server."""

    def __init__(self, api_url: str, auth_string: str | None = None) -> None:
        self.transport = RetryingTransport()
        auth = PrefectAuth(auth_string) if auth_string else None
        self.client = httpx.Client(base_url=api_url, timeout=30, transport=self.transport, auth=auth)

    def close(self) -> None:
        """Close the HTTP connection pool."""
        self.client.close()

    def deployment(self, flow_name: str, deployment_name: str) -> dict[str, Any]:
        """The deployment record (GET /deployments/name/{flow}/{deployment})."""
        response = self.client.get(f"/deployments/name/{flow_name}/{deployment_name}")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def create_flow_run(
        self,
        deployment_id: str,
        parameters: Mapping[str, Any],
        job_variables: Mapping[str, Any] | None = None,
        name: str | None = None,
        work_queue: str | None = None,
    ) -> httpx.Response:
        """POST /deployments/{id}/create_flow_run; the raw response (the caller checks the status)."""
        # The idempotency key makes the retry below safe: a repeated POST returns the same flow run.
        body: dict[str, Any] = {"parameters": dict(parameters), "idempotency_key": uuid.uuid4().hex}
        if job_variables is not None:
            body["job_variables"] = dict(job_variables)
        if name:
            body["name"] = name
        if work_queue:
            body["work_queue_name"] = work_queue
        # SQLite busy ("database is locked") comes back as 503: the transport retries it (and connection errors).
        return self.client.post(f"/deployments/{deployment_id}/create_flow_run", json=body)

    def flow_run(self, flow_run_id: str) -> dict[str, Any]:
        """GET /flow_runs/{id}."""
        response = self.client.get(f"/flow_runs/{flow_run_id}")
        response.raise_for_status()
        data: dict[str, Any] = response.json()
        return data

    def wait_for_flow_run(self, flow_run_id: str, timeout: float, diagnostics: Path | None = None) -> dict[str, Any]:
        """Poll until the flow run is in a terminal state; raise (with its logs) if it isn't within `timeout`."""
        deadline = time.monotonic() + timeout
        while True:
            run = self.flow_run(flow_run_id)
            if run["state_type"] in TERMINAL_STATES:
                return run
            if time.monotonic() > deadline:
                extra = f"\nworker log:\n{_tail(diagnostics, 80)}" if diagnostics else ""
                raise TimeoutError(
                    f"flow run {flow_run_id} still {run['state_type']} ({run['state_name']}) after {timeout:.0f} s\n"
                    f"logs:\n{self.log_text(flow_run_id)}{extra}"
                )
            time.sleep(1.0)

    def _filter(self, path: str, body: Mapping[str, Any]) -> list[dict[str, Any]]:
        response = self.client.post(path, json=dict(body))
        response.raise_for_status()
        data: list[dict[str, Any]] = response.json()
        return data

    def flow_runs(self, deployment_id: str) -> list[dict[str, Any]]:
        """Flow runs of a deployment (POST /flow_runs/filter)."""
        return self._filter("/flow_runs/filter", {"deployments": {"id": {"any_": [deployment_id]}}})

    def wait_for_scheduled_runs(self, deployment_id: str, timeout: float) -> list[dict[str, Any]]:
        """Poll until the server's scheduler has created SCHEDULED runs for a deployment; return them."""
        deadline = time.monotonic() + timeout
        while True:
            runs = [r for r in self.flow_runs(deployment_id) if r["state_type"] == "SCHEDULED"]
            if runs or time.monotonic() > deadline:
                return runs
            time.sleep(1.0)

    def artifacts(self, flow_run_id: str) -> list[dict[str, Any]]:
        """Artifacts created by a flow run and its tasks (POST /artifacts/filter)."""
        return self._filter("/artifacts/filter", {"artifacts": {"flow_run_id": {"any_": [flow_run_id]}}})

    def task_runs(self, flow_run_id: str) -> list[dict[str, Any]]:
        """Task runs of a flow run (POST /task_runs/filter)."""
        return self._filter("/task_runs/filter", {"flow_runs": {"id": {"any_": [flow_run_id]}}})

    def logs(self, flow_run_id: str) -> list[dict[str, Any]]:
        """Log records of a flow run and its tasks, oldest first (POST /logs/filter)."""
        return self._filter(
            "/logs/filter", {"logs": {"flow_run_id": {"any_": [flow_run_id]}}, "sort": "TIMESTAMP_ASC", "limit": 200}
        )

    def log_text(self, flow_run_id: str) -> str:
        """A flow run's log messages as one text."""
        return "\n".join(str(record["message"]) for record in self.logs(flow_run_id))

    def wait_for_log(self, flow_run_id: str, text: str, timeout: float = 60.0) -> str:
        """The flow run's log text once it contains `text` (workers ship logs in batches, after the state)."""
        deadline = time.monotonic() + timeout
        while True:
            logs = self.log_text(flow_run_id)
            if text in logs or time.monotonic() > deadline:
                return logs
            time.sleep(1.0)


@dataclass
class PrefectProxy:
    """A running `infra/prefect-proxy.sh run` (nginx) in front of a server, with its state directory."""

    port: int
    state: Path
    process: subprocess.Popen[bytes]

    @property
    def api_url(self) -> str:
        """The PREFECT_API_URL of clients that go through the proxy."""
        return f"http://127.0.0.1:{self.port}/api"

    @property
    def url(self) -> str:
        """Base URL of the UI through the proxy."""
        return f"http://127.0.0.1:{self.port}"

    def add_user(self, name: str, role: str) -> str:
        """`prefect-proxy.sh add-user NAME ROLE`; the new `name:password` credential."""
        env = {**_base_env(), "DATAGEN_PROXY_DIR": str(self.state)}
        subprocess.run(
            ["bash", str(REPO_ROOT / "infra" / "prefect-proxy.sh"), "add-user", name, role],
            env=env,
            check=True,
            capture_output=True,
            timeout=30,
        )
        return (self.state / "credentials" / name).read_text().strip()

    def api(self, credential: str) -> PrefectApi:
        """A REST client through the proxy with this credential."""
        return PrefectApi(self.api_url, credential)

    def client_env(self, server: PrefectServer, home: Path, credential: str) -> dict[str, str]:
        """A CLI or worker environment that reaches `server` through this proxy with `credential`."""
        return server.client_env(home, {"PREFECT_API_URL": self.api_url, "PREFECT_API_AUTH_STRING": credential})


@contextmanager
def prefect_proxy(server: PrefectServer, state_dir: Path, port: int | None = None) -> Iterator[PrefectProxy]:
    """Run `infra/prefect-proxy.sh run` (nginx on `port`, else a free loopback port) in front of `server`.

    A server whose UI is opened through the proxy is started with DATAGEN_PROXY_URL naming this port.
    """
    state_dir.mkdir(parents=True, exist_ok=True)
    wanted = port
    for attempt in range(3):
        port = wanted or free_port()
        env = {
            **_base_env(),
            "DATAGEN_PROXY_DIR": str(state_dir / "proxy"),
            "DATAGEN_PROXY_LISTEN": f"127.0.0.1:{port}",
            "DATAGEN_PROXY_UPSTREAM": f"127.0.0.1:{server.port}",
            "PREFECT_SERVER_API_AUTH_STRING": server.auth_string,
        }
        log_path = state_dir / "proxy.log"
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                ["bash", str(REPO_ROOT / "infra" / "prefect-proxy.sh"), "run"],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + 120  # a hang guard: nginx and the server behind it on a loaded box
        while proc.poll() is None and time.monotonic() < deadline:
            with suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/api/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.2)
        if proc.poll() is None:
            break
        if attempt == 2 or wanted or "in use" not in _tail(log_path, 20):
            raise RuntimeError(f"prefect-proxy.sh exited with {proc.returncode}:\n{_tail(log_path, 20)}")
    try:
        yield PrefectProxy(port=port, state=state_dir / "proxy", process=proc)
    finally:
        stop_process(proc, signal.SIGQUIT)
