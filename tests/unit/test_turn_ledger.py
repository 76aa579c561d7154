"""The shard ledger of conversations (datagen/conversation/ledger.read_ledger): which conversations a checkpoint
settles, and which checkpoints this shard cannot have written."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from datagen.chat import ChatTokenizer
from datagen.checkpoint import CheckpointError
from datagen.conversation.ledger import read_ledger
from datagen.conversation.turn_mode import LastTurn
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.endpoints import ServerEndpoint
from datagen.identity import RequestKeys
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Reject
from datagen.runspec import RunSpec
from tasks.generation import generate_shard, unsettled_requests
from tests.turn_fixtures import three_turn_tool_conversation
from tests.unit.test_regeneration import _recorded

KEYS = {"ka", "kb", "kc", "kd"}


def _step(key: str, n: int, outcome: str | None = None, turn: int = 0) -> str:
    c = Completion("p-" + key, "s", 0, [], f"{key}:step-{n}", 3, [1], "x", "stop", 1, step=n, turn_index=turn)
    c.outcome = outcome
    return c.to_json() + "\n"


def _reject(key: str, n: int) -> str:
    return Reject(
        "generate", "server_rejected", "d", "s", prompt_id="p-" + key, request_key=f"{key}:step-{n}"
    ).to_json()


def _line(key: str) -> str:
    """A `last` mode line: the conversation's request key, no step fields."""
    return Completion("p-" + key, "s", 0, [], key, 3, [1], "x", "stop", 1).to_json() + "\n"


def _last_reject(key: str) -> str:
    return Reject("generate", "server_rejected", "d", "s", prompt_id="p-" + key, request_key=key).to_json()


def _files(tmp_path: Path, completions: list[str], rejects: list[str]) -> tuple[Path, Path]:
    comp, rej = tmp_path / "c.jsonl", tmp_path / "r.jsonl"
    comp.write_text("".join(completions))
    rej.write_text("".join(r + "\n" for r in rejects))
    return comp, rej


def test_settled_conversations_and_where_the_others_resume(tmp_path: Path) -> None:
    # a: ended on step 1; b: step 0 written, step 1 refused by the server; c: two steps, not ended; d: nothing.
    completions = [_step("ka", 0), _step("kc", 0), _step("kb", 0), _step("ka", 1, "complete", 1), _step("kc", 1)]
    # A torn last line (a crash mid-write) is not a step.
    comp, rej = _files(tmp_path, [*completions, _step("kc", 2)[:30]], [_reject("kb", 1)])
    ledgers = read_ledger(comp, rej, KEYS)
    assert {k: (len(v.lines), v.settled) for k, v in ledgers.items()} == {
        "ka": (2, True),
        "kb": (1, True),
        "kc": (2, False),
    }
    assert [turn for _, turn, _, _ in ledgers["ka"].lines] == [0, 1]
    # The offsets point at each line, so a resume reads only the lines it needs.
    _, _, offset, length = ledgers["kc"].lines[1]
    assert comp.read_bytes()[offset : offset + length].decode() == _step("kc", 1)


@pytest.mark.parametrize(
    ("completions", "rejects", "message"),
    [
        ([_step("ka", 0), _step("ka", 0)], [], "step 0 of conversation p-ka after 1 step lines"),
        ([_step("ka", 1)], [], "step 1 of conversation p-ka after 0 step lines"),
        ([_step("ka", 0, "complete"), _step("ka", 1)], [], "after 1 step lines and its outcome"),
        ([_step("ka", 0)], [_reject("ka", 0)], "a reject of step 0 of conversation p-ka, which has 1 step lines"),
        ([_step("ka", 0, "truncated")], [_reject("ka", 1)], "which has 1 step lines, an outcome"),
        ([], [_reject("ka", 0), _reject("ka", 0)], "and another reject"),
        ([_step("other", 0)], [], "1 lines that are no step of a conversation of this shard"),
        ([_step("ka", 0).replace("ka:step-0", "ka")], [], "1 lines that are no step"),  # a `last` mode key
    ],
)
def test_a_checkpoint_this_shard_did_not_write_is_refused(
    tmp_path: Path, completions: list[str], rejects: list[str], message: str
) -> None:
    comp, rej = _files(tmp_path, completions, rejects)
    with pytest.raises(CheckpointError, match=message):
        read_ledger(comp, rej, KEYS)


