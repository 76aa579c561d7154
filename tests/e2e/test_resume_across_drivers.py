"""A shard half written by the two shard drivers before issue 34 resumes under the one driver, in both turn modes.

The fixture (tests/fixtures/checkpoint_before_one_driver, README there) is what the old code left after a crash
half way, and the lines its uninterrupted run wrote. The resumed shard must keep the old lines byte for byte, send
only what they do not settle (an every-turn conversation from its first unwritten step), and end with the same
lines the old code's whole run wrote (the stand-in is seeded, so a step's output depends on its prompt alone).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from datagen.chat import ChatTokenizer
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from tasks.generation import generate_shard, unsettled_requests
from tests.e2e.test_generation import make_dispatcher, requests_served

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "checkpoint_before_one_driver"
STANDIN = {
    "DATAGEN_STANDIN_LOAD_S": "0.1",
    "DATAGEN_STANDIN_WARMUP_S": "0.1",
    "DATAGEN_STANDIN_LENGTH_MEAN": "24",
    "DATAGEN_STANDIN_LENGTH_MAX": "48",
    "DATAGEN_STANDIN_SEED": "3",
}
VOLATILE = {"rid", "e2e_latency", "latency_s", "server"}


def _stable(line: str) -> str:
    row: dict[str, Any] = {k: v for k, v in json.loads(line).items() if k not in VOLATILE}
    if isinstance(row.get("meta"), dict):
        row["meta"] = {k: v for k, v in row["meta"].items() if k not in VOLATILE}
    return json.dumps(row, sort_keys=True)


@pytest.mark.parametrize("turns", ["last", "every"])
def test_a_shard_the_old_drivers_left_half_written_resumes_to_the_same_lines(turns: str, tmp_path: Path) -> None:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    spec = RunSpec(
        model_path="unused",
        sampling=SamplingSpec(max_new_tokens=48),
        context_length=8192,
        max_prompt_tokens=300,
        turns=turns,
    )
    layout = RunLayout(tmp_path)
    layout.shards_dir.mkdir(parents=True)
    for name in ("prompts", "completions", "rejects"):
        shutil.copy(
            FIXTURE / turns / f"shard-00000.{name}.jsonl",
            layout.shard_prompts(0).with_name(f"shard-00000.{name}.jsonl"),
        )
    old = layout.shard_completions(0).read_bytes()
    kept = old[: old.rindex(b"\n") + 1]  # the committed lines; the torn one after them is no record
    whole = (FIXTURE / turns / "whole.completions.jsonl").read_text().splitlines()
    assert 0 < kept.count(b"\n") < len(whole)
    todo = unsettled_requests(0, layout, chat, spec)
    assert todo > 0
    with run_standin(model_dir, args=("--enable-metrics",), env=STANDIN) as endpoint:
        dispatcher = make_dispatcher([endpoint])
        try:
            before = requests_served(endpoint)
            result = generate_shard(0, layout, dispatcher, chat, spec, flush_interval_s=0.2)
            sent = requests_served(endpoint) - before
        finally:
            dispatcher.close()
    data = layout.shard_completions(0).read_bytes()
    assert data.startswith(kept)  # the old lines, byte for byte; the torn one cut off
    assert sent == result.n_sent == len(whole) - kept.count(b"\n")  # only the steps the old lines do not hold
    assert sorted(_stable(line) for line in data.decode().splitlines()) == whole
    assert (result.n_prompts, result.n_completed, result.n_rejected) == (13, len(whole), 1)
    assert unsettled_requests(0, layout, chat, spec) == 0
