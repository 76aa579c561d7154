"""Deploy, trigger, schedule and inspect datagen's flows through a real Prefect server and a process worker.

One server, one `infra/deploy.sh`, one worker and one local S3 server for the whole module; runs are
triggered through the REST API exactly as the UI and users' scripts do, and inspected through it.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations.report import is_generated_name
from datagen.publishing.storage import ObjectStore
from tests.prefect_fixtures import (
    POOL,
    PrefectApi,
    PrefectServer,
    prefect_server,
    prefect_worker,
    run_deploy,
    worker_env,
    write_prompts,
)

pytestmark = pytest.mark.slow

FLOW = "expand-dataset"
RUN_TIMEOUT_S = 300.0  # a hang guard, not a speed requirement
EXPECTED_ARTIFACTS = {
    "environment-report",
    "generation-progress",
    "validation-report",
    "published-dataset",
    "run-report",
}

PROMPTS = [
    "Explain why the sky is blue in two sentences.",
    "Write a haiku about version control.",
    "What is the derivative of x^3 + 2x?",
    "Name three uses of a hash map.",
    "Summarise the plot of Hamlet briefly.",
    "How do I reverse a list in Python?",
]


class WebhookReceiver:
    """A local HTTP endpoint that records every POST body: where the failure automation's notifications land."""

    def __init__(self) -> None:
        self.bodies: list[str] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length", "0"))
                received.append(self.rfile.read(length).decode("utf-8", "replace"))
                self.send_response(200)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/notify"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def wait_for(self, *texts: str, timeout: float = 120.0) -> str:
        """The first body containing every text; fails with what did arrive."""
        deadline = time.monotonic() + timeout
        while True:
            for body in list(self.bodies):
                if all(t in body for t in texts):
                    return body
            if time.monotonic() > deadline:
                raise AssertionError(f"no notification with {texts} within {timeout:.0f} s; got {self.bodies}")
            time.sleep(1.0)


@dataclass
class Stack:
    """What the tests talk to: the Prefect server and its API, the local S3 server, inputs for a run."""

    server: PrefectServer
    api: PrefectApi
    store: ObjectStore
    worker_log: Path
    prompts: Path
    model_dir: Path
    alerts: WebhookReceiver
    box_env: dict[str, str]  # the worker's DATAGEN_* settings: the box's environment file
    root: Path


def fast_spec(stack: Stack, namespace: str, **overrides: Any) -> dict[str, Any]:
    """A run spec that finishes in seconds on the stand-in: 6 prompts, 2 shards, short outputs, relaxed gate."""
    spec: dict[str, Any] = {
        "sources": [{"path": str(stack.prompts)}],
        "model_path": str(stack.model_dir),
        "namespace": namespace,
        "shard_size": 3,
        "context_length": 4096,
        "sampling": {"max_new_tokens": 64},
        # Every test runs the same prompts: without this, a later run would skip them as already published.
        "skip_published": False,
        "validation": {"min_answer_tokens": 0, "reject_truncated": False},
        "quality_gate": {
            "max_reject_rate": 1.0,
            "max_short_share": 1.0,
            "min_median_completion_tokens": 0,
        },
    }
    spec.update(overrides)
    return spec


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3) -> Iterator[Stack]:
    """Prefect server + `infra/deploy.sh` + one process worker (on the session's S3 server), stopped at the end."""
    root = tmp_path_factory.mktemp("prefect-e2e")
    model_dir = ensure_model_dir()
    prompts = write_prompts(root / "prompts.jsonl", PROMPTS)
    s3_prefix = f"{root.name}/"
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=s3_prefix))
    with ExitStack() as stack:
        # The scheduler looks for active schedules every 60 s by default; the schedule test needs less.
        server = stack.enter_context(
            prefect_server(root / "prefect", {"PREFECT_SERVER_SERVICES_SCHEDULER_LOOP_SECONDS": "2"})
        )
        # The failure automation notifies a local webhook; deploy.sh installs it when given the URL.
        receiver = WebhookReceiver()
        stack.callback(receiver.close)
        # Deploy from the repo root, as a user would; DATAGEN_HOME here must not be baked into the deployment.
        deploy_env = {"DATAGEN_HOME": "/nonexistent/deploy-machine-path", "DATAGEN_ALERT_WEBHOOK_URL": receiver.url}
        deploy_output = run_deploy(server, root / "cli-home", deploy_env)
        assert "automation 'datagen: a run failed or crashed' installed" in deploy_output, deploy_output
        worker_log = root / "worker.log"
        # Settings come from the box, never from a run: free ports per server start (DATAGEN_BASE_PORT=0), so
        # servers of a run that went wrong can never collide with the next run's.
        box_env = worker_env(local_s3, s3_prefix, root / "work", length_mean=24, length_max=48)
        box_env["DATAGEN_BASE_PORT"] = "0"
        # This worker serves the default queue only: a run sent to another box's queue waits for that box.
        stack.enter_context(
            prefect_worker(server, root / "worker-home", worker_log, {**box_env, "DATAGEN_WORK_QUEUE": "default"})
        )
        api = server.api()
        stack.callback(api.close)
        yield Stack(server, api, store, worker_log, prompts, model_dir, receiver, box_env, root)


