"""The pilot in every-turn mode: a hand-computed projection from step lines (its sample is conversations)."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

import pytest

from datagen.chat import ChatTokenizer
from datagen.checkpoint import settled_keys
from datagen.checks.quality import ValidationSummary
from datagen.conversation.turn_mode import EveryTurn
from datagen.identity import RequestKeys
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Message, Prompt, Reject
from datagen.runspec import PromptSource, RunSpec
from datagen.settings import Settings
from flows import multi_box, skeleton
from tasks import pilot_turns
from tasks.chains import Chain, ChainRun, DecodeModel
from tasks.generation import pilot_step_tokens
from tasks.ordering import LengthModel, StepModel, recorded_kinds, step_kind, step_lengths
from tasks.pilot import (
    PILOT_JSON,
    RECORDED_TURNS,
    PilotPopulation,
    PilotSpec,
    Projection,
    import_pilot,
    plan_turns,
    project,
    render_projection,
    write_projection,
)
from tasks.pilot_turns import PilotMeasure, SampledChain, chain_walls, conversation_key, user_turns
from tasks.planning import ShardEntry, ShardPlan, plan_shards
from tasks.selection import SelectionReport


def _step(pid: str, src: str, n: int, turn: int, tokens: int, prompt_tokens: int, **kw: object) -> Completion:
    return Completion(
        prompt_id=pid,
        source=src,
        row=0,
        messages=[Message("user", "q")],
        request_key=f"k-{pid}:step-{n}",
        prompt_tokens=prompt_tokens,
        output_ids=[1] * tokens,
        text="",
        finish_reason="stop",
        completion_tokens=tokens,
        category=src,
        step=n,
        turn_index=turn,
        **kw,  # type: ignore[arg-type]
    )


def _prompt(pid: str, src: str, users: int, tool_result: bool = False) -> Prompt:
    messages = [Message("system", "be brief")]
    for i in range(users):
        messages += [Message("user", f"question {i} " * 5), Message("assistant", "the other model's answer")]
        if tool_result:
            messages += [Message("user", "<tool_response>\n42\n</tool_response>"), Message("assistant", "ok")]
    return Prompt(prompt_id=pid, source=src, row=0, messages=messages, category=src)


def _hand_case(tmp_path: Path) -> tuple[RunLayout, ShardPlan, PilotPopulation, ValidationSummary]:
    """Source a (100 conversations), sampled a1, a2; source b (50), sampled b1, b2.

    a1: turn 0 = a call (10 tokens) and its continuation (20, bridge), turn 1 (30): complete; validation
        rejects its turn-1 step -> 1 row (80 + 20 = 100 tokens) of 2 segments reached.
    a2: turn 0 (40 tokens) diverges from the recorded call -> 1 row (60 + 40 = 100).
    b1: refused on its first step (context) -> no output, 1 segment reached, no row.
    b2: turn 0 (20 tokens) -> a row of 60; turn 1 (64) truncated -> no row.
    """
    layout = RunLayout(tmp_path)
    layout.shards_dir.mkdir(parents=True)
    prompts = [_prompt("a1", "a", 2), _prompt("a2", "a", 1, tool_result=True), _prompt("b1", "b", 1)]
    prompts.append(_prompt("b2", "b", 2))
    layout.shard_prompts(0).write_text("".join(p.to_json() + "\n" for p in prompts))
    steps = [
        _step("a1", "a", 0, 0, 10, 50),
        _step("a2", "a", 0, 0, 40, 60, outcome="tool_call_divergence"),
        _step("a1", "a", 1, 0, 20, 80, bridge_ids=[5, 6]),
        _step("b2", "b", 0, 0, 20, 40),
        _step("a1", "a", 2, 1, 30, 150, outcome="complete"),
        _step("b2", "b", 1, 1, 64, 100, outcome="truncated"),
    ]
    layout.shard_completions(0).write_text("".join(c.to_json() + "\n" for c in steps))
    refused = Reject("generate", "context_exceeded", "turn 0", "b", prompt_id="b1", request_key="k-b1:step-0")
    layout.shard_rejects(0).write_text(refused.to_json() + "\n")
    validation = tmp_path / "validated" / "shard-00000.rejects.jsonl"
    validation.parent.mkdir()
    placeholder = Reject("validate", "placeholder", "turn 1", "a", prompt_id="a1", request_key="k-a1:step-2")
    validation.write_text(placeholder.to_json() + "\n")
    plan = ShardPlan(
        shard_size=4, shard_ids=[0], shards=[ShardEntry(shard_id=0, n_prompts=4, sha256="0" * 64)], n_rows=4,
        n_prompts=4, n_load_rejects=0, prompts_by_source={"a": 2, "b": 2}, load_rejects_by_source={},
        load_rejects_by_reason={}, prompts_by_category={"a": 2, "b": 2}, n_uncategorized=0,
        load_rejects_sha256="0" * 64, plan_sha256="0" * 64,
    )  # fmt: skip
    population = PilotPopulation(
        population_by_source={"a": 100, "b": 50}, sample_by_source={"a": 2, "b": 2}, selection=SelectionReport()
    )
    # Validation's counts are per step here; every-turn projection reads its reject files, not these.
    return layout, plan, population, ValidationSummary(rejected_by_source={"a": 1}, reject_paths=[str(validation)])


def test_user_turns_are_queries_not_tool_response_text() -> None:
    assert user_turns(_prompt("x", "a", 2)) == 2
    assert user_turns(_prompt("x", "a", 2, tool_result=True)) == 2


def test_every_turn_projection_of_a_hand_computed_case(tmp_path: Path) -> None:
    layout, plan, population, summary = _hand_case(tmp_path)
    p = project(
        layout,
        plan,
        population,
        summary,
        {"aggregate_tokens_per_s": 100.0, "servers": 2, "method": "whole_run"},
        4,
        PilotSpec(),
        turns=EveryTurn(),
    )
    out, pr, conv = p.output_tokens, p.projection, p.conversations
    assert conv is not None
    # a: conversations of 60 and 40 tokens -> 50 each -> 5,000. b: 84 and a refusal (0) -> 42 each -> 2,100.
    assert out["by_source"]["a"]["projected_tokens"] == 5000 and out["by_source"]["b"]["projected_tokens"] == 2100
    assert out["projected_total"] == 7100 and out["pilot_total"] == 184
    # The per-request figure (the memory plan's) is per step: 10, 20, 30, 40, 20, 64.
    assert out["n"] == 6 and out["mean"] == 30.7 and out["max"] == 64
    # Rows are user-turn segments: a makes 2 of the 3 it reached (1 per conversation), b 1 of 3.
    assert out["by_source"]["a"]["reject_rate"] == 0.3333 and out["by_source"]["b"]["reject_rate"] == 0.6667
    assert pr["rows"] == 125  # 1 x 100 + 0.5 x 50
    assert pr["dataset_tokens"] == 11500  # 100 rows of 100 tokens + 25 of 60
    assert pr["reject_rate"] == 0.4444  # (0.5 x 100 + 1 x 50) / (1.5 x 100 + 1.5 x 50)
    assert pr["steps"] == 250  # a: 2 steps per conversation, b: 1
    # 50 tok/s per server, 4 servers: 7,100 / 200.
    assert pr["wall_s"] == 35.5
    assert (conv["conversations"], conv["finished"], conv["steps"], conv["user_turns"]) == (4, 4, 6, 5)
    assert conv["steps_per_user_turn"]["max"] == 2 and conv["user_turns_per_conversation"]["max"] == 2
    assert conv["user_turns_in_source"]["mean"] == 1.5
    assert conv["outcomes"] == {"complete": 1, "tool_call_divergence": 1, "context_exceeded": 1, "truncated": 1}
    assert conv["ended_early"]["truncated"] == 0.25
    assert conv["rows_per_conversation"] == 0.75
    text = render_projection(p)
    assert "projection for 150 conversations" in text and "output tokens per step" in text
    assert "| steps per user turn: mean / p90 / max | 1.2 / 2 / 2 |" in text
    assert "| tool_call_divergence | 1 | 25.0% |" in text and "| steps projected for the full set | 250 |" in text


def test_the_decode_simulation_with_one_slot_runs_every_step_one_after_another(tmp_path: Path) -> None:
    layout, plan, population, summary = _hand_case(tmp_path)
    throughput = {
        "aggregate_tokens_per_s": 100.0, "servers": 1, "step_base_s": 0.01, "step_per_req_s": 0.0,
        "slots_per_server": 1, "ramp_s": 0.0,
    }  # fmt: skip
    p = project(layout, plan, population, summary, throughput, 1, PilotSpec(), turns=EveryTurn())
    # One slot, 10 ms a token: the steps of a's 100 conversations (60 and 40 tokens, 50 of each) and of b's 25
    # that produce output (84 tokens each): 7,100 tokens one after another.
    assert p.projection["wall_s"] == pytest.approx(71.0)
    # The length model (the main run's long-first order) predicts a conversation's total output.
    assert p.length_model.by_source["a"].mean == 50.0 and p.length_model.by_source["b"].mean == 84.0


def test_a_main_run_imports_every_step_of_the_pilots_conversations(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"question {i}"}) + "\n" for i in range(3)))
    spec = RunSpec(
        sources=[PromptSource(path=str(prompts))], shard_size=3, model_path=str(ensure_model_dir()), turns="every"
    )
    chat = ChatTokenizer.shared(spec.model_path)
    pilot_layout, main_layout = RunLayout(tmp_path / "pilot"), RunLayout(tmp_path / "main")
    plan = plan_shards(spec, main_layout)
    key_of = RequestKeys(spec.sampling, chat)
    pids = [Prompt.from_json(line).prompt_id for line in main_layout.shard_prompts(0).read_text().splitlines()]

    def line(i: int, n: int, **kw: object) -> str:
        c = _step(pids[i], "p", n, 0, 5, 10, **kw)
        c.request_key = f"{key_of(pids[i])}:step-{n}"
        return c.to_json() + "\n"

    pilot_layout.shards_dir.mkdir(parents=True)
    # Conversation 0: three steps, complete. Conversation 1: a step, then refused. Conversation 2: not in the pilot.
    pilot_layout.shard_completions(0).write_text(
        line(0, 0) + line(1, 0) + line(0, 1, bridge_ids=[1]) + line(0, 2, outcome="complete")
    )
    refused = Reject("generate", "context_exceeded", "turn 0", "p", prompt_id=pids[1])
    refused.request_key = f"{key_of(pids[1])}:step-1"
    pilot_layout.shard_rejects(0).write_text(refused.to_json() + "\n")
    result = import_pilot(pilot_layout, main_layout, plan, spec, chat)

    assert (result.imported_completions, result.imported_rejects, result.already_present) == (4, 1, 0)
    rows = [json.loads(x) for x in main_layout.shard_completions(0).read_text().splitlines()]
    assert [(r["prompt_id"], r["step"]) for r in rows] == [(pids[0], 0), (pids[0], 1), (pids[0], 2), (pids[1], 0)]
    assert settled_keys(main_layout.shard_rejects(0), "reject") == {f"{key_of(pids[1])}:step-1"}
    assert import_pilot(pilot_layout, main_layout, plan, spec, chat).already_present == 5  # idempotent

    # A main run that generated conversation 0's first step itself: the pilot's later steps answer another
    # history, so none of the conversation is copied.
    other = RunLayout(tmp_path / "other")
    plan = plan_shards(spec, other)
    other.shard_completions(0).write_text(line(0, 0))
    result = import_pilot(pilot_layout, other, plan, spec, chat)
    assert (result.imported_completions, result.imported_rejects, result.already_present) == (1, 1, 1)
    rows = [json.loads(x) for x in other.shard_completions(0).read_text().splitlines()]
    assert [(r["prompt_id"], r["step"]) for r in rows] == [(pids[0], 0), (pids[1], 0)]
    assert conversation_key("abc:step-12") == "abc" and conversation_key("abc") == "abc"

    # A main run of the other mode reuses nothing: `last` completions are not steps, and steps are not completions.
    last = RunLayout(tmp_path / "last")
    last_spec = spec.model_copy(update={"turns": "last"})
    result = import_pilot(pilot_layout, last, plan_shards(last_spec, last), last_spec, chat)
    assert (result.imported_completions, result.imported_rejects, result.other_mode) == (0, 0, 5)
    assert not last.shard_completions(0).exists() or last.shard_completions(0).read_text() == ""


def test_a_main_run_whose_every_conversation_the_pilot_settled_generates_nothing_and_needs_no_servers(
    tmp_path: Path,
) -> None:
    """A pilot that sampled the whole set settles every conversation of the main run: the flow starts no servers
    (dispatcher None) and the shard must come back as a result, as in `last` mode. (Failed before the fix with an
    AssertionError in the old every-turn driver (generation_turns._open_next),
    met by tests/e2e/test_plan_trial_flow.py under `turns: every`.)"""
    from tasks.generation import generate_shard

    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"question {i}"}) + "\n" for i in range(2)))
    spec = RunSpec(
        sources=[PromptSource(path=str(prompts))], shard_size=2, model_path=str(ensure_model_dir()), turns="every"
    )
    chat = ChatTokenizer.shared(spec.model_path)
    layout = RunLayout(tmp_path / "main")
    plan_shards(spec, layout)
    key_of = RequestKeys(spec.sampling, chat)
    lines = []
    for prompt in (Prompt.from_json(line) for line in layout.shard_prompts(0).read_text().splitlines()):
        c = _step(prompt.prompt_id, prompt.source, 0, 0, 5, 10, outcome="complete")
        c.request_key = f"{key_of(prompt.prompt_id)}:step-0"
        lines.append(c.to_json() + "\n")
    layout.shard_completions(0).write_text("".join(lines))

    result = generate_shard(0, layout, None, chat, spec)
    assert (result.n_prompts, result.n_completed, result.n_sent) == (2, 2, 0)


def test_the_every_turn_wall_is_simulated_on_chains_ranked_by_expected_work_left(tmp_path: Path) -> None:
    """A conversation is a chain of steps, not one request holding a slot: a freed slot takes the ready step with
    the most expected work left (the driver's rank), so a short first-turn conversation goes before a long one's
    second step. Before, the projection replayed each conversation as one request of its summed length."""
    layout = RunLayout(tmp_path)
    layout.shards_dir.mkdir(parents=True)
    a = dataclasses.replace(_prompt("a", "s", 2), category="long")  # two user turns: 10 + 10 tokens
    b, c = (dataclasses.replace(_prompt(pid, "s", 1), category="short") for pid in ("b", "c"))  # 12 tokens each
    layout.shard_prompts(0).write_text("".join(p.to_json() + "\n" for p in (a, b, c)))
    steps = [
        _step("a", "s", 0, 0, 10, 50),
        _step("b", "s", 0, 0, 12, 50, outcome="complete"),
        _step("c", "s", 0, 0, 12, 50, outcome="complete"),
        _step("a", "s", 1, 1, 10, 80, outcome="complete"),
    ]
    layout.shard_completions(0).write_text("".join(x.to_json() + "\n" for x in steps))
    plan = ShardPlan(
        shard_size=3, shard_ids=[0], shards=[ShardEntry(shard_id=0, n_prompts=3, sha256="0" * 64)], n_rows=3,
        n_prompts=3, n_load_rejects=0, prompts_by_source={"s": 3}, load_rejects_by_source={},
        load_rejects_by_reason={}, prompts_by_category={"long": 1, "short": 2}, n_uncategorized=0,
        load_rejects_sha256="0" * 64, plan_sha256="0" * 64,
    )  # fmt: skip
    population = PilotPopulation(
        population_by_source={"s": 3}, sample_by_source={"s": 3}, selection=SelectionReport()
    )  # the pilot sampled the whole set: the full run is these three chains
    # One server, two slots, one token a second whatever the batch; 0.5 s before the first request ran.
    throughput = {
        "aggregate_tokens_per_s": 2.0, "servers": 1, "step_base_s": 1.0, "step_per_req_s": 0.0,
        "slots_per_server": 2, "ramp_s": 0.5, "method": "saturated",
    }  # fmt: skip
    p = project(layout, plan, population, ValidationSummary(), throughput, 1, PilotSpec(), turns=EveryTurn())
    pr = p.projection
    # The step model (the driver's rank) expects a's two steps (category long: 10 and 10 tokens measured) above
    # b and c (short: 12), and a's second step below them: t=0 a's turn 0 and b start; t=10 a's turn 1 is ready
    # but c (more work left) takes the slot; t=12 b ends, a's turn 1 runs to 22. As one request of 20 tokens a
    # would hold its slot: b to 12, c to 24.
    assert p.step_model is not None
    a_steps, (c_step,) = p.step_model.expected(a), p.step_model.expected(c)
    assert a_steps[1] < c_step < sum(a_steps)
    assert pr["wall_s"] == pytest.approx(0.5 + 22.0) and pr["wall_s_source"] == pytest.approx(0.5 + 22.0)
    assert pr["wall_s_reusing_pilot"] == pytest.approx(0.5)  # nothing left to generate
    assert pr["policy"] == "expected_work_left" and "chains" in pr["method"]
    assert p.output_tokens["projected_total"] == 44 and pr["steps"] == 4
    # The step lengths per kind: three first user turns (10, 12, 12), one later turn (10), no tool round.
    assert p.step_model is not None
    assert (p.step_model.by_kind["first_turn"].n, p.step_model.by_kind["first_turn"].mean) == (3, pytest.approx(34 / 3))
    assert (p.step_model.by_kind["later_turn"].n, p.step_model.by_kind["later_turn"].mean) == (1, 10.0)
    assert "tool_round" not in p.step_model.by_kind and p.step_model.by_category["long"]["later_turn"].mean == 10.0
    assert len(p.step_model.expected(a)) == 2 and len(p.step_model.expected(b)) == 1
    text = render_projection(p)
    assert "| output tokens per step, later user turns: mean / p90 (steps) | 10.0 / 10 (1) |" in text
    assert "ready steps by expected work left" in text


def test_the_step_model_knows_tool_rounds_and_falls_back_to_coarser_means() -> None:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    messages = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"sky": "rain"}'},
        {"role": "assistant", "content": "Rain."},
        {"role": "user", "content": "And tomorrow?"},
        {"role": "assistant", "content": "Also rain."},
    ]
    prompt = Prompt("w", "s", 0, [Message.from_dict(m) for m in messages], category="travel", tools=[tool])
    # The first turn's call, its continuation after the result, the second turn's answer.
    assert recorded_kinds(prompt) == ("first_turn", "tool_round", "later_turn")
    assert step_kind(0, True) == "first_turn" and step_kind(3, True) == "later_turn"
    assert step_kind(0, False) == step_kind(2, False) == "tool_round"
    model = StepModel.fit(
        [("travel", "first_turn", 20)] * 5 + [("travel", "tool_round", 300)] * 5 + [("chat", "later_turn", 100)] * 10
    )
    assert model.global_mean == 130.0
    # Shrinkage (5 pseudo-samples): first turns (20 x 5) -> 75 overall; travel's own five pull it back to 47.5.
    assert model.mean("travel", "first_turn") == pytest.approx((5 * 20 + 5 * 75) / 10)
    assert model.mean("other", "first_turn") == pytest.approx(75.0)  # a category it never saw: the kind's mean
    assert model.mean(None, "later_turn") == pytest.approx((10 * 100 + 5 * 130) / 15)
    assert model.expected(prompt) == (
        model.mean("travel", "first_turn"),
        model.mean("travel", "tool_round"),
        model.mean("travel", "later_turn"),
    )
    with pytest.raises(ValueError, match="at least one step"):
        StepModel.fit([])


def test_the_driver_and_the_projection_take_the_pilots_step_lengths_and_old_pilot_files_still_rank(
    tmp_path: Path,
) -> None:
    """The main run's driver reads the pilot's step model (each recorded step its kind's mean), and the pilot's
    chains are built by the same call; a pilot file without a step model (written before it was measured) gives
    the length model's prediction shared over the expected steps, as before."""
    tools = _prompt("t", "s", 1, tool_result=True)  # a first turn and a tool round
    chat = _prompt("c", "s", 3)  # three user turns
    assert (recorded_kinds(tools), recorded_kinds(chat)) == (
        ("first_turn", "tool_round"),
        ("first_turn", "later_turn", "later_turn"),
    )
    length_model = LengthModel(global_mean=600.0)
    steps = StepModel.fit([("s", "first_turn", 20)] * 50 + [("s", "tool_round", 900)] * 50 + [("s", "later_turn", 40)])
    spec = RunSpec(model_path=str(tmp_path), turns="every", pilot="pilot-a")
    layout = RunLayout.for_run(tmp_path, "main")
    pilot_file = RunLayout.for_run(tmp_path, "pilot-a").root / PILOT_JSON
    pilot_file.parent.mkdir(parents=True)

    pilot_file.write_text(json.dumps({"length_model": length_model.model_dump(), "step_model": steps.model_dump()}))
    lengths = pilot_step_tokens(layout, spec)
    assert lengths is not None
    assert lengths(tools) == (steps.mean("s", "first_turn"), steps.mean("s", "tool_round")) == steps.expected(tools)
    assert sum(lengths(tools)) > 800 > sum(lengths(chat))  # the tool round outweighs two more user turns

    for old in (
        {"length_model": length_model.model_dump()},
        {"length_model": length_model.model_dump(), "step_model": None},
    ):
        pilot_file.write_text(json.dumps(old))
        lengths = pilot_step_tokens(layout, spec)
        assert lengths is not None
        assert lengths(tools) == (300.0, 300.0) and lengths(chat) == (200.0, 200.0, 200.0)  # 600 shared
    pilot_file.write_text(json.dumps({"projection": {}}))
    assert pilot_step_tokens(layout, spec) is None  # no length model: each step counts 1

    # The projection's chains: the same expected lengths, so its simulation ranks as the driver does.
    measured = PilotMeasure(chains=[SampledChain(tools, (20, 900)), SampledChain(chat, (20, 40, 40))])
    built: list[tuple[float, ...] | None] = []
    first: list[tuple[int, ...]] = []
    simulate = pilot_turns.simulate_chains

    def recording(chains: list[Chain], *args: Any) -> ChainRun:
        built.extend(c.expected for c in chains)
        run = simulate(chains, *args)
        first.extend(chains[i].steps for i, s in run.started[:1])
        return run

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(pilot_turns, "simulate_chains", recording)
        chain_walls(measured, {"s": 2}, {"s": 2}, length_model, steps, 1, 1, DecodeModel(1.0, 0.0), 0)
    assert (
        set(built)
        == {step_lengths(length_model, steps)(p) for p in (tools, chat)}
        == {
            steps.expected(tools),
            steps.expected(chat),
        }
    )
    # The length model ties them (one global mean): the tool conversation, most expected work, opens first in
    # both plan orders (long-first, shuffled); shared over the steps (before), both expected 600 and the plan
    # order decided.
    assert first == [(20, 900), (20, 900)]


def test_the_radix_cache_choice_takes_the_pilots_measured_steps_not_the_recordings_count(tmp_path: Path) -> None:
    layout, plan, population, summary = _hand_case(tmp_path)
    throughput = {"aggregate_tokens_per_s": 100.0, "servers": 2, "method": "whole_run"}
    p = project(layout, plan, population, summary, throughput, 4, PilotSpec(name="p1"), turns=EveryTurn())
    # 250 steps projected for 150 conversations (user turns and tool rounds: each extends the one before).
    turns, source = plan_turns(p, 3.0)
    assert turns == 1.667
    assert source.startswith("measured by pilot p1: 4 conversations, 1.25 user turns each and 1.2 steps per user turn")
    assert source.endswith("projected over 150; the recording said 3")
    # No pilot, or a `last` mode pilot (no conversations measured): the recording's count, said so.
    assert plan_turns(None, 3.0) == (3.0, RECORDED_TURNS)
    assert plan_turns(p.model_copy(update={"conversations": None}), 3.0) == (3.0, RECORDED_TURNS)


def _pilot_on_box(tmp_path: Path, name: str = "p1") -> tuple[Path, Projection]:
    """A work dir holding an every-turn pilot's projection (pilot.json), as the pilot flow leaves it on its box."""
    layout, plan, population, summary = _hand_case(tmp_path / "case")
    throughput = {"aggregate_tokens_per_s": 100.0, "servers": 2, "method": "whole_run"}
    p = project(layout, plan, population, summary, throughput, 4, PilotSpec(name=name), turns=EveryTurn())
    work_dir = tmp_path / "work"
    write_projection(RunLayout.for_run(work_dir, name), p)
    return work_dir, p


def test_a_box_plans_from_the_pilot_only_where_that_pilot_ran(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A box of a multi-box run plans as a one-box run does (`skeleton.box_memory_plan`): from its pilot's measured
    steps and output where that pilot ran on the box, from the run's recorded turns elsewhere."""
    work_dir, p = _pilot_on_box(tmp_path)
    settings = Settings(work_dir=work_dir, box_name="box-a")
    layout, projection = multi_box._pilot_here(settings, RunSpec(pilot="p1"))
    assert layout == RunLayout.for_run(work_dir, "p1") and projection == p
    asked: list[tuple[tuple[object, ...], dict[str, Any]]] = []

    def memory_plan(*args: object, **kwargs: Any) -> tuple[None, str]:
        asked.append((args, kwargs))
        return None, "no plan"

    monkeypatch.setattr(multi_box, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(skeleton, "get_run_logger", lambda: logging.getLogger("test"))
    monkeypatch.setattr(skeleton, "memory_plan_task", memory_plan)
    skeleton.box_memory_plan(settings, RunSpec(pilot="p1"), None, 3.0, projection)
    assert multi_box._pilot_here(settings, RunSpec(pilot="elsewhere")) == (None, None)
    skeleton.box_memory_plan(settings, RunSpec(pilot="elsewhere"), None, 3.0, None)
    (m_args, measured), (r_args, recorded) = asked
    assert (measured["turns_per_conversation"], measured["turns_source"]) == plan_turns(p, 3.0)
    assert m_args[3] == float(p.output_tokens["mean"])  # the pilot's measured output, as a one-box run plans
    assert (recorded["turns_per_conversation"], recorded["turns_source"]) == (3.0, RECORDED_TURNS)
    assert r_args[3] is None
