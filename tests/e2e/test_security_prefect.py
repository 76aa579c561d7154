"""The Prefect side of a shared deployment, attacked from outside (docs/security.md, issue 20).

One real server started as `infra/prefect-server.sh run` starts it, `infra/deploy.sh`, and a process worker on the
local S3 server. Each probe is what an outsider did to the unsecured deployment: REST calls without credentials,
the events websocket, cross-origin requests, forged events, and flow runs whose job variables carry a command or
an environment. Every refusal is checked twice: the answer, and (through an authenticated client) that nothing
changed.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect
from websockets.typing import Origin, Subprotocol

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from tests.prefect_fixtures import (
    POOL,
    REPO_ROOT,
    TERMINAL_STATES,
    PrefectApi,
    PrefectServer,
    prefect_server,
    prefect_worker,
    run_deploy,
    worker_env,
    write_prompts,
)

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300.0  # a hang guard, not a speed requirement
EVIL_ORIGIN = Origin("http://evil.example")
REFUSED = {401, 403}


class Listener:
    """A local HTTP endpoint that records every request: where a hijacked setting would send the box's secrets."""

    def __init__(self) -> None:
        self.requests: list[str] = []
        seen = self.requests

        class Handler(BaseHTTPRequestHandler):
            def _record(self) -> None:
                seen.append(f"{self.command} {self.path} {dict(self.headers)}")
                self.send_response(500)
                self.end_headers()

            do_GET = do_PUT = do_POST = do_HEAD = do_DELETE = _record

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@dataclass
class Target:
    """The deployment under attack, and an authenticated client to check that nothing changed."""

    server: PrefectServer
    api: PrefectApi
    deployment: dict[str, Any]
    spec: dict[str, Any]
    worker_log: Path
    root: Path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3) -> Iterator[Target]:
    """Server (as the scripts start it) + `infra/deploy.sh` + one process worker; stopped at the end."""
    root = tmp_path_factory.mktemp("prefect-security")
    spec = {
        "sources": [{"path": str(write_prompts(root / "prompts.jsonl", ["Say hello."]))}],
        "model_path": str(ensure_model_dir()),
        "namespace": "security-probe",
        "context_length": 4096,
        "sampling": {"max_new_tokens": 64},
    }
    with ExitStack() as stack:
        server = stack.enter_context(prefect_server(root / "prefect"))
        run_deploy(server, root / "cli-home")
        worker_log = root / "worker.log"
        box_env = worker_env(local_s3, f"{root.name}/", root / "work", length_mean=16, length_max=32)
        stack.enter_context(prefect_worker(server, root / "worker-home", worker_log, box_env))
        api = server.api()
        stack.callback(api.close)
        deployment = api.deployment("check-environment", "environment-check")
        yield Target(server, api, deployment, spec, worker_log, root)


def _anonymous(target: Target, **headers: str) -> httpx.Client:
    return httpx.Client(base_url=target.server.api_url, timeout=30, headers=headers)


def _flow_run_ids(target: Target) -> set[str]:
    return {r["id"] for r in target.api.flow_runs(target.deployment["id"])}


def _scheduled_run(target: Target) -> dict[str, Any]:
    """A flow run that stays Scheduled (far in the future): something to attack without a worker taking it."""
    later = {"type": "SCHEDULED", "name": "Scheduled", "state_details": {"scheduled_time": "2099-01-01T00:00:00Z"}}
    response = target.api.client.post(
        "/flow_runs/",
        json={"flow_id": target.deployment["flow_id"], "deployment_id": target.deployment["id"], "state": later},
    )
    assert response.status_code in (200, 201), response.text
    run: dict[str, Any] = response.json()
    return run


# --- no credentials ---------------------------------------------------------------------------------------------


def test_ui_settings_announce_basic_auth_and_csrf(target: Target) -> None:
    settings = httpx.get(f"{target.server.url}/ui-settings", timeout=30).json()
    assert settings["auth"] == "BASIC" and settings["csrf_enabled"] is True, settings
    # Only the health probe stays open (load balancers, systemd checks).
    assert httpx.get(f"{target.server.api_url}/health", timeout=30).status_code == 200