def _deployment_id(stack: Stack, name: str, flow: str = FLOW) -> str:
    return str(stack.api.deployment(flow, name)["id"])


def _start(
    stack: Stack, deployment: str, parameters: dict[str, Any], flow: str = FLOW, work_queue: str | None = None
) -> str:
    response = stack.api.create_flow_run(_deployment_id(stack, deployment, flow), parameters, work_queue=work_queue)
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _failure_report(stack: Stack, flow_run_id: str, run: dict[str, Any]) -> str:
    return (
        f"state {run['state_type']}: {run['state'] and run['state']['message']}\n"
        f"logs:\n{stack.api.log_text(flow_run_id)}"
    )


def test_deploy_registers_every_deployment_on_the_process_pool(stack: Stack) -> None:
    pool = stack.api.client.get(f"/work_pools/{POOL}")
    assert pool.status_code == 200, pool.text
    assert pool.json()["type"] == "process"

    manual = stack.api.deployment(FLOW, "manual")
    scheduled = stack.api.deployment(FLOW, "scheduled-expansion")
    check = stack.api.deployment("check-environment", "environment-check")
    for deployment in (manual, scheduled, check):
        assert deployment["work_pool_name"] == POOL
        assert deployment["enforce_parameter_schema"] is True
        # The worker's own DATAGEN_HOME is read when a run starts (not the deploying machine's).
        assert deployment["pull_steps"] == [
            {"prefect.deployments.steps.set_working_directory": {"directory": "{{ $DATAGEN_HOME }}"}}
        ]
    # The UI form is rendered from this schema: the run spec is one nested object parameter.
    spec_schema = manual["parameter_openapi_schema"]["properties"]["spec"]
    assert "RunSpec" in json.dumps(spec_schema) or "$ref" in json.dumps(spec_schema)

    (schedule,) = scheduled["schedules"]
    assert schedule["active"] is False
    assert schedule["schedule"]["cron"] == "0 2 * * *"
    assert schedule["schedule"]["timezone"] == "UTC"
    assert manual["schedules"] == []


def test_scheduled_expansion_creates_runs_once_its_schedule_is_turned_on(stack: Stack) -> None:
    deployment = stack.api.deployment(FLOW, "scheduled-expansion")
    (schedule,) = deployment["schedules"]
    path = f"/deployments/{deployment['id']}/schedules/{schedule['id']}"
    response = stack.api.client.patch(path, json={"active": True})
    assert response.status_code == 204, response.text
    try:
        # Turning a schedule on is what the UI toggle does; the server then schedules the next runs.
        runs = stack.api.wait_for_scheduled_runs(deployment["id"], timeout=60)
        assert runs, "no scheduled runs created"
        for run in runs:
            assert run["state_type"] == "SCHEDULED"
            assert run["expected_start_time"].split("T")[1].startswith("02:00:00")
    finally:
        response = stack.api.client.patch(path, json={"active": False})
        assert response.status_code == 204, response.text


