"""Every-turn shard workers rank conversations by the work they have left, and a shard holding nothing goes first.

Real stand-in server over HTTP, one dispatcher; which conversation's step goes first is read from the order
the shard workers submit (`Dispatcher.submit`, recorded), which is the order the dispatcher's queue takes them.
"""

from __future__ import annotations

import concurrent.futures
import json
import threading
from pathlib import Path
from typing import Any

import pytest

import tasks.generation as generation
from datagen.chat import ChatTokenizer
from datagen.conversation.turn_mode import expected_steps
from datagen.engine.dispatcher import Dispatcher, GenerateJob
from datagen.identity import prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Prompt
from datagen.runspec import RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from tasks.ordering import GroupStat, LengthModel, StepModel, recorded_kinds
from tasks.pilot import PILOT_JSON

KNOBS = {
    "DATAGEN_STANDIN_LOAD_S": "0.1",
    "DATAGEN_STANDIN_WARMUP_S": "0.1",
    "DATAGEN_STANDIN_LENGTH_MEAN": "100",
    "DATAGEN_STANDIN_LENGTH_MAX": "200",
}
# ~1 s a request: a place in the queue frees rarely, so who is waiting for it when it does decides.
SLOW = {**KNOBS, "DATAGEN_STANDIN_STEP_BASE_MS": "10"}


def _prompt(tag: str, i: int, turns: int, category: str | None = None) -> Prompt:
    messages: list[dict[str, Any]] = []
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"Answer {t} to {tag} {i}."})
        messages.append({"role": "user", "content": f"{tag} {i}, turn {t}: what is {i + t} squared, and why?"})
    return Prompt(prompt_id_from_messages("t", messages), "t", i, messages, category=category)


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]