@pytest.mark.parametrize(
    "credentials", [{}, {"Authorization": "Basic ZGF0YWdlbjp3cm9uZw=="}], ids=["no-auth", "wrong-auth"]
)
def test_reads_without_the_auth_string_are_refused(target: Target, credentials: dict[str, str]) -> None:
    run = _scheduled_run(target)
    with _anonymous(target, **credentials) as anonymous:
        for method, path, body in [
            ("GET", f"/deployments/{target.deployment['id']}", None),
            ("GET", f"/flow_runs/{run['id']}", None),
            ("GET", "/csrf-token?client=probe", None),
            ("GET", "/admin/version", None),
        ]:
            response = anonymous.request(method, path, json=body)
            assert response.status_code == 401, (method, path, response.status_code, response.text)


def test_changes_without_the_auth_string_are_refused_and_change_nothing(target: Target) -> None:
    run = _scheduled_run(target)
    before_runs = _flow_run_ids(target)
    deployment_id = target.deployment["id"]
    pull_steps = target.api.client.get(f"/deployments/{deployment_id}").json()["pull_steps"]
    shell_step = {"prefect.deployments.steps.run_shell_script": {"script": "echo pwned"}}
    probes: list[tuple[str, str, Any]] = [
        ("POST", f"/deployments/{deployment_id}/create_flow_run", {"parameters": {"spec": target.spec}}),
        ("POST", "/logs/filter", {"limit": 10}),
        ("POST", "/artifacts/filter", {"limit": 10}),
        ("POST", f"/flow_runs/{run['id']}/set_state", {"state": {"type": "CANCELLED", "name": "Cancelled"}}),
        ("PATCH", f"/deployments/{deployment_id}", {"pull_steps": [shell_step]}),
        ("DELETE", f"/flow_runs/{run['id']}", None),
    ]
    # Without credentials and also with a forged CSRF pair: neither check lets the call through.
    for headers in ({}, {"Prefect-Csrf-Token": "forged", "Prefect-Csrf-Client": "forged"}):
        with _anonymous(target, **headers) as anonymous:
            for method, path, body in probes:
                response = anonymous.request(method, path, json=body)
                assert response.status_code in REFUSED, (method, path, response.status_code, response.text)

    assert _flow_run_ids(target) == before_runs
    assert target.api.flow_run(run["id"])["state_type"] == "SCHEDULED"
    assert target.api.client.get(f"/deployments/{deployment_id}").json()["pull_steps"] == pull_steps


def test_an_authenticated_change_without_the_csrf_token_is_refused(target: Target) -> None:
    run = _scheduled_run(target)
    with httpx.Client(base_url=target.server.api_url, timeout=30) as plain:
        header = {"Authorization": "Basic " + base64.b64encode(target.server.auth_string.encode()).decode()}
        response = plain.post(
            f"/flow_runs/{run['id']}/set_state", json={"state": {"type": "CANCELLED"}}, headers=header
        )
        assert response.status_code == 403 and "CSRF" in response.text, response.text
        # Reads need no token: the auth string alone is enough for them.
        assert plain.get(f"/flow_runs/{run['id']}", headers=header).status_code == 200
    assert target.api.flow_run(run["id"])["state_type"] == "SCHEDULED"


# --- events -----------------------------------------------------------------------------------------------------


def _ws_url(target: Target, direction: str) -> str:
    return f"ws://127.0.0.1:{target.server.port}/api/events/{direction}"


def _refused_socket(target: Target, direction: str, subprotocols: list[str] | None, first: dict[str, Any]) -> None:
    """Open the events socket from a foreign origin, send `first`, and expect no data: refused or closed."""
    try:
        protocols = [Subprotocol(p) for p in subprotocols] if subprotocols else None
        with connect(_ws_url(target, direction), origin=EVIL_ORIGIN, subprotocols=protocols, open_timeout=30) as ws:
            ws.send(json.dumps(first))
            if direction == "out":
                ws.send(json.dumps({"type": "filter", "filter": {}}))
            answer = ws.recv(timeout=30)
    except InvalidStatus as exc:
        assert exc.response.status_code in REFUSED, exc.response.status_code
        return
    except ConnectionClosed as exc:
        assert exc.rcvd is not None and exc.rcvd.code == 1008, exc  # policy violation: no or wrong token
        return
    raise AssertionError(f"the events socket answered without credentials: {answer!r:.300}")