@pytest.mark.parametrize(
    ("spec", "field", "reason"),
    [
        ({"shard_size": "lots"}, "spec.shard_size", "is not of type 'integer'"),
        ({"sampling": {"max_new_tokens": 0}}, "spec.sampling.max_new_tokens", "minimum"),
        ({"quality_gate": {"max_reject_rate": 1.5}}, "spec.quality_gate.max_reject_rate", "maximum"),
        ({"namespace": "team/expansion"}, "spec.namespace", "does not match"),
    ],
)
def test_schema_rejects_a_bad_parameter_naming_the_field(
    stack: Stack, spec: dict[str, Any], field: str, reason: str
) -> None:
    deployment_id = _deployment_id(stack, "manual")
    response = stack.api.create_flow_run(deployment_id, {"spec": spec})
    assert 400 <= response.status_code < 500, response.text
    detail = response.json()["detail"]
    assert f"'{field}'" in detail
    assert reason in detail
    # Nothing was created that a worker could pick up.
    runs = stack.api.flow_runs(deployment_id)
    assert not [r for r in runs if r["parameters"].get("spec") == spec]


def test_optional_fields_are_plain_inputs_that_take_a_value_or_null(stack: Stack) -> None:
    # Issue 25.5: each optional field was an anyOf with a null branch, which the run form draws as a tab reading
    # 'Property is type "None"'. Now it is the plain input, and the server still takes an explicit null.
    definitions = stack.api.deployment(FLOW, "manual")["parameter_openapi_schema"]["definitions"]
    for model, field, kind in [
        ("RunSpec", "pilot", "string"),
        ("RunSpec", "max_prompt_tokens", "integer"),
        ("PromptSource", "name", "string"),
        ("PromptSource", "max_rows", "integer"),
        ("PromptSource", "tools", "array"),
    ]:
        prop = definitions[model]["properties"][field]
        assert prop["type"] == kind and "anyOf" not in prop and "default" not in prop, (model, field, prop)
    assert '"null"' not in json.dumps(definitions), definitions
    deployment_id = _deployment_id(stack, "manual")
    refused = stack.api.create_flow_run(deployment_id, {"spec": {"max_prompt_tokens": "many"}})
    assert refused.status_code == 409 and "spec.max_prompt_tokens" in refused.json()["detail"], refused.text

    # Nulls spelled out, as a spec dumped whole arrives (the multi-box parent's children, a lineage's run_spec),
    # next to an optional value that is set: the run takes both.
    source = {"path": str(stack.prompts), "name": None, "category_field": None, "max_rows": 5, "tools": None}
    spec = fast_spec(stack, "optional-fields", sources=[source], pilot=None, max_prompt_tokens=None)
    flow_run_id = _start(stack, "manual", {"spec": spec})
    run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "COMPLETED", _failure_report(stack, flow_run_id, run)
    manifest = json.loads(stack.store.get_bytes("optional-fields/manifest.json"))
    lineage = manifest["lineage"]
    assert lineage["rows"] + lineage["rejects"] == 5, lineage  # max_rows of the 6 prompts


def test_environment_check_deployment_reports_through_an_artifact(stack: Stack) -> None:
    flow_run_id = _start(
        stack, "environment-check", {"spec": fast_spec(stack, "envcheck-ns")}, flow="check-environment"
    )
    run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "COMPLETED", _failure_report(stack, flow_run_id, run)
    (report,) = [a for a in stack.api.artifacts(flow_run_id) if a["key"] == "environment-report"]
    assert report["type"] == "table"
    rows = json.loads(report["data"])
    assert rows, "empty environment report"


