"""Two boxes share a `turns: every` run of multi-turn tool-calling conversations; one box dies mid-conversation.

Real processes as in test_multi_box.py (Prefect server, `infra/deploy.sh`, a control worker, one worker per box
with its own stand-in, the session's local S3 server). The run regenerates the first rows of the bundled OpenAI
and ShareGPT tool-calling sets turn by turn. Box b starts first and is SIGKILLed while its uploaded parts hold a
conversation that has neither ended nor been rejected; box a takes the shard over when the lease lapses and
resumes that conversation after the last step line box b uploaded. Every step of every conversation is in the
parts exactly once, every conversation is settled, and the rows are published.
"""

from __future__ import annotations

import io
import json
import os
import signal
from collections import Counter
from contextlib import ExitStack, suppress
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.conversation.regeneration import split_step_key
from datagen.conversation.turn_mode import EveryTurn
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.records import Prompt
from datagen.runspec import PromptSource
from datagen.sources.prompts import iter_prompts
from tasks.shard_exchange import ShardExchange
from tests.e2e.test_multi_box import STANDIN_PACE, WAIT_S, _box_of_part, _kill_marked, _queue_worker, _wait
from tests.prefect_fixtures import REPO_ROOT, prefect_server, run_deploy, worker_env

pytestmark = pytest.mark.slow

NAMESPACE = "multibox_every_v1"
BUNDLED = [REPO_ROOT / "data/prompts" / name for name in ("tool_calls_openai.jsonl", "tool_calls_sharegpt.jsonl")]
# The first rows of each set hold every shape the takeover must carry (a lone user turn, a system prompt, tool calls
# with one and two results, a second user turn): 4 shards instead of 9 after the kill. The sets whole are
# regenerated turn by turn in test_generation_every.py and test_flow_turns_e2e.py.
ROWS_PER_SOURCE = 6
SHARD_SIZE = 3


def test_two_boxes_regenerate_every_turn_and_a_killed_box_loses_no_step(
    tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3
) -> None:
    root = tmp_path_factory.mktemp("multibox-every")
    sources = []
    for bundled in BUNDLED:  # same file names: the same source labels as the bundled sets
        rows = bundled.read_text(encoding="utf-8").splitlines(keepends=True)[:ROWS_PER_SOURCE]
        (root / bundled.name).write_text("".join(rows), encoding="utf-8")
        sources.append(str(root / bundled.name))
    prompts = [p for p in iter_prompts([PromptSource(path=s) for s in sources]) if isinstance(p, Prompt)]
    assert len(prompts) == 2 * ROWS_PER_SOURCE
    n_shards = -(-len(prompts) // SHARD_SIZE)
    s3_prefix = f"{root.name}/"
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=s3_prefix))
    sx = ShardExchange(store, NAMESPACE, "test", "observer", mode=EveryTurn(), enable_thinking=True)
    work = {box: root / f"work-{box}" for box in ("control", "box-a", "box-b")}

    def box_env(box: str) -> dict[str, str]:
        env = worker_env(local_s3, s3_prefix, work[box], length_mean=24, length_max=48)
        env.update(STANDIN_PACE | {"DATAGEN_STANDIN_TOKENS_PER_STEP": "8"})
        env.update({"DATAGEN_BASE_PORT": "0", "DATAGEN_NUM_SERVERS": "1"})
        if box != "control":
            env["DATAGEN_BOX_NAME"] = box
        return env

    def parts(shard: int) -> list[tuple[str, str]]:
        """(box, line) of every row of the shard's completion parts."""
        out = []
        for o in store.list(sx.parts_prefix(shard, "completions")):
            out += [(_box_of_part(o.key), line) for line in store.get_bytes(o.key).decode().splitlines() if line]
        return out

    def b_mid_conversation() -> dict[int, set[str]]:
        """Conversations of shards box b holds whose uploaded step lines neither ended nor were rejected."""
        done, out = sx.done_ids(), {}
        for shard in range(n_shards):
            latest = sx.latest_claim(shard)
            if shard in done or latest is None or latest.box != "box-b":
                continue
            rows = sx.read_rows(shard)
            if open_ := set(rows.conversations) - rows.settled:
                out[shard] = open_
        return out

    with ExitStack() as stack:
        stack.callback(lambda: [_kill_marked(f"DATAGEN_WORK_DIR={p}") for p in work.values()])
        server = stack.enter_context(prefect_server(root / "prefect"))
        run_deploy(server, root / "cli-home", {"DATAGEN_HOME": "/nonexistent/deploy-machine-path"})
        api = server.api()
        stack.callback(api.close)
        stack.enter_context(_queue_worker(server, root, "control", box_env("control")))
        worker_b = stack.enter_context(_queue_worker(server, root, "box-b", box_env("box-b")))

        spec: dict[str, Any] = {
            "sources": [{"path": s} for s in sources],
            "model_path": str(ensure_model_dir()),
            "namespace": NAMESPACE,
            "turns": "every",
            "shard_size": SHARD_SIZE,
            "context_length": 8192,
            "sampling": {"max_new_tokens": 256},
            "server_args": ["--max-running-requests", "2"],
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

        _wait(
            "box b mid-conversation (a step line uploaded, the conversation open)", lambda: bool(b_mid_conversation())
        )
        # Box b dies: worker, flow-run subprocess and stand-in server, all SIGKILLed, nothing cleans up.
        with suppress(ProcessLookupError):
            os.killpg(worker_b.pid, signal.SIGKILL)
        assert _kill_marked(f"DATAGEN_WORK_DIR={work['box-b']}"), "box b's flow run and stand-in should be running"
        interrupted = b_mid_conversation()  # what box b left open, now that it can upload no more
        assert interrupted
        stack.enter_context(_queue_worker(server, root, "box-a", box_env("box-a")))

        run = api.wait_for_flow_run(parent_id, WAIT_S, diagnostics=root / "box-a-worker.log")
        assert run["state_type"] == "COMPLETED", f"{run['state']}\n{api.log_text(parent_id)}"

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
            split = split_step_key(key)
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
    keys = [o.key for o in store.list(f"{NAMESPACE}/")]
    manifest = json.loads(store.get_bytes(f"{NAMESPACE}/manifest.json"))
    # The lineage names the parent run and the plan's skip counts in this mode too (one builder for both flows).
    lineage = manifest["lineage"]
    assert (lineage["run_id"], lineage["run_name"]) == (parent_id, run["name"]), lineage
    assert lineage["skipped_published"] == 0 and lineage["old_rejects_skipped"] == 0
    data = [pq.read_table(io.BytesIO(store.get_bytes(k))) for k in keys if k.startswith(f"{NAMESPACE}/data/")]
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
        if k.startswith(f"{NAMESPACE}/conversations/")
        for line in store.get_bytes(k).decode().splitlines()
    ]
    assert len({r["id"] for r in published_lines}) == len(published_lines)
    assert {cid for cid, _ in rows_published} == {r["id"] for r in published_lines}
    counts = manifest["lineage"]["conversations"]
    assert counts["published"] == len(published_lines) and counts["published_user_turns"] == len(rows_published)
    assert counts["generated_twice"] == 0
    assert manifest["lineage"]["rows"] == len(rows_published)
