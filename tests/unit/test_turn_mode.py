"""The turn mode (datagen/conversation/turn_mode.py): one policy per `RunSpec.turns`, what the shard driver asks.

`last` must keep what its lines, keys and queue order always were (a conversation of one step); `every` its own.
"""

from __future__ import annotations

from array import array
from pathlib import Path
from typing import Any

import pytest

from datagen.chat import ChatTokenizer
from datagen.conversation.regeneration import Ended
from datagen.conversation.turn_mode import Conversation, EveryTurn, LastTurn, turn_mode
from datagen.engine.client import GenerateResult
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import sha256_file
from datagen.records import Prompt
from datagen.runspec import RunSpec
from datagen.sources.preparation import preparer_for, write_rendered
from tasks.chains import Chain
from tasks.generation import _ShardDriver
from tasks.shard_generation import completion_record

LAST, EVERY = LastTurn(), EveryTurn()


def _prompt(turns: int) -> Prompt:
    messages: list[dict[str, Any]] = []
    for t in range(turns):
        if t:
            messages.append({"role": "assistant", "content": f"Answer {t}."})
        messages.append({"role": "user", "content": f"Question {t}?"})
    return Prompt(f"p{turns}", "s", 0, messages)


def test_the_spec_chooses_the_mode_once() -> None:
    assert turn_mode(RunSpec(model_path="m", turns="last")).name == "last"
    assert turn_mode(RunSpec(model_path="m", turns="every")).name == "every"
    assert turn_mode(RunSpec(model_path="m")).name == RunSpec.model_fields["turns"].default


def test_keys_each_mode_writes_and_reads() -> None:
    # `last`: the conversation's request key itself (what a `last` line always carried); `every`: one per step.
    assert LAST.step_key("k", 0) == "k" and LAST.split_key("k") == ("k", 0)
    assert EVERY.step_key("k", 2) == "k:step-2" and EVERY.split_key("k:step-2") == ("k", 2)
    # A key of the other mode is none of this mode's: the ledger counts it foreign.
    assert LAST.split_key("k:step-0") is None and EVERY.split_key("k") is None


def test_which_line_ends_a_conversation_and_how_many_steps_are_expected() -> None:
    assert LAST.ends({"request_key": "k"}) and LAST.ends({"outcome": None})
    assert EVERY.ends({"outcome": "complete"}) and not EVERY.ends({"outcome": None})
    assert [LAST.expected_steps(_prompt(n)) for n in (1, 3)] == [1, 1]
    assert [EVERY.expected_steps(_prompt(n)) for n in (1, 3)] == [1, 3]
    assert not LAST.continues and LAST.holds_place_until_open and not LAST.ranked_by_work
    assert EVERY.continues and not EVERY.holds_place_until_open and EVERY.ranked_by_work


def test_last_keeps_the_plan_order_in_the_queue() -> None:
    # Work left and shares do not move a `last` request: planning ranked the prompts, (shard, row) is the order.
    assert LAST.send_order(shard=3, row=7, work=900, held=50) == (3, 7)
    assert LAST.send_order(0, 9, 1, 0) < LAST.send_order(1, 0, 900, 0)


def test_every_puts_a_shard_holding_nothing_first_and_then_ranks_by_work_alone() -> None:
    starved = EVERY.send_order(shard=5, row=9, work=1, held=0)
    assert starved < EVERY.send_order(shard=0, row=0, work=1000, held=1)
    # A shard holding even one request ranks by work left across shards: the lighter, lower shard does not go
    # first. (Before, a shard holding fewer than its share of the queue went first in plan order: with a share
    # of 2, shard 0's light step went ahead of shard 3's heavy one here.)
    assert EVERY.send_order(shard=3, row=0, work=900, held=1) < EVERY.send_order(shard=0, row=0, work=100, held=1)
    assert EVERY.send_order(3, 0, 900, 4) < EVERY.send_order(0, 0, 100, 1)
    # Shards holding nothing go in plan order, then most work; equal work goes in plan order.
    assert EVERY.send_order(0, 7, 1, 0) < EVERY.send_order(1, 0, 900, 0)
    assert EVERY.send_order(0, 7, 50, 0) < EVERY.send_order(0, 2, 10, 0)
    assert EVERY.send_order(1, 2, 50, 3) < EVERY.send_order(1, 5, 50, 3) < EVERY.send_order(2, 0, 50, 3)