def test_rest_triggered_run_completes_and_publishes_with_artifacts(stack: Stack) -> None:
    namespace = "prefect-e2e-rest"
    flow_run_id = _start(stack, "manual", {"spec": fast_spec(stack, namespace)})
    run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "COMPLETED", _failure_report(stack, flow_run_id, run)

    # Named after what it does, then the words Prefect made up ("expand ns · coral-anaconda"): runs of one
    # namespace stay apart in the run list.
    described, _, words = run["name"].partition(" · ")
    assert described == f"expand {namespace}" and is_generated_name(words), run["name"]

    artifacts = {a["key"]: a for a in stack.api.artifacts(flow_run_id) if a["key"]}
    assert set(artifacts) >= EXPECTED_ARTIFACTS, sorted(artifacts)
    for key, artifact in artifacts.items():
        assert namespace in (artifact["description"] or ""), (key, artifact["description"])
    assert artifacts["generation-progress"]["type"] == "progress"
    assert artifacts["generation-progress"]["data"] == 100
    # The run spec's default turns: every counts conversations (docs/conversations.md, "Progress").
    assert "6 of 6 conversations finished" in artifacts["generation-progress"]["description"]
    # S3 on loopback (a laptop): the link opens the dataset card in a browser (no credentials); the description
    # keeps the s3:// location.
    dataset = artifacts["published-dataset"]
    assert stack.store.uri(f"{namespace}/") in dataset["description"], dataset["description"]
    link = dataset["data"]
    assert "6 rows" in link, link
    url = link[link.index("(") + 1 : link.rindex(")")]  # the artifact's data is markdown: [text](url)
    card = httpx.get(url, timeout=30)
    assert card.status_code == 200, card.text[:300]
    assert card.content == stack.store.get_bytes(f"{namespace}/README.md")
    run_report = artifacts["run-report"]["data"]
    assert f"[open it in the browser]({url})" in run_report, run_report  # the same card link, in the report
    for row in ("| training rows | 6 |", "| servers (one per GPU) | 1 |", "## Per server", "## Time per stage"):
        assert row in run_report, run_report
    assert "| generation |" in run_report and "## Step lengths" in run_report, run_report  # every turn: steps
    assert run["state"]["message"] is None or "Nothing new" not in run["state"]["message"]

    # Failed runs are inspected task by task: every stage shows up under its own name.
    task_names = {t["name"]: t["state_type"] for t in stack.api.task_runs(flow_run_id)}
    assert task_names.get("generate shard-00000") == "COMPLETED", task_names
    assert task_names.get("generate shard-00001") == "COMPLETED", task_names
    assert set(task_names.values()) == {"COMPLETED"}, task_names
    # Issue 25.5: one quality gate and one validation report per run (there were two identical ones).
    gates = [n for n in task_names if n.rsplit("-", 1)[0] == "quality gate"]
    assert len(gates) == 1, sorted(task_names)
    keys = [a["key"] for a in stack.api.artifacts(flow_run_id)]
    assert keys.count("validation-report") == 1, keys

    # The log has no line per shard task run (a 1,000-shard run would be a wall of "Finished in state
    # Completed()"); other task runs still log theirs. Logs ship in batches, after the state.
    stack.api.wait_for_log(flow_run_id, "published s3://")
    names_by_id = {t["id"]: t["name"] for t in stack.api.task_runs(flow_run_id)}
    finished = [
        names_by_id.get(r["task_run_id"], "?")
        for r in stack.api.logs(flow_run_id)
        if str(r["message"]).startswith("Finished in state Completed")
    ]
    assert any(n.startswith("publish") for n in finished), finished  # names end in "-<hex>"
    assert not [n for n in finished if " shard-" in n], finished

    # The dataset really is in S3.
    keys = {o.key for o in stack.store.list(f"{namespace}/")}
    assert f"{namespace}/manifest.json" in keys, sorted(keys)
    assert any(k.startswith(f"{namespace}/data/") for k in keys), sorted(keys)


