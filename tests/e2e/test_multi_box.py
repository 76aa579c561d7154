"""Two GPU "boxes" (two process workers with their own stand-in servers) share one run; one box dies mid-run.

One test, run in both turn modes (`turns`): the same job, with each mode's data and expectations.
Real processes throughout: one Prefect server and `infra/deploy.sh` for the module (both runs; each has its own
namespace, S3 prefix and work dirs), a control worker for the parent flow, one worker per box serving its own
work queue, the session's local S3 server. Box b starts first and is SIGKILLed (worker, flow-run subprocess and
stand-ins: no clean-up) while it holds a shard it uploaded lines of and has not finished; box a takes its shards
over when the 5 s leases lapse, resuming from the parts box b uploaded.

- `last`: 48 one-turn questions. Box a joins before the kill (both boxes claim shards, each emulates its own card:
  each box's memory plan reaches the lineage and the card).
- `every`: the first rows of the bundled OpenAI and ShareGPT tool-calling sets, regenerated turn by turn. Box b is
  killed while its parts hold a conversation that has neither ended nor been rejected; box a joins afterwards and
  resumes that conversation after the last step line box b uploaded. Every step of every conversation is in the
  parts exactly once, every conversation is settled, and the rows are published.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator, Mapping
from contextlib import ExitStack, contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq
import pytest

from datagen.conversation.turn_mode import EveryTurn, LastTurn, TurnMode, turn_mode
from datagen.engine.memory_plan import GpuMemory, ModelShape, plan_memory
from datagen.identity import PromptIdentity
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing import catalog
from datagen.publishing.storage import ObjectStore
from datagen.records import Message, Prompt
from datagen.runspec import PromptSource, RunSpec
from datagen.sources.prompts import iter_prompts
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


@dataclass(frozen=True)
class Case:
    """One turn mode's run: its prompts, shape and pace, and when box a joins."""

    namespace: str
    shard_size: int
    context_length: int
    max_new_tokens: int
    length_mean: int
    length_max: int
    tokens_per_step: int
    a_joins_before_kill: bool  # else after it: b's interrupted conversations are all a's to resume
    emulate_cards: bool  # each box's stand-in emulates its own card (BOX_GPU_BYTES): each box plans its memory


CASES = {
    "last": Case("multibox_v1", 4, 4096, 64, 16, 24, 4, a_joins_before_kill=True, emulate_cards=True),
    "every": Case("multibox_every_v1", 3, 8192, 256, 24, 48, 8, a_joins_before_kill=False, emulate_cards=False),
}
BUNDLED = [REPO_ROOT / "data/prompts" / name for name in ("tool_calls_openai.jsonl", "tool_calls_sharegpt.jsonl")]
# The first rows of each set hold every shape the takeover must carry (a lone user turn, a system prompt, tool calls
# with one and two results, a second user turn): 4 shards instead of 9 after the kill. The sets whole are
# regenerated turn by turn in test_generation.py and test_flow_e2e.py.
ROWS_PER_SOURCE = 6


def _sources(turns: Literal["last", "every"], root: Path) -> list[str]:
    """The run's prompt files: one-turn questions (`last`), the first rows of the bundled sets (`every`)."""
    if turns == "last":
        return [str(write_prompts(root / "prompts.jsonl", [_question(i) for i in range(N_PROMPTS)]))]
    sources = []
    for bundled in BUNDLED:  # same file names: the same source labels as the bundled sets
        rows = bundled.read_text(encoding="utf-8").splitlines(keepends=True)[:ROWS_PER_SOURCE]
        (root / bundled.name).write_text("".join(rows), encoding="utf-8")
        sources.append(str(root / bundled.name))
    return sources


def _question(i: int) -> str:
    return f"Question {i}: explain idea {i} briefly."


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    """One Prefect server with the deployments registered by `infra/deploy.sh`, for both modes' runs."""
    root = tmp_path_factory.mktemp("multibox-prefect")
    with prefect_server(root / "prefect") as server:
        run_deploy(server, root / "cli-home", {"DATAGEN_HOME": "/nonexistent/deploy-machine-path"})
        yield server


