"""The pilot's projection against a measured run, in both turns modes, on a stand-in with a known timing model.

The pilot samples the whole set, so the projection's inputs are the run's own lengths (known totals): the test
checks what the projection adds to them, the decode simulation in the order the main run dispatches (`last`:
long-first requests; `every`: conversations as chains of steps, the ready step with the most expected work left
first, as the shard driver ranks them), against the main run measured on the stand-in.
"""

from __future__ import annotations

import concurrent.futures
import json
import time
from pathlib import Path
from typing import Literal

import pytest

from datagen.chat import ChatTokenizer
from datagen.checks.quality import ValidationSummary
from datagen.conversation.turn_mode import turn_mode
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.endpoints import ServerEndpoint
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from tasks.generation import ShardResult, generate_shard
from tasks.ordering import long_first_filter
from tasks.pilot import PilotSpec, plan_pilot, project, write_projection
from tasks.planning import ShardPlan, plan_shards

SLOTS = 4
STEP_MS = 8.0  # per token, whatever the batch: one server decodes SLOTS / 8 ms = 500 tok/s at a full batch
KNOBS = {
    "DATAGEN_STANDIN_LOAD_S": "0",
    "DATAGEN_STANDIN_WARMUP_S": "0",
    "DATAGEN_STANDIN_STEP_BASE_MS": str(STEP_MS),
    "DATAGEN_STANDIN_LENGTH_MEAN": "80",
    "DATAGEN_STANDIN_LENGTH_MAX": "300",
    "DATAGEN_STANDIN_SEED": "0",
}
CONVERSATIONS = 30


def _source(tmp_path: Path) -> PromptSource:
    """Conversations of 1-3 user turns, each with its recorded answers, in two categories."""
    rows = []
    for i in range(CONVERSATIONS):
        messages = []
        for t in range(1 + i % 3):
            messages.append({"role": "user", "content": f"Conversation {i}, turn {t}: why is {i * 7 + t} odd?"})
            messages.append({"role": "assistant", "content": f"A recorded answer to {i}/{t}."})
        rows.append({"messages": messages, "category": "long" if i % 3 == 2 else "short"})
    path = tmp_path / "conversations.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return PromptSource(path=str(path), category_field="category")


def _generate(
    endpoint: ServerEndpoint, layout: RunLayout, plan: ShardPlan, chat: ChatTokenizer, spec: RunSpec
) -> tuple[list[ShardResult], float]:
    """Every shard of the plan at once through one dispatcher; their results and the wall time."""
    with Dispatcher([endpoint], stall_timeout_s=120) as dispatcher:
        assert dispatcher.wait_ready(60)
        t0 = time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(len(plan.shard_ids)) as pool:
            futures = [pool.submit(generate_shard, s, layout, dispatcher, chat, spec, 1.0) for s in plan.shard_ids]
            results = [f.result(timeout=300) for f in futures]
        return results, time.monotonic() - t0


@pytest.mark.slow
@pytest.mark.parametrize("turns", ["last", "every"])
def test_the_pilots_projection_is_within_5_percent_of_the_measured_run(
    tmp_path: Path, turns: Literal["last", "every"]
) -> None:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    spec = RunSpec(
        sources=[_source(tmp_path)],
        model_path=str(model_dir),
        turns=turns,
        shard_size=10,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
    )
    work = tmp_path / "work"
    pilot_spec = PilotSpec(name="pilot", sample_size=CONVERSATIONS, min_per_source=1, shards=3)
    pilot_layout = RunLayout.for_run(work, "pilot")
    plan, population = plan_pilot(spec, pilot_spec, pilot_layout, set())
    assert plan.n_prompts == CONVERSATIONS  # the whole set: its lengths are the main run's
    with run_standin(model_dir, args=("--max-running-requests", str(SLOTS)), env=KNOBS) as endpoint:
        _generate(endpoint, pilot_layout, plan, chat, spec)
        # The stand-in's own timing model stands for the probe's fit (tested in test_pilot.py).
        throughput = {
            "aggregate_tokens_per_s": SLOTS / (STEP_MS / 1000), "servers": 1, "slots_per_server": SLOTS,
            "step_base_s": STEP_MS / 1000, "step_per_req_s": 0.0, "ramp_s": 0.0, "method": "known",
        }  # fmt: skip
        projection = project(
            pilot_layout, plan, population, ValidationSummary(), throughput, 1, pilot_spec, turns=turn_mode(spec)
        )
        write_projection(pilot_layout, projection)  # the main run's driver ranks by it (`pilot_step_tokens`)

        # The main run: planned long-first by the pilot's length model, nothing imported from the pilot.
        main_spec = spec.model_copy(update={"pilot": "pilot", "order": "long_first"})
        layout = RunLayout.for_run(work, "main")
        spill = tmp_path / "spill"
        spill.mkdir()
        main_plan = plan_shards(main_spec, layout, select=long_first_filter(projection.length_model, spill))
        results, wall = _generate(endpoint, layout, main_plan, chat, main_spec)
    tokens = sum(r.output_tokens for r in results)
    pr = projection.projection
    steps = sum(r.n_completed for r in results)
    assert (steps > CONVERSATIONS) == (turns == "every")  # every turn: the conversations' later turns too
    assert projection.output_tokens["projected_total"] == pytest.approx(tokens, rel=0.05)
    assert pr["wall_s"] == pytest.approx(wall, rel=0.05), (pr, wall, tokens)