def test_unsupported_server_flag_fails_the_environment_check_task_before_any_server_starts(stack: Stack) -> None:
    # FA3 does not run on SM120 (the box's allowed capability): the "check environment" task refuses it.
    spec = fast_spec(stack, "prefect-e2e-fa3", server_args=["--attention-backend", "fa3"])
    flow_run_id = _start(stack, "manual", {"spec": spec})
    run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "FAILED", _failure_report(stack, flow_run_id, run)

    failed = [t for t in stack.api.task_runs(flow_run_id) if t["state_type"] == "FAILED"]
    assert len(failed) == 1, _failure_report(stack, flow_run_id, run)
    # The UI lists task runs by name ("check environment-<suffix>"); the state message says why.
    assert failed[0]["name"].startswith("check environment"), failed[0]["name"]
    message = failed[0]["state"]["message"]
    assert "engine.attention_backend" in message and "fa3" in message, message
    _assert_one_line_reason(stack, flow_run_id, run, "check environment", "engine.attention_backend", "fa3")
    (report,) = [a for a in stack.api.artifacts(flow_run_id) if a["key"] == "environment-report"]
    assert "fa3" in report["data"]
    assert not [t for t in stack.api.task_runs(flow_run_id) if t["name"].startswith("generate")]

    # The automation told the team: which run, which task, and the task's message.
    body = stack.alerts.wait_for(run["name"], "Failing task: check environment")
    assert "engine.attention_backend" in body and "fa3" in body, body
    assert "ended Failed" in body and flow_run_id in body, body
    # Issue 25.5: a link to the run that opens the V2 UI (prefect-server.sh sets PREFECT_UI_URL on loopback).
    assert f"{stack.server.url}/v2/runs/flow-run/{flow_run_id}" in body, body
    # Issue 25.3: and one to the run-failure artifact, whose first line is the reason.
    (failure,) = [a for a in stack.api.artifacts(flow_run_id) if a["key"] == "run-failure"]
    assert f"{stack.server.url}/v2/artifacts/artifact/{failure['id']}" in body, body


def _assert_one_line_reason(stack: Stack, flow_run_id: str, run: dict[str, Any], task: str, *reason: str) -> str:
    """Issue 25.3: the run's state message is one line naming the task and why; the log holds the traceback once;
    the run-failure artifact has the long report with links a browser opens. Returns the artifact's markdown."""
    message = run["state"]["message"]
    assert message.startswith(f"{task} failed: "), message
    assert all(r in message for r in reason), message
    assert message.endswith("; see the run-failure artifact"), message
    assert "\n" not in message and "Traceback" not in message and "Error(" not in message, message
    # The flow's last log line comes after every traceback: wait for it, then count.
    logs = stack.api.wait_for_log(flow_run_id, "Finished in state Failed")
    assert logs.count("Traceback (most recent call last)") == 1, logs
    (artifact,) = [a for a in stack.api.artifacts(flow_run_id) if a["key"] == "run-failure"]
    report = str(artifact["data"])
    assert report.startswith(f"# {task} failed: "), report
    ui = f"{stack.server.url}/v2"
    assert f"]({ui}/runs/flow-run/{flow_run_id})" in report, report
    failed_tasks = [t for t in stack.api.task_runs(flow_run_id) if t["state_type"] == "FAILED"]
    assert [t["id"] for t in failed_tasks] == [
        t["id"] for t in failed_tasks if f"{ui}/runs/task-run/{t['id']}" in report
    ]
    others = [a for a in stack.api.artifacts(flow_run_id) if a["key"] and a["key"] != "run-failure"]
    assert others, "the run made no other artifact to link"
    for other in others:
        assert f"[{other['key']}]({ui}/artifacts/artifact/{other['id']})" in report, (other["key"], report)
    return report


