"""A shard worker that is slow to start (reading a large checkpoint) keeps its place in the plan order.

Before, the preparation turn went to whichever worker was waiting: a higher shard that got there first filled the
servers, and the late shard's requests (in a long-first plan, the longest) waited a whole generation for a slot.
Real stand-in server over HTTP; the late start is forced by slowing shard 0's checkpoint read. Both turn modes:
the reservation is the shard driver's, not one mode's (single-turn prompts: a conversation of one step each).
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from pathlib import Path
from typing import Any

import pytest

import tasks.generation as generation
from datagen.chat import ChatTokenizer
from datagen.engine.dispatcher import Dispatcher, GenerateJob
from datagen.identity import prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Prompt
from datagen.runspec import RunSpec, SamplingSpec
from datagen.standin.testing import run_standin

PER_SHARD = 6
KNOBS = {"DATAGEN_STANDIN_LOAD_S": "0.1", "DATAGEN_STANDIN_WARMUP_S": "0.1", "DATAGEN_STANDIN_LENGTH_MEAN": "20"}


@pytest.mark.parametrize("turns", ["last", "every"])
def test_a_late_shard_worker_still_sends_before_higher_shards(
    turns: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    spec = RunSpec(model_path=str(model_dir), sampling=SamplingSpec(max_new_tokens=32), turns=turns)
    layout = RunLayout(tmp_path / "run")
    for shard in (0, 1):
        path = layout.shard_prompts(shard)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for i in range(PER_SHARD):
                messages = [{"role": "user", "content": f"Shard {shard}, question {i}: what is {i} squared?"}]
                f.write(Prompt(prompt_id_from_messages("t", messages), "t", i, messages).to_json() + "\n")

    # Shard 0's worker reads its checkpoint slowly (a large one), so shard 1's worker reaches the turn first.
    reading = threading.Event()
    read = generation.read_ledger

    def slow_read(path: Path, *args: Any) -> Any:
        if path.name.startswith("shard-00000"):
            reading.set()
            time.sleep(1.5)
        return read(path, *args)

    monkeypatch.setattr(generation, "read_ledger", slow_read)

    with (
        run_standin(model_dir, args=("--max-running-requests", "4"), env=KNOBS) as endpoint,
        Dispatcher([endpoint], queue_depth=0, stall_timeout_s=120) as dispatcher,
    ):
        assert dispatcher.wait_ready(60)
        submitted: list[tuple[int, ...]] = []
        submit = dispatcher.submit

        def recording_submit(job: GenerateJob, *, timeout: float | None = None) -> Any:
            future = submit(job, timeout=timeout)
            submitted.append(job.order)
            return future

        monkeypatch.setattr(dispatcher, "submit", recording_submit)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(generation.generate_shard, 0, layout, dispatcher, chat, spec, 2.0)
            assert reading.wait(60)  # shard 0's worker has started and is reading its checkpoint
            second = pool.submit(generation.generate_shard, 1, layout, dispatcher, chat, spec, 2.0)
            results = [first.result(timeout=120), second.result(timeout=120)]

    assert [r.n_completed for r in results] == [PER_SHARD, PER_SHARD]
    if turns == "last":
        assert submitted == [(0, i) for i in range(PER_SHARD)] + [(1, i) for i in range(PER_SHARD)]
    else:
        # Every turn: the reservation holds until the shard's first step is in the queue; from then on the work
        # left orders the queue, a shard holding nothing first (EveryTurn.send_order: the shard is at [1] for a
        # shard holding nothing, at [2] otherwise). Shard 0's first step still goes before any of shard 1's.
        shards = [order[1] if order[0] == 0 else order[2] for order in submitted]
        assert shards[0] == 0 and sorted(shards) == [0] * PER_SHARD + [1] * PER_SHARD, submitted