@pytest.mark.parametrize("turns", ["last", "every"])
def test_two_boxes_share_a_run_and_a_killed_box_loses_nothing(
    turns: Literal["last", "every"],
    deployed: PrefectServer,
    tmp_path_factory: pytest.TempPathFactory,
    local_s3: LocalS3,
) -> None:
    case = CASES[turns]
    root = tmp_path_factory.mktemp(f"multibox-{turns}")
    sources = _sources(turns, root)
    prompts = [p for p in iter_prompts([PromptSource(path=s) for s in sources]) if isinstance(p, Prompt)]
    assert len(prompts) == (N_PROMPTS if turns == "last" else 2 * ROWS_PER_SOURCE)
    n_shards = -(-len(prompts) // case.shard_size)
    model_dir = ensure_model_dir()
    s3_prefix = f"{root.name}/"
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=s3_prefix))
    mode = {"last": LastTurn(), "every": EveryTurn()}[turns]
    sx = ShardExchange(store, case.namespace, "test", "observer", mode=mode, enable_thinking=True)
    work = {box: root / f"work-{box}" for box in ("control", "box-a", "box-b")}
    spec: dict[str, Any] = {
        "sources": [{"path": s} for s in sources],
        "model_path": str(model_dir),
        "namespace": case.namespace,
        "turns": turns,
        "shard_size": case.shard_size,
        "context_length": case.context_length,
        "sampling": {"max_new_tokens": case.max_new_tokens},
        "server_args": ["--max-running-requests", "2"],  # the pace above: the spec's flag wins over the plan
        "validation": {"min_answer_tokens": 0, "reject_truncated": False},
        "quality_gate": {"max_reject_rate": 1.0, "max_short_share": 1.0, "min_median_completion_tokens": 0},
    }
    mode = turn_mode(RunSpec.model_validate(spec))

    def box_env(box: str) -> dict[str, str]:
        env = worker_env(local_s3, s3_prefix, work[box], length_mean=case.length_mean, length_max=case.length_max)
        env.update(STANDIN_PACE | {"DATAGEN_STANDIN_TOKENS_PER_STEP": str(case.tokens_per_step)})
        env.update({"DATAGEN_BASE_PORT": "0", "DATAGEN_NUM_SERVERS": "1"})
        if box != "control":
            env["DATAGEN_BOX_NAME"] = box
            if case.emulate_cards:  # each box's stand-in emulates its own card: each box's memory plan differs
                env["DATAGEN_STANDIN_GPU_MEMORY_BYTES"] = str(BOX_GPU_BYTES[box])
        return env

    def claim_boxes() -> set[str]:
        return {c.box for s in range(n_shards) for c in sx.claims(s)}

    def b_interrupted() -> dict[int, set[str]]:
        """Shards box b holds (its claim the latest, not done) with lines it uploaded, each with its conversations
        those lines leave open (`every`: neither ended nor rejected; `last`: a line is a whole conversation)."""
        done, out = sx.done_ids(), {}
        for shard in range(n_shards):
            latest = sx.latest_claim(shard)
            if shard in done or latest is None or latest.box != "box-b":
                continue
            rows = sx.read_rows(shard)
            open_ = set(rows.conversations) - rows.settled
            if open_ if mode.continues else rows.rows_by_box.get("box-b", 0) > 0:
                out[shard] = open_
        return out

    with ExitStack() as stack:
        stack.callback(lambda: [_kill_marked(f"DATAGEN_WORK_DIR={p}") for p in work.values()])
        server = deployed
        api = server.api()
        stack.callback(api.close)
        stack.enter_context(_queue_worker(server, root, "control", box_env("control")))
        worker_b = stack.enter_context(_queue_worker(server, root, "box-b", box_env("box-b")))

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

        _wait("box b's lines in a shard it holds, a conversation open", lambda: bool(b_interrupted()))
        if case.a_joins_before_kill:
            stack.enter_context(_queue_worker(server, root, "box-a", box_env("box-a")))
            _wait("box a's first claim", lambda: "box-a" in claim_boxes())
            _wait("box b mid-shard (lines uploaded, lease held, shard not done)", lambda: bool(b_interrupted()))

        # Box b dies: worker, flow-run subprocess and stand-in server, all SIGKILLed, nothing cleans up.
        with suppress(ProcessLookupError):
            os.killpg(worker_b.pid, signal.SIGKILL)
        killed = _kill_marked(f"DATAGEN_WORK_DIR={work['box-b']}")
        assert killed, "box b's flow run and stand-in should have been running"
        interrupted = b_interrupted()  # what box b left open, now that it can upload no more
        assert interrupted
        orphaned = {s for s in range(n_shards) if s not in sx.done_ids() and sx.latest_claim(s) is not None}
        if not case.a_joins_before_kill:
            stack.enter_context(_queue_worker(server, root, "box-a", box_env("box-a")))

        run = api.wait_for_flow_run(parent_id, WAIT_S, diagnostics=root / "box-a-worker.log")
        assert run["state_type"] == "COMPLETED", f"{run['state']}\n{api.log_text(parent_id)}"

        # The children: box a finished, box b's run was marked Crashed by the parent (it never reports again).
        response = api.client.post(
            "/flow_runs/filter", json={"flow_runs": {"parent_flow_run_id": {"any_": [parent_id]}}}
        )
        response.raise_for_status()
        child_states = {c["name"].removeprefix(f"{case.namespace}-"): c["state_type"] for c in response.json()}
        assert child_states == {"box-a": "COMPLETED", "box-b": "CRASHED"}

    # The lineage names the parent run as a one-box run's names its run (a refusal of another run spec names it),
    # and the plan's skip counts (before: both left out of a multi-box manifest), in both modes (one builder).
    manifest = json.loads(store.get_bytes(f"{case.namespace}/manifest.json"))
    lineage = manifest["lineage"]
    assert (lineage["run_id"], lineage["run_name"]) == (parent_id, run["name"]), lineage
    assert lineage["skipped_published"] == 0 and lineage["old_rejects_skipped"] == 0
    # Box b's unfinished shards were finished by box a after a later claim.
    for shard in interrupted:
        assert sx.done_marker(shard)["box"] == "box-a"
        assert [c.box for c in sx.claims(shard)][-1] == "box-a"

    if not mode.continues:
        _check_last(store, sx, RunSpec.model_validate(spec), manifest, orphaned, model_dir)
    else:
        _check_every(store, sx, mode, manifest, prompts, interrupted, n_shards)