def test_quality_gate_failure_is_one_line_naming_the_task_with_the_report_in_an_artifact(stack: Stack) -> None:
    # The stand-in answers in ~24 tokens: a gate that wants a median of 1000 fails, after generation.
    gate = {"max_reject_rate": 1.0, "max_short_share": 1.0, "min_median_completion_tokens": 1000}
    flow_run_id = _start(stack, "manual", {"spec": fast_spec(stack, "prefect-e2e-gate", quality_gate=gate)})
    run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "FAILED", _failure_report(stack, flow_run_id, run)
    report = _assert_one_line_reason(
        stack, flow_run_id, run, "quality gate", "1 of 4 checks failed: median_completion_tokens: median completion is "
    )
    # The reject files are pointed at by the validation-report artifact, never by worker-local paths.
    message = run["state"]["message"]
    assert "validation-report" in report and str(stack.root) not in report + message, report
    assert not stack.store.exists("prefect-e2e-gate/")


def test_environment_check_deployment_fails_naming_the_check(stack: Stack) -> None:
    # A model directory that is no model: the check-environment deployment's one task fails, saying which check.
    empty_model = stack.root / "not-a-model"
    empty_model.mkdir(exist_ok=True)
    spec = fast_spec(stack, "envcheck-bad-model", model_path=str(empty_model))
    flow_run_id = _start(stack, "environment-check", {"spec": spec}, flow="check-environment")
    run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "FAILED", _failure_report(stack, flow_run_id, run)
    _assert_one_line_reason(stack, flow_run_id, run, "check environment", "environment checks failed: model_dir.")


def test_server_that_dies_at_startup_fails_the_run_with_its_log_lines(stack: Stack) -> None:
    # The box claims Hopper (fa3 allowed) but the GPU is really SM120: the environment check passes and the
    # server itself dies at startup with SGLang's assertion; its last log lines must reach the API.
    # That belief is the box's own settings (a run cannot change them): a second box, with its own worker and queue.
    spec = fast_spec(stack, "prefect-e2e-broken", server_args=["--attention-backend", "fa3"])
    box_env = {
        **stack.box_env,
        "DATAGEN_WORK_QUEUE": "hopper-claims",
        "DATAGEN_WORKER_NAME": "hopper-claims",
        "DATAGEN_ALLOWED_COMPUTE_CAPABILITIES": '["9.0"]',
        "DATAGEN_STANDIN_GPU_ARCH": "12.0",
    }
    worker_log = stack.root / "hopper-claims-worker.log"
    with prefect_worker(stack.server, stack.root / "hopper-claims-home", worker_log, box_env):
        flow_run_id = _start(stack, "manual", {"spec": spec}, work_queue="hopper-claims")
        run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=worker_log)
        # Logs ship in batches after the state: stopping the worker now would stop its run's process before.
        logs = stack.api.wait_for_log(flow_run_id, "Finished in state Failed")
    assert run["state_type"] == "FAILED", _failure_report(stack, flow_run_id, run)
    # SGLang's (and the stand-in's) own words, from the server log's tail, in the run's state and logs.
    server_line = "backends are supported on Blackwell GPUs for hybrid GDN models. Got fa3"
    message = run["state"]["message"]
    assert message.startswith("start servers failed: server ") and server_line in message, message
    assert server_line in logs, logs
    # The environment check passed (it believed the box was Hopper); the failure is the server's.
    task_states = {t["name"].rsplit("-", 1)[0]: t["state_type"] for t in stack.api.task_runs(flow_run_id)}
    assert task_states.get("check environment") == "COMPLETED", task_states