@pytest.mark.parametrize("direction", ["out", "in"])
@pytest.mark.parametrize(
    ("subprotocols", "first"),
    [
        (None, {"type": "filter", "filter": {}}),  # a client that skips the auth handshake
        (["prefect"], {"type": "auth", "token": None}),
        (["prefect"], {"type": "auth", "token": "datagen:wrong"}),
    ],
    ids=["legacy", "no-token", "wrong-token"],
)
def test_events_websocket_refuses_clients_without_the_auth_string(
    target: Target, direction: str, subprotocols: list[str] | None, first: dict[str, Any]
) -> None:
    _refused_socket(target, direction, subprotocols, first)


def _failure_event(resource_id: str) -> dict[str, Any]:
    return {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": "datagen.flow-run.failed",  # what the failure automation reacts to
        "resource": {"prefect.resource.id": resource_id},
        "payload": {"task": "forged", "message": "forged"},
    }


def _events_about(target: Target, resource_id: str) -> list[dict[str, Any]]:
    body = {"filter": {"any_resource": {"id": [resource_id]}}, "limit": 50}
    response = target.api.client.post("/events/filter", json=body)
    response.raise_for_status()
    events: list[dict[str, Any]] = response.json()["events"]
    return events


def test_forged_events_without_the_auth_string_are_not_recorded(target: Target) -> None:
    forged = f"prefect.flow-run.{uuid.uuid4()}"
    # Over HTTP and over the websocket, with no credentials.
    with _anonymous(target) as anonymous:
        assert anonymous.post("/events", json=[_failure_event(forged)]).status_code in REFUSED
    try:
        with connect(_ws_url(target, "in"), origin=EVIL_ORIGIN, open_timeout=30) as ws:
            ws.send(json.dumps(_failure_event(forged)))
            ws.recv(timeout=5)
    except (InvalidStatus, ConnectionClosed, TimeoutError):
        pass
    # The control: the same event from a client holding the auth string is recorded (so the query below works).
    genuine = f"prefect.flow-run.{uuid.uuid4()}"
    assert target.api.client.post("/events", json=[_failure_event(genuine)]).status_code == 204
    deadline = time.monotonic() + 120
    while not _events_about(target, genuine):
        assert time.monotonic() < deadline, "the authenticated event never showed up"
        time.sleep(1.0)
    assert _events_about(target, forged) == []


# --- other origins ------------------------------------------------------------------------------------------------


def test_cross_origin_requests_are_allowed_for_the_ui_origin_only(target: Target) -> None:
    preflight = {"Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": "authorization"}
    with _anonymous(target) as anonymous:
        evil = anonymous.options("/flow_runs/filter", headers={"Origin": EVIL_ORIGIN, **preflight})
        assert evil.status_code == 400 and "access-control-allow-origin" not in evil.headers, evil.headers
        ui_origin = target.server.url  # the UI is served by the server itself
        ui = anonymous.options("/flow_runs/filter", headers={"Origin": ui_origin, **preflight})
        assert ui.status_code == 200 and ui.headers["access-control-allow-origin"] == ui_origin, ui.headers
    # A simple request carries no allow-origin for a foreign page: the browser hides the answer from it.
    read = target.api.client.get("/admin/version", headers={"Origin": EVIL_ORIGIN})
    assert read.status_code == 200
    assert read.headers.get("access-control-allow-origin") not in ("*", EVIL_ORIGIN), read.headers


def test_server_listens_on_loopback_only(target: Target) -> None:
    # /proc/net/tcp: local address as little-endian hex IP:port, state 0A = LISTEN.
    port_hex = f"{target.server.port:04X}"
    listening = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                if state == "0A" and local.endswith(f":{port_hex}"):
                    listening.append(local.split(":")[0])
    assert listening == ["0100007F"], listening  # 127.0.0.1 and nothing else


# --- job variables: a run carries no code and no settings ----------------------------------------------------------