def _check_last(
    store: ObjectStore, sx: ShardExchange, spec: RunSpec, manifest: dict[str, Any], orphaned: set[int], model_dir: Path
) -> None:
    """`last`: every prompt exactly once in the published rows, each box's memory plan, the work spread."""
    namespace = spec.namespace
    # Every prompt exactly once in the published dataset (accepted or as a reject row with its reason).
    keys = [o.key for o in store.list(f"{namespace}/")]
    assert f"{namespace}/manifest.json" in keys
    data = [pq.read_table(io.BytesIO(store.get_bytes(k))) for k in keys if k.startswith(f"{namespace}/data/")]
    rejects = [pq.read_table(io.BytesIO(store.get_bytes(k))) for k in keys if k.startswith(f"{namespace}/rejects/")]
    shipped = [pid for t in data for pid in t.column("prompt_id").to_pylist()]
    rejected = [pid for t in rejects for pid in t.column("prompt_id").to_pylist()]
    identity = PromptIdentity.for_spec(spec)  # ids follow the rendered tokens
    expected = {identity.prompt_id("prompts", [Message(role="user", content=_question(i))]) for i in range(N_PROMPTS)}
    assert len(shipped) == len(set(shipped))
    assert not set(shipped) & set(rejected)
    assert set(shipped) | set(rejected) == expected
    assert len(shipped) + len(rejected) == N_PROMPTS
    # The parent wrote the namespace's catalog part: a later expansion skips every one of these prompts.
    assert catalog.published_prompt_ids(store) == expected

    # Each box's own memory plan reached the lineage and the card (before: "memory plan flags: none").
    by_box = manifest["lineage"]["memory_plan"]["by_box"]
    finished_by = {str(sx.done_marker(s)["box"]) for s in range(N_PROMPTS // 4)}
    assert set(by_box) == finished_by and "box-a" in finished_by
    shape = ModelShape.from_model_dir(model_dir)
    card = store.get_bytes(f"{namespace}/README.md").decode()
    for box, plan in by_box.items():
        gpu = GpuMemory(BOX_GPU_BYTES[box], BOX_GPU_BYTES[box], Knobs().weights_bytes)
        plan_args = plan_memory(shape, gpu, 64, context_source="test", server_args=spec.server_args).plan_args
        assert plan["plan_args"] == plan_args and "--disable-radix-cache" in plan_args
        assert f"{box}: {' '.join(plan_args)}" in card
    assert len({" ".join(p["plan_args"]) for p in by_box.values()}) == len(by_box)  # two cards, two plans

    # The work was spread: both boxes claimed shards and rows of both are among the collected rows.
    assert {c.box for s in range(N_PROMPTS // 4) for c in sx.claims(s)} == {"box-a", "box-b"}
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


def _check_every(
    store: ObjectStore,
    sx: ShardExchange,
    mode: TurnMode,
    manifest: dict[str, Any],
    prompts: list[Prompt],
    interrupted: dict[int, set[str]],
    n_shards: int,
) -> None:
    """`every`: every step once in the parts, every conversation settled, b's open ones resumed by a; published."""

    def parts(shard: int) -> list[tuple[str, str]]:
        """(box, line) of every row of the shard's completion parts."""
        out = []
        for o in store.list(sx.parts_prefix(shard, "completions")):
            out += [(_box_of_part(o.key), line) for line in store.get_bytes(o.key).decode().splitlines() if line]
        return out

    # Every step of every conversation is in the parts exactly once; every conversation is settled.
    settled: set[str] = set()
    n_steps = 0
    for shard in range(n_shards):
        lines = parts(shard)
        keys = Counter(json.loads(line)["request_key"] for _, line in lines)
        assert all(n == 1 for n in keys.values()), f"shard {shard}: a step uploaded twice: {keys.most_common(2)}"
        rows = sx.read_rows(shard)
        assert rows.settled == set(rows.conversations) and not rows.conflicts and rows.duplicates == 0
        settled |= set(rows.conversations.values())
        steps: dict[str, list[tuple[int, str]]] = {}  # conversation key -> (step, box) of its kept lines
        box_of = {line: box for box, line in lines}
        for key, line in rows.completions.items():
            split = mode.split_key(key)
            assert split is not None
            steps.setdefault(split[0], []).append((split[1], box_of[line]))
        n_steps += len(rows.completions)
        for conv, kept in steps.items():
            assert [n for n, _ in kept] == list(range(len(kept))), f"{rows.conversations[conv]}: steps {kept}"
        # Box b's open conversations were resumed by box a after b's last line: b's steps, then a's.
        for conv in interrupted.get(shard, set()):
            by = [box for _, box in steps[conv]]
            assert by == ["box-b"] * by.count("box-b") + ["box-a"] * by.count("box-a") and "box-a" in by, by
            assert sx.done_marker(shard)["box"] == "box-a"
    assert len(settled) == len(prompts)
    assert n_steps > len(prompts)  # multi-step conversations: tool results were spliced, user turns continued

    # Published: one conversations/ line per conversation with kept steps, a row per kept user turn, counts in lineage.
    namespace = sx.namespace
    keys = [o.key for o in store.list(f"{namespace}/")]
    data = [pq.read_table(io.BytesIO(store.get_bytes(k))) for k in keys if k.startswith(f"{namespace}/data/")]
    rows_published = [
        (cid, turn)
        for table in data
        for cid, turn in zip(
            table.column("conversation_id").to_pylist(), table.column("turn_index").to_pylist(), strict=True
        )
    ]
    assert rows_published and len(rows_published) == len(set(rows_published))
    published_lines = [
        json.loads(line)
        for k in keys
        if k.startswith(f"{namespace}/conversations/")
        for line in store.get_bytes(k).decode().splitlines()
    ]
    assert len({r["id"] for r in published_lines}) == len(published_lines)
    assert {cid for cid, _ in rows_published} == {r["id"] for r in published_lines}
    counts = manifest["lineage"]["conversations"]
    assert counts["published"] == len(published_lines) and counts["published_user_turns"] == len(rows_published)
    assert counts["generated_twice"] == 0
    assert manifest["lineage"]["rows"] == len(rows_published)