def test_a_last_step_is_planning_s_render_and_its_line_is_the_server_s_result_as_is(tmp_path: Path) -> None:
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    spec = RunSpec(model_path="unused", turns="last")
    prompt = _prompt(3)
    conv = Conversation(prompt, 1, "key")
    prepare = preparer_for(spec, chat)
    prompts_path = tmp_path / "shard-00000.prompts.jsonl"
    prompts_path.write_text(_prompt(1).to_json() + "\n" + prompt.to_json() + "\n")
    req = LAST.steps(spec, chat, prompts_path).first(conv)  # no render cache: rendered here
    assert (req.step, req.prompt_ids, req.messages) == (0, prepare(prompt.messages), prompt.messages)
    cached = array("i", [7, 8, 9])
    write_rendered(prompts_path, sha256_file(prompts_path), prepare.render_key, [array("i", [1]), cached])
    steps = LAST.steps(spec, chat, prompts_path)
    assert steps.first(conv).prompt_ids == list(cached)  # planning's render of the row, not a second one
    result = GenerateResult([1, 2], "x", "stop", {"type": "stop"}, 3, 2, 0.5, "rid", "s")
    c = completion_record(prompt, LAST.step_key("key", 0), 3, result, conv.row)
    ended = steps.after(conv, req, c)
    assert isinstance(ended, Ended)  # one step: nothing follows
    assert steps.record(c, req, ended).to_json() == c.to_json()  # no step fields, no outcome: the line as before
    assert LAST.reject_detail(conv, 0, "too long") == "too long"
    assert EVERY.reject_detail(conv, 2, "too long") == "conversation p3, step 2: too long"


@pytest.mark.parametrize("mode", [LAST, EVERY], ids=["last", "every"])
def test_a_conversation_s_work_left_ranks_it(mode: Any) -> None:
    conv = Conversation(_prompt(3), 0, "k", (10.0,) * mode.expected_steps(_prompt(3)))
    assert conv.work_left(0) == 10.0 * mode.expected_steps(_prompt(3))
    assert conv.work_left(5) == 0.0  # past the recording's steps: none counted
    # Each step its own expected length: the work left is those from the step at hand on, summed.
    tools = Conversation(_prompt(3), 0, "k", (20.0, 300.0, 100.0))
    assert (tools.work_left(0), tools.work_left(1), tools.work_left(2)) == (420.0, 400.0, 100.0)
    assert tools.work_left(3) == 0.0  # the answer after the last recorded tool results: it ends the conversation


def test_a_step_past_the_recording_ranks_after_every_conversation_with_work_left() -> None:
    # Plan row 0's conversation is at the answer its recording lacks (step 1 of 1 expected); row 1 has not opened
    # and expects one step of the same length. The one that may still run long goes first, whatever the rows.
    past = Conversation(_prompt(1), 0, "a", (50.0,))
    unopened = Conversation(_prompt(1), 1, "b", (50.0,))
    assert _ShardDriver._rank(unopened, 0) < _ShardDriver._rank(past, 1)


@pytest.mark.parametrize("expected", [(1.0,), (1.0, 1.0, 1.0), (283.0, 209.0, 271.0), (5.0, 0.5)])
def test_the_driver_ranks_by_the_work_the_chain_bound_simulates(expected: tuple[float, ...]) -> None:
    # The benchmark measures the driver against the bound of its own policy, and the pilot projects a run with it:
    # both must rank every step, those past the recording's included, as the driver does.
    conv = Conversation(_prompt(1), 0, "k", expected)
    chain = Chain(tuple(range(1, len(expected) + 3)), turns=1, expected=expected)
    for step in range(len(expected) + 2):
        assert conv.work_left(step) == chain.expected_left(step)


def test_what_else_differs_by_mode_is_the_mode_s_answer(tmp_path: Path) -> None:
    # What the flows, identity and the exchange used to branch on: the same strings and counts as before.
    assert (LAST.progress_label, EVERY.progress_label) == ("prompts with a result", "conversations finished")
    assert (LAST.cache_tag, EVERY.cache_tag) == ("", "-turns-every")
    assert (LAST.merge_unit, EVERY.merge_unit) == ("request", "conversation")
    completions, rejects = tmp_path / "c.jsonl", tmp_path / "r.jsonl"
    completions.write_text(
        '{"request_key": "k:step-0", "completion_tokens": 5}\n'
        '{"request_key": "k:step-1", "completion_tokens": 7, "outcome": "complete"}\n'
    )
    rejects.write_text('{"request_key": "j:step-0", "reason": "prompt_too_long"}\n')
    # `last`: a prompt is one line, no live step counts and no manifest block.
    assert LAST.step_tail([completions], [rejects], 3) is None
    assert LAST.conversation_counts([completions], [rejects], 3) is None
    counts = EVERY.conversation_counts([completions], [rejects], 3)
    assert counts is not None and counts.summary() == {
        "conversations_planned": 3,
        "conversations_finished": 2,
        "steps": 2,
        "user_turns": 2,
        "conversations_by_outcome": {"complete": 1, "prompt_too_long": 1},
    }


def test_each_mode_gives_the_prompt_identity_its_renders() -> None:
    chat = ChatTokenizer.shared(ensure_model_dir())
    spec = RunSpec(model_path="unused", context_length=16384, max_prompt_tokens=1000)
    whole, first = EVERY.identity_preparers(spec, chat)
    assert first == preparer_for(spec, chat) and whole.token_limit == 16384
    assert "turns: every" in whole.limit_note
    assert LAST.identity_preparers(spec, chat) == (preparer_for(spec, chat), None)
