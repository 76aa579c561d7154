"""Two kinds of credential and a worker that runs only what the box's operator pinned, attacked from outside.

The project's own deployment: `infra/prefect-server.sh run`, `infra/prefect-proxy.sh run` (nginx) in front of it,
`infra/deploy.sh` through the proxy with an operator's credential (it also pins, as on the box), and
`infra/prefect-worker.sh` (`python -m datagen.worker`) through the proxy with the box credential. Runs are started
with a runner's credential, as a teammate in the UI would (docs/security.md).
"""

from __future__ import annotations

import copy
import os
import stat
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from tests.prefect_fixtures import (
    POOL,
    REPO_ROOT,
    PrefectApi,
    PrefectProxy,
    PrefectServer,
    prefect_proxy,
    prefect_server,
    prefect_worker,
    worker_env,
    write_prompts,
)

pytestmark = pytest.mark.slow

RUN_TIMEOUT_S = 300.0  # a hang guard, not a speed requirement


@dataclass
class Deployment:
    server: PrefectServer
    proxy: PrefectProxy
    operator: PrefectApi
    runner: PrefectApi
    operator_env: dict[str, str]
    spec: dict[str, Any]
    worker_log: Path
    root: Path


@pytest.fixture(scope="module")
def deployment(tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3) -> Iterator[Deployment]:
    """Server, proxy, operator and runner credentials, deploy + pin, one worker through the proxy."""
    root = tmp_path_factory.mktemp("operator")
    prompts = write_prompts(root / "prompts.jsonl", ["Say hi.", "Name a colour."])
    spec = {"sources": [{"path": str(prompts)}], "model_path": str(ensure_model_dir()), "namespace": "pin-ns"}
    with ExitStack() as stack:
        server = stack.enter_context(prefect_server(root / "prefect"))
        proxy = stack.enter_context(prefect_proxy(server, root / "proxy"))
        operator_credential = proxy.add_user("olga", "operator")
        runner_credential = proxy.add_user("rui", "runner")
        operator_env = proxy.client_env(server, root / "operator-home", operator_credential)
        deploy = subprocess.run(
            ["bash", str(REPO_ROOT / "infra" / "deploy.sh")],
            env=operator_env,
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        assert "pinned work pool gpu-box-1" in deploy.stdout, deploy.stdout
        worker_log = root / "worker.log"
        box = worker_env(local_s3, f"{root.name}/", root / "work", length_mean=8, length_max=16)
        # The box reaches the server through the proxy too, with the box credential (the server's string).
        stack.enter_context(
            prefect_worker(server, root / "worker-home", worker_log, {**box, "PREFECT_API_URL": proxy.api_url})
        )
        operator, runner = proxy.api(operator_credential), proxy.api(runner_credential)
        stack.callback(operator.close)
        stack.callback(runner.close)
        yield Deployment(server, proxy, operator, runner, operator_env, spec, worker_log, root)


def _env_check_id(api: PrefectApi) -> str:
    return str(api.deployment("check-environment", "environment-check")["id"])


def _run_env_check(d: Deployment) -> dict[str, Any]:
    """Start the environment-check deployment with the runner's credential; its final state."""
    response = d.runner.create_flow_run(_env_check_id(d.runner), {"spec": d.spec})
    assert response.status_code == 201, response.text
    return d.runner.wait_for_flow_run(response.json()["id"], RUN_TIMEOUT_S, diagnostics=d.worker_log)


def _pin(d: Deployment) -> str:
    """`datagen pin` on the box, as its operator does."""
    result = subprocess.run(
        [str(REPO_ROOT / ".venv" / "bin" / "datagen"), "pin"],
        env=d.operator_env,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def test_the_runner_credential_cannot_change_deployments_or_pools_or_read_secrets(deployment: Deployment) -> None:
    d = deployment
    dep_id = _env_check_id(d.runner)
    before = d.operator.deployment("check-environment", "environment-check")
    shell = [{"prefect.deployments.steps.run_shell_script": {"script": f"touch {d.root / 'runner-pwned'}"}}]
    template = {"job_configuration": {"command": "{{ command }}"}, "variables": {"properties": {"command": {}}}}
    refused = {
        "PATCH pull steps": d.runner.client.patch(f"/deployments/{dep_id}", json={"pull_steps": shell}),
        "PATCH entrypoint": d.runner.client.patch(f"/deployments/{dep_id}", json={"entrypoint": "x.py:f"}),
        "PATCH job variables": d.runner.client.patch(f"/deployments/{dep_id}", json={"job_variables": {"a": 1}}),
        "DELETE deployment": d.runner.client.delete(f"/deployments/{dep_id}"),
        "PATCH work pool": d.runner.client.patch(f"/work_pools/{POOL}", json={"base_job_template": template}),
        "create a work pool": d.runner.client.post("/work_pools/", json={"name": "mine", "type": "process"}),
        "read block secrets": d.runner.client.post("/block_documents/filter", json={"include_secrets": True}),
        "emit an event": d.runner.client.post("/events", json=[]),
        "encoded path": d.runner.client.post(f"/deployment%73/{dep_id}/create_flow_run", json={}),
    }
    statuses = {what: r.status_code for what, r in refused.items()}
    assert all(status in (400, 403) for status in statuses.values()), statuses
    assert "may not PATCH" in refused["PATCH pull steps"].text
    after = d.operator.deployment("check-environment", "environment-check")
    assert (after["pull_steps"], after["entrypoint"], after["job_variables"]) == (
        before["pull_steps"],
        before["entrypoint"],
        before["job_variables"],
    )
    assert d.operator.client.get(f"/work_pools/{POOL}").json()["base_job_template"]["job_configuration"].get(
        "command"
    ) in (None, "")
    # No credential, a wrong one: 401 without WWW-Authenticate (the UI shows its own login box).
    anonymous = PrefectApi(d.proxy.api_url, None)
    wrong = PrefectApi(d.proxy.api_url, "rui:not-the-password")
    try:
        for api in (anonymous, wrong):
            response = api.client.get(f"/deployments/{dep_id}")
            assert response.status_code == 401 and "www-authenticate" not in response.headers, response.headers
    finally:
        anonymous.close()
        wrong.close()
    # What the runner may do: start a run (here one due in 2099: no worker takes it), read it and its logs, cancel it.
    later = {"type": "SCHEDULED", "state_details": {"scheduled_time": "2099-01-01T00:00:00Z"}}
    created = d.runner.client.post(
        f"/deployments/{dep_id}/create_flow_run", json={"parameters": {"spec": d.spec}, "state": later}
    )
    assert created.status_code == 201, created.text
    run_id = created.json()["id"]
    assert d.runner.flow_run(run_id)["state_type"] == "SCHEDULED"
    assert d.runner.logs(run_id) == []
    cancel = d.runner.client.post(f"/flow_runs/{run_id}/set_state", json={"state": {"type": "CANCELLED"}})
    assert cancel.status_code in (200, 201), cancel.text
    assert d.runner.flow_run(run_id)["state_type"] == "CANCELLED"
    assert not (d.root / "runner-pwned").exists()


def test_an_operator_patched_pull_step_does_not_run_until_the_box_re_pins(deployment: Deployment) -> None:
    d = deployment
    dep_id = _env_check_id(d.operator)
    original = d.operator.deployment("check-environment", "environment-check")["pull_steps"]
    marker = d.root / "pull-step-ran"
    shell = {"prefect.deployments.steps.run_shell_script": {"script": f"touch {marker}"}}
    try:
        patched = d.operator.client.patch(f"/deployments/{dep_id}", json={"pull_steps": [*original, shell]})
        assert patched.status_code == 204, patched.text
        run = _run_env_check(d)
        assert run["state_type"] == "FAILED", run
        message = run["state"]["message"]
        assert "refused by this box's pin" in message and "pull_steps changed" in message, message
        assert "check-environment/environment-check" in message, message
        assert not marker.exists(), "the patched pull step ran on the worker"
        check = subprocess.run(
            [str(REPO_ROOT / ".venv" / "bin" / "datagen"), "pin", "--check"],
            env=d.operator_env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert check.returncode == 1 and "environment-check: pull_steps changed" in check.stdout, check.stdout
        # The operator decides the change is theirs and pins it on the box: the pinned steps run, then the flow.
        assert "pinned work pool" in _pin(d)
        run = _run_env_check(d)
        assert run["state_type"] == "COMPLETED", (run, d.runner.log_text(run["id"]))
        assert marker.exists(), "the pinned pull steps did not run"
    finally:
        d.operator.client.patch(f"/deployments/{dep_id}", json={"pull_steps": original}).raise_for_status()
        _pin(d)


def test_an_operator_patched_job_template_does_not_run_and_the_command_stays_the_worker_s(
    deployment: Deployment,
) -> None:
    d = deployment
    original = d.operator.client.get(f"/work_pools/{POOL}").json()["base_job_template"]
    marker = d.root / "template-command-ran"
    template = copy.deepcopy(original)
    template["job_configuration"]["command"] = "{{ command }}"
    template["variables"]["properties"]["command"] = {"type": "string", "default": f"touch {marker}"}
    try:
        patched = d.operator.client.patch(f"/work_pools/{POOL}", json={"base_job_template": template})
        assert patched.status_code == 204, patched.text
        run = _run_env_check(d)
        assert run["state_type"] == "FAILED", run
        message = run["state"]["message"]
        assert f"work pool {POOL}: base_job_template changed" in message, message
        assert not marker.exists(), "the patched template's command ran on the worker"
        # Pinned, the template is accepted, yet the command is still the worker's own: the run completes.
        _pin(d)
        run = _run_env_check(d)
        assert run["state_type"] == "COMPLETED", (run, d.runner.log_text(run["id"]))
        assert not marker.exists(), "a command from the job template ran"
    finally:
        d.operator.client.patch(f"/work_pools/{POOL}", json={"base_job_template": original}).raise_for_status()
        _pin(d)


def test_the_proxy_keeps_credentials_private_and_will_not_listen_beyond_loopback_without_tls(tmp_path: Path) -> None:
    state = tmp_path / "proxy"
    env = {"PATH": os.environ["PATH"], "DATAGEN_PROXY_DIR": str(state), "PREFECT_SERVER_API_AUTH_STRING": "datagen:x"}
    script = str(REPO_ROOT / "infra" / "prefect-proxy.sh")
    added = subprocess.run(["bash", script, "add-user", "rui", "runner"], env=env, capture_output=True, text=True)
    assert added.returncode == 0, added.stderr
    modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in (state, state / "credentials", state / "users.map")}
    assert modes == {"proxy": 0o700, "credentials": 0o700, "users.map": 0o600}
    assert stat.S_IMODE((state / "credentials" / "rui").stat().st_mode) == 0o600
    for bad in (["add-user", "rui", "runner"], ["add-user", "x", "admin"], ["add-user", "../x", "runner"]):
        assert subprocess.run(["bash", script, *bad], env=env, capture_output=True).returncode == 2, bad
    open_env = {**env, "DATAGEN_PROXY_LISTEN": "0.0.0.0:1"}
    refused = subprocess.run(["bash", script, "run"], env=open_env, capture_output=True, text=True, timeout=60)
    assert refused.returncode == 2 and "needs TLS" in refused.stderr, refused.stderr
