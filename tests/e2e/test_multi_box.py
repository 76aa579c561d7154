"""Two GPU "boxes" (two process workers with their own stand-in servers) share one run; one box dies mid-run.

Real processes throughout: one Prefect server, `infra/deploy.sh`, a control worker for the parent flow,
one worker per box serving its own work queue, the session's local S3 server. Box b starts first so it
surely holds work when it is killed (worker, flow-run subprocess and stand-ins, SIGKILL: no clean-up);
box a takes over its shards after the 5 s leases lapse, resuming from the parts box b uploaded.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.engine.memory_plan import GpuMemory, ModelShape, plan_memory
from datagen.identity import PromptIdentity
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing import catalog
from datagen.publishing.storage import ObjectStore
from datagen.records import Message
from datagen.runspec import RunSpec
from datagen.standin.knobs import Knobs
from tasks.shard_exchange import ShardExchange
from tests.prefect_fixtures import (
    POOL,
    REPO_ROOT,
    PrefectServer,
    prefect_server,
    run_deploy,
    stop_process,
    worker_env,
    write_prompts,
)

pytestmark = pytest.mark.slow

NAMESPACE = "multibox_v1"
N_PROMPTS = 48
WAIT_S = 420.0  # hang guard only
# Slow, short stand-in outputs: ~1.6 s per request, 2 at a time per box, so shards last a few seconds.
# One RTX PRO 6000 (96 GB) on box a, one 80 GB card on box b.
BOX_GPU_BYTES = {"box-a": 97_887 * 2**20, "box-b": 81_559 * 2**20}
STANDIN_PACE = {
    "DATAGEN_STANDIN_MAX_RUNNING": "2",
    "DATAGEN_STANDIN_STEP_BASE_MS": "400",
    "DATAGEN_STANDIN_TOKENS_PER_STEP": "4",
}


def _pids_with_env(marker: str) -> list[int]:
    """Processes whose environment holds `marker` (a path unique to this test: only processes it started).

    Servers inherit only an allow-listed environment: they are found by their key file under the work dir.
    """
    needle = marker.encode() + b"\0"
    key_dir = marker.split("=", 1)[1].encode() + b"/fleets/"
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with suppress(OSError):
            if needle in (entry / "environ").read_bytes() or key_dir in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def _kill_marked(marker: str) -> list[int]:
    pids = _pids_with_env(marker)
    for pid in pids:
        with suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pids


@contextmanager
def _queue_worker(
    server: PrefectServer, root: Path, queue: str, env: Mapping[str, str]
) -> Iterator[subprocess.Popen[bytes]]:
    """`python -m datagen.worker` serving one work queue of the pool (a box's worker, or the control worker)."""
    home = root / f"{queue}-home"
    full_env = server.client_env(home, {"DATAGEN_HOME": str(REPO_ROOT), "PREFECT_WORKER_QUERY_SECONDS": "1", **env})
    with (root / f"{queue}-worker.log").open("wb") as log:
        proc = subprocess.Popen(
            [
                *(sys.executable, "-m", "datagen.worker", "--pool", POOL),
                *("--work-queue", queue, "--name", queue, "--limit", "1"),
            ],
            env=full_env,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO_ROOT,
            start_new_session=True,
        )
    try:
        yield proc
    finally:
        stop_process(proc, signal.SIGINT, timeout=30)


def _wait(what: str, condition: Callable[[], bool], timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise TimeoutError(f"gave up waiting for {what}")
        time.sleep(0.3)


def _box_of_part(key: str) -> str:
    return key.rsplit("/", 1)[-1].removeprefix("part-").rsplit("-", 2)[0]


def test_two_boxes_share_a_run_and_a_killed_box_loses_nothing(
    tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3
) -> None:
    root = tmp_path_factory.mktemp("multibox")
    prompts = write_prompts(
        root / "prompts.jsonl", [f"Question {i}: explain idea {i} briefly." for i in range(N_PROMPTS)]
    )
    model_dir = ensure_model_dir()
    s3_prefix = f"{root.name}/"
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=s3_prefix))
    sx = ShardExchange(store, NAMESPACE, "test", "observer")
    work = {box: root / f"work-{box}" for box in ("control", "box-a", "box-b")}

    def box_env(box: str) -> dict[str, str]:
        env = worker_env(local_s3, s3_prefix, work[box], length_mean=16, length_max=24)
        env.update(STANDIN_PACE)
        env.update({"DATAGEN_BASE_PORT": "0", "DATAGEN_NUM_SERVERS": "1"})
        if box != "control":
            env["DATAGEN_BOX_NAME"] = box
            # Each box's stand-in emulates its own card, so each box's memory plan differs (its own probe).
            env["DATAGEN_STANDIN_GPU_MEMORY_BYTES"] = str(BOX_GPU_BYTES[box])
        return env

    def parts_by(box: str) -> list[str]:
        return [o.key for o in store.list(f"{sx.root}/checkpoints/") if _box_of_part(o.key) == box]

    def claim_boxes() -> set[str]:
        return {c.box for s in range(N_PROMPTS // 4) for c in sx.claims(s)}

    def b_holds_unfinished_work() -> bool:
        done = sx.done_ids()
        for key in parts_by("box-b"):
            shard = int(key.split("/shard-")[1][:5])
            latest = sx.latest_claim(shard)
            if shard not in done and latest is not None and latest.box == "box-b":
                return True
        return False

    with ExitStack() as stack:
        stack.callback(lambda: [_kill_marked(f"DATAGEN_WORK_DIR={p}") for p in work.values()])
        server = stack.enter_context(prefect_server(root / "prefect"))
        run_deploy(server, root / "cli-home", {"DATAGEN_HOME": "/nonexistent/deploy-machine-path"})
        api = server.api()
        stack.callback(api.close)
        stack.enter_context(_queue_worker(server, root, "control", box_env("control")))
        worker_b = stack.enter_context(_queue_worker(server, root, "box-b", box_env("box-b")))

        spec: dict[str, Any] = {
            "sources": [{"path": str(prompts)}],
            "model_path": str(model_dir),
            "namespace": NAMESPACE,
            "turns": "last",
            "shard_size": 4,
            "context_length": 4096,
            "sampling": {"max_new_tokens": 64},
            "server_args": ["--max-running-requests", "2"],  # the pace above: the spec's flag wins over the plan
            "validation": {"min_answer_tokens": 0, "reject_truncated": False},
            "quality_gate": {"max_reject_rate": 1.0, "max_short_share": 1.0, "min_median_completion_tokens": 0},
        }
        boxes = {
            "boxes": ["box-a", "box-b"],
            "exchange": {"lease_s": 5, "sync_interval_s": 1, "shards_in_flight": 2},
            "poll_s": 1,
            "child_exit_grace_s": 15,
        }
        deployment = api.deployment("expand-dataset-multibox", "multibox")
        response = api.create_flow_run(deployment["id"], {"spec": spec, "boxes": boxes})
        assert response.status_code == 201, response.text
        parent_id = str(response.json()["id"])

        _wait("box b's first checkpoint part", lambda: bool(parts_by("box-b")))
        stack.enter_context(_queue_worker(server, root, "box-a", box_env("box-a")))
        _wait("box a's first claim", lambda: "box-a" in claim_boxes())
        _wait("box b mid-shard (parts uploaded, lease held, shard not done)", b_holds_unfinished_work)

        # Box b dies: worker, flow-run subprocess and stand-in server, all SIGKILLed, nothing cleans up.
        with suppress(ProcessLookupError):
            os.killpg(worker_b.pid, signal.SIGKILL)
        killed = _kill_marked(f"DATAGEN_WORK_DIR={work['box-b']}")
        assert killed, "box b's flow run and stand-in should have been running"
        orphaned = {s for s in range(N_PROMPTS // 4) if s not in sx.done_ids() and sx.latest_claim(s) is not None}

        run = api.wait_for_flow_run(parent_id, WAIT_S, diagnostics=root / "box-a-worker.log")
        assert run["state_type"] == "COMPLETED", f"{run['state']}\n{api.log_text(parent_id)}"

        # The children: box a finished, box b's run was marked Crashed by the parent (it never reports again).
        response = api.client.post("/flow_runs/filter", json={"flow_runs": {"parent_task_run_id": {"is_null_": False}}})
        response.raise_for_status()
        children = response.json()
        child_states = {c["name"].removeprefix(f"{NAMESPACE}-"): c["state_type"] for c in children}
        assert child_states == {"box-a": "COMPLETED", "box-b": "CRASHED"}

    # Every prompt exactly once in the published dataset (accepted or as a reject row with its reason).
    keys = [o.key for o in store.list(f"{NAMESPACE}/")]
    assert f"{NAMESPACE}/manifest.json" in keys
    data = [pq.read_table(io.BytesIO(store.get_bytes(k))) for k in keys if k.startswith(f"{NAMESPACE}/data/")]
    rejects = [pq.read_table(io.BytesIO(store.get_bytes(k))) for k in keys if k.startswith(f"{NAMESPACE}/rejects/")]
    shipped = [pid for t in data for pid in t.column("prompt_id").to_pylist()]
    rejected = [pid for t in rejects for pid in t.column("prompt_id").to_pylist()]
    identity = PromptIdentity.for_spec(RunSpec.model_validate(spec))  # ids follow the rendered tokens
    expected = {
        identity.prompt_id("prompts", [Message(role="user", content=f"Question {i}: explain idea {i} briefly.")])
        for i in range(N_PROMPTS)
    }
    assert len(shipped) == len(set(shipped))
    assert not set(shipped) & set(rejected)
    assert set(shipped) | set(rejected) == expected
    assert len(shipped) + len(rejected) == N_PROMPTS
    # The parent wrote the namespace's catalog part: a later expansion skips every one of these prompts.
    assert catalog.published_prompt_ids(store) == expected

    # Each box's own memory plan reached the lineage and the card (before: "memory plan flags: none").
    manifest = json.loads(store.get_bytes(f"{NAMESPACE}/manifest.json"))
    by_box = manifest["lineage"]["memory_plan"]["by_box"]
    # The lineage names the parent run as a one-box run's names its run (a refusal of another run spec names it),
    # and the plan's skip counts (before: both left out of a multi-box manifest).
    lineage = manifest["lineage"]
    assert (lineage["run_id"], lineage["run_name"]) == (parent_id, run["name"]), lineage
    assert lineage["skipped_published"] == 0 and lineage["old_rejects_skipped"] == 0
    finished_by = {str(sx.done_marker(s)["box"]) for s in range(N_PROMPTS // 4)}
    assert set(by_box) == finished_by and "box-a" in finished_by
    shape = ModelShape.from_model_dir(model_dir)
    card = store.get_bytes(f"{NAMESPACE}/README.md").decode()
    for box, plan in by_box.items():
        gpu = GpuMemory(BOX_GPU_BYTES[box], BOX_GPU_BYTES[box], Knobs().weights_bytes)
        expected = plan_memory(shape, gpu, 64, context_source="test", server_args=spec["server_args"]).plan_args
        assert plan["plan_args"] == expected and "--disable-radix-cache" in expected
        assert f"{box}: {' '.join(expected)}" in card
    assert len({" ".join(p["plan_args"]) for p in by_box.values()}) == len(by_box)  # two cards, two plans

    # The work was spread: both boxes claimed shards and rows of both are among the collected rows.
    assert claim_boxes() == {"box-a", "box-b"}
    rows_by_box: dict[str, int] = {}
    for shard in range(N_PROMPTS // 4):
        for box, n in sx.read_rows(shard).rows_by_box.items():
            rows_by_box[box] = rows_by_box.get(box, 0) + n
    assert rows_by_box.get("box-a", 0) > 0 and rows_by_box.get("box-b", 0) > 0
    assert sum(rows_by_box.values()) == N_PROMPTS
    # Box b's unfinished shards were taken over by box a (a later claim number) and finished by it.
    assert orphaned
    for shard in orphaned:
        claims = sx.claims(shard)
        if claims[-1].box == "box-a" and any(c.box == "box-b" for c in claims):
            assert json.loads(store.get_bytes(sx.done_key(shard)))["box"] == "box-a"
    assert any(any(c.box == "box-b" for c in sx.claims(s)) and sx.done_marker(s)["box"] == "box-a" for s in orphaned)