def test_a_last_line_settles_its_conversation_of_one_step(tmp_path: Path) -> None:
    comp, rej = _files(tmp_path, [_line("ka"), _line("kc"), _line("kb")[:30]], [_last_reject("kb")])
    ledgers = read_ledger(comp, rej, KEYS, LastTurn())
    assert {k: (len(v.lines), v.settled) for k, v in ledgers.items()} == {
        "ka": (1, True),
        "kb": (0, True),
        "kc": (1, True),
    }


@pytest.mark.parametrize(
    ("completions", "rejects", "message"),
    [
        ([_line("ka"), _line("ka")], [], "step 0 of conversation p-ka after 1 step lines and its outcome"),
        (
            [_line("ka")],
            [_last_reject("ka")],
            "a reject of step 0 of conversation p-ka, .* both completed and rejected",
        ),
        ([], [_last_reject("ka"), _last_reject("ka")], "and another reject"),
        ([_line("other")], [], "1 lines that are no step of a conversation of this shard"),
        ([_step("ka", 0)], [], "1 lines that are no step"),  # an every-turn step in a `last` shard
    ],
)
def test_a_last_checkpoint_this_shard_did_not_write_is_refused(
    tmp_path: Path, completions: list[str], rejects: list[str], message: str
) -> None:
    comp, rej = _files(tmp_path, completions, rejects)
    with pytest.raises(CheckpointError, match=message):
        read_ledger(comp, rej, KEYS, LastTurn())


def test_a_conversation_that_can_no_longer_continue_is_settled_by_a_reject_on_resume(tmp_path: Path) -> None:
    """A rerun under a smaller prompt budget: the written steps stay, the next one is a `context_exceeded` reject.

    Resuming rebuilds the last step's request from its lines (its ids must add up to what was sent), then decides
    what follows exactly as the live run does; nothing is sent.
    """
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    built = three_turn_tool_conversation(chat)
    prompt = _recorded(built)
    layout = RunLayout(tmp_path)
    layout.shards_dir.mkdir(parents=True)
    layout.shard_prompts(0).write_text(prompt.to_json() + "\n")
    # Step 1 opens user turn 1 (a fresh render); step 2 would continue it after the tool result.
    first_of_turn = built.steps[1].prompt_tokens
    spec = RunSpec(model_path="unused", max_prompt_tokens=first_of_turn + 5, turns="every")
    key = RequestKeys(spec.sampling, chat)(prompt.prompt_id)
    lines = [replace(c, request_key=f"{key}:step-{c.step}") for c in built.steps[:2]]
    layout.shard_completions(0).write_text("".join(c.to_json() + "\n" for c in lines))
    assert unsettled_requests(0, layout, chat, spec) == 1
    dispatcher = Dispatcher([ServerEndpoint("nowhere", "http://127.0.0.1:9")], probe_interval_s=60)
    try:
        result = generate_shard(0, layout, dispatcher, chat, spec)
    finally:
        dispatcher.close()
    assert (result.n_prompts, result.n_completed, result.n_rejected, result.n_sent) == (1, 2, 1, 0)
    (reject,) = [Reject.from_json(line) for line in layout.shard_rejects(0).read_text().splitlines()]
    assert (reject.reason, reject.request_key) == ("context_exceeded", f"{key}:step-2")
    assert "decided when resuming" in reject.detail
    assert unsettled_requests(0, layout, chat, spec) == 0