def test_run_with_nothing_new_completes_saying_so_in_state_and_report(stack: Stack) -> None:
    first = _start(stack, "manual", {"spec": fast_spec(stack, "prefect-e2e-first")})
    run = stack.api.wait_for_flow_run(first, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "COMPLETED", _failure_report(stack, first, run)

    # The same prompts again with skip_published (the scheduled expansion's setting): all were published.
    namespace = "prefect-e2e-nothing-new"
    flow_run_id = _start(stack, "manual", {"spec": fast_spec(stack, namespace, skip_published=True)})
    run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "COMPLETED", _failure_report(stack, flow_run_id, run)
    message = run["state"]["message"]
    assert f"Nothing new to generate for {namespace}" in message and "already published" in message, message
    (report,) = [a for a in stack.api.artifacts(flow_run_id) if a["key"] == "run-report"]
    assert "nothing to do" in report["data"] and "prefect-e2e-first" in report["data"], report["data"]
    assert not [t for t in stack.api.task_runs(flow_run_id) if t["name"].startswith("start servers")]
    assert not stack.store.exists(f"{namespace}/")


def test_rerun_whose_shards_are_all_generated_starts_no_server(stack: Stack) -> None:
    namespace = "prefect-e2e-cached"
    spec = fast_spec(stack, namespace)
    first = _start(stack, "manual", {"spec": spec, "dry_run": True})
    run = stack.api.wait_for_flow_run(first, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "COMPLETED", _failure_report(stack, first, run)
    assert run["name"].startswith(f"expand {namespace} (dry run) · "), run["name"]
    assert [t for t in stack.api.task_runs(first) if t["name"].startswith("start servers")]

    again = _start(stack, "manual", {"spec": spec, "dry_run": True})
    run = stack.api.wait_for_flow_run(again, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
    assert run["state_type"] == "COMPLETED", _failure_report(stack, again, run)
    tasks = {t["name"]: t["state_name"] for t in stack.api.task_runs(again)}
    assert not [n for n in tasks if n.startswith("start servers")], tasks
    assert tasks.get("generate shard-00000") == "Cached", tasks
    logs = stack.api.wait_for_log(again, "no servers started")
    assert "all 2 shards are already generated" in logs, logs
    assert "0 done" not in logs, logs


def test_laptop_run_spec_is_every_deployments_default_so_quick_run_works(stack: Stack) -> None:
    # Issue 25.1: the deployments kept production defaults (/dev/shm model, 262144 context): a Quick run of
    # scheduled-expansion failed on the laptop it was deployed from. Last in the module: it redeploys.
    run_spec = stack.root / "laptop-run-spec.json"
    # As `datagen laptop` writes it: namespace auto, so every Quick run takes the next free expansion_vN.
    fields = fast_spec(stack, "auto", skip_published=False)
    run_spec.write_text(json.dumps({"spec": fields}), encoding="utf-8")
    output = run_deploy(stack.server, stack.root / "cli-home", {"DATAGEN_DEPLOY_RUN_SPEC": str(run_spec)})
    assert "is now the run spec default of" in output, output
    quick_runs = [
        ("expand-dataset", "manual"),
        ("expand-dataset", "scheduled-expansion"),
        ("check-environment", "environment-check"),
        ("pilot", "pilot"),
    ]
    for flow, name in quick_runs:
        spec = stack.api.deployment(flow, name)["parameters"]["spec"]
        assert spec["model_path"] == str(stack.model_dir) and spec["context_length"] == 4096, (name, spec)
        assert spec["namespace"] == "auto", spec
        # prefect.yaml's own values for a deployment win over the file's.
        assert spec["skip_published"] is (name == "scheduled-expansion"), (name, spec)
    # A Quick run sends no parameters: the deployment's defaults are the run's.
    for flow, name in quick_runs:
        flow_run_id = _start(stack, name, {}, flow=flow)
        run = stack.api.wait_for_flow_run(flow_run_id, RUN_TIMEOUT_S, diagnostics=stack.worker_log)
        assert run["state_type"] == "COMPLETED", f"{flow}/{name}: " + _failure_report(stack, flow_run_id, run)