@pytest.mark.parametrize(
    "job_variables",
    [
        {"command": "echo pwned"},
        {"env": {"DATAGEN_S3_ENDPOINT_URL": "http://127.0.0.1:9/"}},
        {"working_dir": "/tmp"},
        {"stream_output": False},
    ],
    ids=["command", "env", "working_dir", "anything"],
)
def test_a_run_with_job_variables_is_refused(target: Target, job_variables: dict[str, Any]) -> None:
    before = _flow_run_ids(target)
    response = target.api.create_flow_run(target.deployment["id"], {"spec": target.spec}, job_variables=job_variables)
    assert response.status_code == 422, response.text
    assert "Additional properties are not allowed" in response.json()["detail"], response.text
    assert _flow_run_ids(target) == before
    # Nor can a scheduled run be given them afterwards.
    run = _scheduled_run(target)
    patched = target.api.client.patch(f"/flow_runs/{run['id']}", json={"job_variables": job_variables})
    assert patched.status_code == 422, patched.text
    assert target.api.flow_run(run["id"])["job_variables"] == {}


def test_job_variables_patched_into_a_deployment_get_no_run_started(target: Target) -> None:
    # Prefect 3.9.1 stores a deployment PATCH's job variables unchecked (only auth-string holders can send one);
    # every run of that deployment then fails the pool's schema, and the worker has no slot for them anyway.
    path = f"/deployments/{target.deployment['id']}"
    before = _flow_run_ids(target)
    patched = target.api.client.patch(path, json={"job_variables": {"command": "echo pwned"}})
    try:
        assert patched.status_code in (204, 422), patched.text
        response = target.api.create_flow_run(target.deployment["id"], {"spec": target.spec})
        assert response.status_code == 422 and "command" in response.text, response.text
        assert _flow_run_ids(target) == before
    finally:
        restored = target.api.client.patch(path, json={"job_variables": {}})
        assert restored.status_code == 204, restored.text


def test_pool_and_deployments_expose_no_job_variables(target: Target) -> None:
    pool = target.api.client.get(f"/work_pools/{POOL}").json()
    template = pool["base_job_template"]
    assert template["variables"]["properties"] == {} and template["variables"]["additionalProperties"] is False
    assert not {"command", "env", "working_dir"} & set(template["job_configuration"]), template
    deployments = target.api.client.post("/deployments/filter", json={}).json()
    assert len(deployments) >= 6
    assert {d["name"]: d["job_variables"] for d in deployments if d["job_variables"]} == {}


def _run_around_the_schema(target: Target, job_variables: dict[str, Any]) -> str:
    """POST /flow_runs/ does not check job variables against the pool (only an auth-string holder can call it)."""
    body = {
        "flow_id": target.deployment["flow_id"],
        "deployment_id": target.deployment["id"],
        "work_pool_name": POOL,
        "work_queue_name": "default",
        "parameters": {"spec": target.spec},
        "job_variables": job_variables,
        "state": {
            "type": "SCHEDULED",
            "name": "Scheduled",
            "state_details": {"scheduled_time": datetime.now(UTC).isoformat()},
        },
    }
    response = target.api.client.post("/flow_runs/", json=body)
    assert response.status_code in (200, 201), response.text
    return str(response.json()["id"])


def _wait_terminal_or(target: Target, flow_run_id: str, tripped: Any) -> dict[str, Any]:
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while True:
        run = target.api.flow_run(flow_run_id)
        assert not tripped(), f"the run's job variables took effect; run {run['state_type']}"
        if run["state_type"] in TERMINAL_STATES:
            return run
        assert time.monotonic() < deadline, f"run still {run['state_type']}\n{target.worker_log.read_text()[-3000:]}"
        time.sleep(1.0)