def _tool_prompt(i: int, category: str) -> Prompt:
    """One user turn whose recorded answer called a tool: two steps, the call and the answer after its result."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": f"City {i}"}}}
    messages: list[dict[str, Any]] = [
        {"role": "user", "content": f"weather {i}: will it rain in City {i} tomorrow?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"sky": "rain"}'},
        {"role": "assistant", "content": "Rain, all day."},
    ]
    return Prompt(prompt_id_from_messages("t", messages), "t", i, messages, category=category, tools=TOOLS)


def _write_shard(layout: RunLayout, shard: int, prompts: list[Prompt]) -> None:
    path = layout.shard_prompts(shard)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in prompts))


def _spec(model_dir: Path, pilot: str | None = None) -> RunSpec:
    return RunSpec(
        model_path=str(model_dir),
        sampling=SamplingSpec(max_new_tokens=320),
        context_length=8192,
        turns="every",
        pilot=pilot,
    )


def _recording(
    dispatcher: Dispatcher, monkeypatch: pytest.MonkeyPatch, after: int = 1
) -> tuple[list[str], threading.Event]:
    """Labels (`<prompt id>:step-N`) in the order the shard workers submitted them; the event is set at `after`."""
    submitted: list[str] = []
    reached = threading.Event()
    lock = threading.Lock()
    submit = dispatcher.submit

    def recording_submit(job: GenerateJob, *, timeout: float | None = None) -> Any:
        future = submit(job, timeout=timeout)
        with lock:
            submitted.append(job.label)
            if len(submitted) >= after:
                reached.set()
        return future

    monkeypatch.setattr(dispatcher, "submit", recording_submit)
    return submitted, reached


def test_the_conversation_with_most_work_left_opens_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    layout = RunLayout(tmp_path / "run")
    # Four one-turn conversations in plan order, then one of three user turns (three steps).
    prompts = [*(_prompt("short", i, 1) for i in range(4)), _prompt("long", 4, 3)]
    assert [expected_steps(p) for p in prompts] == [1, 1, 1, 1, 3]
    _write_shard(layout, 0, prompts)
    with (
        run_standin(model_dir, args=("--max-running-requests", "1"), env=KNOBS) as endpoint,
        Dispatcher([endpoint], queue_depth=0, stall_timeout_s=120) as dispatcher,
    ):
        assert dispatcher.wait_ready(60)
        submitted, _ = _recording(dispatcher, monkeypatch)
        result = generation.generate_shard(0, layout, dispatcher, chat, _spec(model_dir), 2.0)
    assert result.n_prompts == 5
    long_id = prompts[4].prompt_id
    assert submitted[0] == f"{long_id}:step-0", submitted  # before: the first one-turn conversation (plan order)
    assert sorted(submitted) == sorted(
        [f"{p.prompt_id}:step-0" for p in prompts[:4]] + [f"{long_id}:step-{s}" for s in range(result.n_completed - 4)]
    )


def test_a_shard_holding_nothing_goes_first(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    layout = RunLayout(tmp_path / "run")
    heavy = [_prompt("heavy", i, 3) for i in range(8)]  # shard 0: lower in plan order, more work
    light = [_prompt("light", i, 1) for i in range(2)]
    _write_shard(layout, 0, heavy)
    _write_shard(layout, 1, light)
    spec = _spec(model_dir)
    with (
        run_standin(model_dir, args=("--max-running-requests", "2"), env=SLOW) as endpoint,
        Dispatcher([endpoint], queue_depth=0, stall_timeout_s=120) as dispatcher,
    ):
        assert dispatcher.wait_ready(60)
        assert dispatcher.queue_limit == 2
        # Shard 1 starts once shard 0 has filled the servers' two slots and the queue's two places.
        submitted, filled = _recording(dispatcher, monkeypatch, after=4)
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            first = pool.submit(generation.generate_shard, 0, layout, dispatcher, chat, spec, 2.0)
            assert filled.wait(60)
            started_at = len(submitted)
            second = pool.submit(generation.generate_shard, 1, layout, dispatcher, chat, spec, 2.0)
            results = [first.result(timeout=240), second.result(timeout=240)]
    assert [r.n_prompts for r in results] == [8, 2]
    assert results[0].n_completed > 8  # shard 0's conversations went on past their first steps
    light_ids = {p.prompt_id for p in light}
    first_light = next(i for i, label in enumerate(submitted) if label.split(":")[0] in light_ids)
    # Shard 1 holds nothing, so its first step goes ahead of shard 0's (which holds some), at the first free place
    # once it asks (one of shard 0's may go while shard 1's worker starts on a busy machine). Before, shard 0,
    # lower in plan order and always waiting for the next place, kept the queue while it had steps to send.
    assert first_light - started_at <= 1, (started_at, first_light, submitted)


def test_the_pilots_lengths_rank_conversations_when_its_projection_is_there(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    # Row 0: two turns of a category the pilot measured short; row 1: one turn of a category it measured long.
    prompts = [_prompt("chat", 0, 2, category="short"), _prompt("essay", 1, 1, category="long")]
    length_model = LengthModel(
        global_mean=500,
        by_source={"t": GroupStat(n=2000, mean=500)},
        by_category={"t": {"short": GroupStat(n=1000, mean=100), "long": GroupStat(n=1000, mean=3000)}},
    )
    pilot_dir = RunLayout.for_run(tmp_path, "pilot-a").root
    pilot_dir.mkdir(parents=True)
    (pilot_dir / PILOT_JSON).write_text(json.dumps({"length_model": length_model.model_dump()}))
    first: dict[str | None, str] = {}
    with (
        run_standin(model_dir, args=("--max-running-requests", "1"), env=KNOBS) as endpoint,
        Dispatcher([endpoint], queue_depth=0, stall_timeout_s=120) as dispatcher,
    ):
        assert dispatcher.wait_ready(60)
        submitted, _ = _recording(dispatcher, monkeypatch)
        for pilot in ("pilot-a", None):  # with the pilot's projection, and without (each step counts 1)
            layout = RunLayout.for_run(tmp_path, f"run-{pilot}")
            _write_shard(layout, 0, prompts)
            submitted.clear()
            generation.generate_shard(0, layout, dispatcher, chat, _spec(model_dir, pilot), 2.0)
            first[pilot] = submitted[0].split(":")[0]
    assert first["pilot-a"] == prompts[1].prompt_id  # ~3,000 tokens expected against ~100
    assert first[None] == prompts[0].prompt_id  # two steps against one


def test_the_pilots_step_lengths_per_kind_decide_which_conversation_opens_first(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    # Row 0: three user turns; row 1: one user turn whose answer called a tool (its call, then a tool round).
    # Same source and category: the pilot's length model expects the same whole output of both.
    prompts = [_prompt("chat", 0, 3, category="c"), _tool_prompt(1, category="c")]
    assert [recorded_kinds(p) for p in prompts] == [
        ("first_turn", "later_turn", "later_turn"),
        ("first_turn", "tool_round"),
    ]
    length_model = LengthModel(global_mean=500, by_source={"t": GroupStat(n=2000, mean=500)})
    # The pilot measured tool rounds long (the answer written after the results) and later user turns short.
    steps = StepModel.fit(
        [("c", "first_turn", 50)] * 100 + [("c", "later_turn", 50)] * 100 + [("c", "tool_round", 2000)] * 100
    )
    pilots = {
        "with-steps": {"length_model": length_model.model_dump(), "step_model": steps.model_dump()},
        "before-steps": {"length_model": length_model.model_dump()},  # a pilot file written before they were measured
    }
    for name, content in pilots.items():
        pilot_dir = RunLayout.for_run(tmp_path, name).root
        pilot_dir.mkdir(parents=True)
        (pilot_dir / PILOT_JSON).write_text(json.dumps(content))
    first: dict[str, str] = {}
    with (
        run_standin(model_dir, args=("--max-running-requests", "1"), env=KNOBS) as endpoint,
        Dispatcher([endpoint], queue_depth=0, stall_timeout_s=120) as dispatcher,
    ):
        assert dispatcher.wait_ready(60)
        submitted, _ = _recording(dispatcher, monkeypatch)
        for pilot in pilots:
            layout = RunLayout.for_run(tmp_path, f"run-{pilot}")
            _write_shard(layout, 0, prompts)
            submitted.clear()
            result = generation.generate_shard(0, layout, dispatcher, chat, _spec(model_dir, pilot), 2.0)
            assert result.n_prompts == 2
            first[pilot] = submitted[0].split(":")[0]
    # ~2,050 tokens expected of the tool conversation against ~150 of the three turns. Before, the length model's
    # 500 shared over the steps tied them, and the plan order opened row 0 first.
    assert first["with-steps"] == prompts[1].prompt_id
    assert first["before-steps"] == prompts[0].prompt_id  # an old pilot file: the length model still ranks (a tie)