def test_the_worker_ignores_a_command_smuggled_past_the_schema(target: Target, tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    flow_run_id = _run_around_the_schema(target, {"command": f"touch {marker}"})
    run = _wait_terminal_or(target, flow_run_id, marker.exists)
    # The box ran the deployment's flow (the environment check), not the run's command.
    assert run["state_type"] == "COMPLETED", (run["state"], target.api.log_text(flow_run_id))
    assert not marker.exists()


def test_the_worker_ignores_an_environment_smuggled_past_the_schema(target: Target) -> None:
    listener = Listener()
    try:
        env = {"DATAGEN_S3_ENDPOINT_URL": listener.url, "DATAGEN_SERVER_URLS": json.dumps([listener.url])}
        flow_run_id = _run_around_the_schema(target, {"env": env})
        run = _wait_terminal_or(target, flow_run_id, lambda: bool(listener.requests))
        # The S3 check used the box's endpoint and credentials; the listener heard nothing.
        assert run["state_type"] == "COMPLETED", (run["state"], target.api.log_text(flow_run_id))
        assert listener.requests == []
    finally:
        listener.close()


def test_the_auth_string_is_in_no_log_or_database(target: Target) -> None:
    # After every probe above: the server's database (SQLite + its WAL), the server's and the worker's logs.
    secret = target.server.auth_string.split(":", 1)[1].encode()
    files = [target.server.log_path, target.worker_log, *target.server.home.glob("*.db*")]
    assert any(f.name.startswith("prefect.db") for f in files), files
    assert [f for f in files if secret in f.read_bytes()] == []


# --- the scripts --------------------------------------------------------------------------------------------------


def _script(args: list[str], env: dict[str, str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    return subprocess.run(
        ["bash", *args], env={**base, **env}, cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout
    )


def test_auth_file_is_generated_once_private_and_refused_when_others_can_read_it(tmp_path: Path) -> None:
    file = tmp_path / "state" / "prefect-auth"
    ensure = f". infra/prefect-auth.sh && datagen_ensure_auth_file {file}"
    assert _script(["-c", ensure], {}).returncode == 0
    first = file.read_text()
    assert first.startswith("datagen:") and len(first.strip()) > 30
    assert oct(file.stat().st_mode & 0o777) == "0o600"
    assert _script(["-c", ensure], {}).returncode == 0
    assert file.read_text() == first  # never replaced: workers and people keep the string they were given
    file.chmod(0o644)
    read = _script(["-c", f". infra/prefect-auth.sh && datagen_read_auth_file {file} probe"], {})
    assert read.returncode == 2 and "readable by others" in read.stderr, read.stderr


@pytest.mark.parametrize("script", ["infra/deploy.sh", "infra/prefect-worker.sh"])
def test_clients_without_the_auth_string_stop_and_say_how_to_get_it(script: str, tmp_path: Path) -> None:
    env = {"PREFECT_API_URL": "http://127.0.0.1:9/api", "DATAGEN_PREFECT_AUTH_FILE": str(tmp_path / "missing")}
    result = _script([script], env)
    assert result.returncode == 2, result.stdout + result.stderr
    assert "PREFECT_API_AUTH_STRING" in result.stderr and "docs/security.md" in result.stderr, result.stderr


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"PREFECT_SERVER_API_HOST": "0.0.0.0"}, "set PREFECT_UI_URL"),
        ({"PREFECT_SERVER_API_CORS_ALLOWED_ORIGINS": "*"}, "must name origins"),
    ],
    ids=["all-interfaces-without-ui-url", "cors-star"],
)
def test_server_script_refuses_an_open_configuration(env: dict[str, str], message: str, tmp_path: Path) -> None:
    env = {**env, "PREFECT_HOME": str(tmp_path), "PREFECT_SERVER_API_AUTH_STRING": "datagen:probe"}
    result = _script(["infra/prefect-server.sh", "run"], env)
    assert result.returncode == 2 and message in result.stderr, result.stdout + result.stderr


EMBEDDED_PROBE = """
from flows.cli import _quiet_prefect_defaults

_quiet_prefect_defaults()  # what `datagen run` / `datagen demo` do before the first flow
import httpx
from prefect import flow
from prefect.client.orchestration import get_client


@flow
def probe() -> None:
    with get_client(sync_client=True) as client:
        url = str(client.api_url).rstrip("/")
        print("authenticated", client.request("GET", "/admin/version").status_code)
    print("anonymous", httpx.get(url + "/admin/version").status_code)


probe()
"""


def test_the_embedded_server_of_datagen_run_and_demo_refuses_other_local_users(tmp_path: Path) -> None:
    env = {"PREFECT_HOME": str(tmp_path / "prefect-home"), "PATH": os.environ["PATH"]}
    result = subprocess.run(
        [sys.executable, "-c", EMBEDDED_PROBE], env=env, cwd=tmp_path, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "authenticated 200" in result.stdout and "anonymous 401" in result.stdout, result.stdout
