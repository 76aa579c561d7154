"""The every-turn state machine (datagen/conversation/regeneration.py) against the fixture model's real chat template.

The lines it makes for a scripted conversation must be the ones `tests/turn_fixtures.build_conversation` writes
for the same model outputs (the contract everything after generation reads), and each way a conversation ends
must carry its named outcome on the step it ends with.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.conversation.regeneration import (
    COMPLETE,
    CONTEXT_EXCEEDED,
    RENDER_MISMATCH,
    TOOL_CALL_DIVERGENCE,
    TOOL_CALL_MISSING,
    TRUNCATED,
    UNEXPECTED_TOOL_CALL,
    Ended,
    Regenerator,
    Script,
    StepRequest,
    step_record,
)
from datagen.conversation.toolcalls import answer_text, parse_tool_calls
from datagen.conversation.turn_mode import step_check
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Message, Prompt, TokenRow
from datagen.runspec import RunSpec
from datagen.sources.preparation import Preparer, Unsendable
from tests.turn_fixtures import (
    WEATHER_TOOLS,
    Built,
    Step,
    _model_text,
    check_segment_rows,
    stage_steps,
    three_turn_tool_conversation,
)

SYSTEM = Message(role="system", content="You are a helpful assistant.")
WEATHER = ("get_weather", {"city": "Paris", "days": 2})
RESULT = '{"forecast": ["rain, 11C", "cloudy, 13C"]}'


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(ensure_model_dir())


@pytest.fixture(scope="module")
def regen(chat: ChatTokenizer) -> Regenerator:
    """The engine's state machine with the run's per-step check (validation's per-sample checks)."""
    return Regenerator(Preparer(chat, True, 8192), step_check(RunSpec(model_path="unused"), chat))


def _recorded(built: Built) -> Prompt:
    """The row behind a built conversation as the loader gives it: every turn up to the last user turn, the
    recorded assistant content written by another model (the engine must not use it)."""
    messages: list[Message] = []
    for m in built.segment_messages[-1][:-1]:  # the trailing assistant reply is dropped at load
        if m["role"] == "assistant":
            m = {**m, "content": "An answer another model wrote.", "reasoning_content": "Its reasoning."}
        messages.append(Message.from_dict(m))
    return Prompt("conv-tools", "conversations.jsonl", 0, messages, tools=built.tools)


def _completion(chat: ChatTokenizer, step: Step, tools: list[dict[str, Any]] | None = WEATHER_TOOLS) -> Completion:
    """What the engine records for a model output: ids, text, finish and the calls parsed from its answer."""
    text = _model_text(step)
    ids = chat.encode(text) + ([IM_END_ID] if step.finish_reason == "stop" else [])
    calls = parse_tool_calls(answer_text(text), tools) if tools else []
    return Completion(
        "p", "s", 0, [], "k", 0, ids, text, step.finish_reason, len(ids), tools=tools, tool_calls=calls or None
    )


def _drive(regen: Regenerator, prompt: Prompt, outputs: list[Completion]) -> list[Completion]:
    """The step lines the engine writes for these model outputs, in order, until the conversation ends."""
    script = Script.of(prompt)
    req: StepRequest | Ended = regen.first(script)
    lines = []
    for c in outputs:
        assert isinstance(req, StepRequest), f"the conversation ended before output {len(lines)}"
        nxt = regen.after(script, req, c)
        lines.append(step_record(c, req, nxt if isinstance(nxt, Ended) else None))
        req = nxt
    assert isinstance(req, Ended), "the conversation did not end with its last output"
    return lines


def _without_detail(c: Completion) -> str:
    meta = {k: v for k, v in c.meta.items() if k != "outcome_detail"}
    return replace(c, meta=meta).to_json()


def test_the_engines_lines_are_the_contracts_lines(chat: ChatTokenizer, regen: Regenerator, tmp_path: Path) -> None:
    """For the same model outputs the state machine writes build_conversation's lines, and they make exact rows."""
    built = three_turn_tool_conversation(chat)
    prompt = _recorded(built)
    # The engine's own completion of each output (its messages and step fields are the engine's to fill in).
    outputs = [
        replace(s, messages=prompt.messages, prompt_tokens=0, step=None, turn_index=None, bridge_ids=None, outcome=None)
        for s in built.steps
    ]
    lines = _drive(regen, prompt, outputs)
    assert [_without_detail(c) for c in lines] == [c.to_json() for c in built.steps]
    assert lines[-1].outcome == COMPLETE and lines[-1].meta["outcome_detail"] == "all 3 user turns answered"
    assert all("outcome_detail" not in c.meta for c in lines[:-1])
    # The prompt of every continuation is token-exact: what the template renders, as ids the server was sent.
    for c in lines:
        assert len(chat.encode(chat.render(c.messages, True, WEATHER_TOOLS))) == c.prompt_tokens
    staging, _ = stage_steps(chat, lines, tmp_path)
    table = pq.read_table(sorted((staging / "data").glob("*.parquet"))).to_pylist()
    check_segment_rows(chat, [TokenRow(**r) for r in table], built)


def test_resume_rebuilds_each_request_from_the_lines(chat: ChatTokenizer, regen: Regenerator) -> None:
    """From the lines written so far, the last step's request is the one the live run sent (ids included)."""
    built = three_turn_tool_conversation(chat)
    script = Script.of(_recorded(built))
    req: StepRequest | Ended = regen.first(script)
    for n, line in enumerate(built.steps):
        assert isinstance(req, StepRequest)
        rebuilt = regen.resume(script, built.steps[: n + 1])
        assert rebuilt == req
        req = regen.after(script, rebuilt, line)
    broken = [*built.steps[:2], replace(built.steps[2], prompt_tokens=built.steps[2].prompt_tokens + 1)]
    with pytest.raises(ValueError, match="step 2 of conversation conv-tools: its prompt rebuilt"):
        regen.resume(script, broken)


def test_the_script_keeps_queries_and_recorded_calls_not_content() -> None:
    """Head, user turns, recorded calls per step and the results after them; recorded content is not kept."""
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}}
    raw: list[dict[str, Any]] = [
        {"role": "system", "content": "Be brief."},
        {"role": "assistant", "content": "Hello! How can I help?"},  # a greeting before any query: left out
        {"role": "user", "content": "Weather in Rome?"},
        {"role": "user", "content": "And tomorrow?"},  # a query right after a query: the same turn
        {"role": "assistant", "content": "", "tool_calls": [call, call]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
        {"role": "assistant", "content": "Sunny today, rain tomorrow."},
        {"role": "user", "content": "Thanks. Lisbon?"},
        # Calls written in the content, results as <tool_response> user text (not a query, as the template says)
        {"role": "assistant", "content": "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"},
        {"role": "user", "content": "<tool_response>\nwindy\n</tool_response>"},
    ]
    script = Script.of(Prompt("p", "s", 0, [Message.from_dict(m) for m in raw], tools=WEATHER_TOOLS))
    assert [m.content for m in script.head] == ["Be brief."]
    assert [[m.content for m in t.opening] for t in script.turns] == [
        ["Weather in Rome?", "And tomorrow?"],
        ["Thanks. Lisbon?"],
    ]
    first, second = script.turns
    assert [(s.calls, [m.content for m in s.results]) for s in first.steps] == [
        (("get_weather", "get_weather"), ["sunny", "rain"]),
        ((), []),
    ]
    assert [(s.calls, [m.role for m in s.results]) for s in second.steps] == [(("get_weather",), ["user"])]
    only_results = Prompt("p", "s", 0, [Message(role="user", content="<tool_response>x</tool_response>")])
    with pytest.raises(Unsendable, match="no user query"):
        Script.of(only_results)


def _tool_turn_prompt(recorded: list[dict[str, Any]], follow_up: str | None = None) -> Prompt:
    """System, one user question and its recorded assistant steps (then, optionally, a second question)."""
    messages = [SYSTEM.to_dict(), {"role": "user", "content": "Will it rain in Paris in the next two days?"}]
    messages += recorded
    if follow_up is not None:
        messages += [{"role": "user", "content": follow_up}]
    return Prompt("p", "s", 0, [Message.from_dict(m) for m in messages], tools=WEATHER_TOOLS)


CALLED = [
    {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
    },
    {"role": "tool", "content": RESULT},
]
ANSWERED = [{"role": "assistant", "content": "Yes, take an umbrella."}]
THINK = "The user asks about rain in Paris, so I check the forecast for the next two days."


@pytest.mark.parametrize(
    ("recorded", "follow_up", "outputs", "outcome", "detail"),
    [
        pytest.param(
            CALLED, None, [Step(THINK, "", (WEATHER,)), Step(THINK, "Rain, 11C.")], COMPLETE, "", id="complete"
        ),
        pytest.param(
            CALLED, None, [Step(THINK + " And", "", finish_reason="length")], TRUNCATED, "finish length", id="truncated"
        ),
        pytest.param(
            CALLED,
            None,
            [Step(THINK, "", (("web_search", {"query": "rain"}),))],
            TOOL_CALL_DIVERGENCE,
            "called web_search, the recorded turn get_weather",
            id="other-function",
        ),
        pytest.param(
            CALLED,
            None,
            [Step(THINK, "", (WEATHER, WEATHER))],
            TOOL_CALL_DIVERGENCE,
            "called get_weather, get_weather, the recorded turn get_weather",
            id="other-count",
        ),
        pytest.param(
            CALLED,
            None,
            [Step(THINK, "It will rain.")],
            TOOL_CALL_MISSING,
            "answered in words, the recorded turn called get_weather",
            id="missing",
        ),
        pytest.param(
            ANSWERED,
            "Thanks!",
            [Step(THINK, "", (WEATHER,))],
            UNEXPECTED_TOOL_CALL,
            "where the recorded turn answered in words",
            id="called-where-recorded-answered",
        ),
        pytest.param(
            CALLED,
            None,
            [Step(THINK, "", (WEATHER,)), Step(THINK, "", (WEATHER,))],
            UNEXPECTED_TOOL_CALL,
            "where the recorded turn recorded no further step",
            id="no-results-remain",
        ),
        pytest.param(
            CALLED[:1],
            "Thanks!",
            [Step(THINK, "", (WEATHER,))],
            UNEXPECTED_TOOL_CALL,
            "no recorded results follow that call",
            id="call-without-results",
        ),
        pytest.param(
            CALLED,
            None,
            [Step(" " + THINK, "", (WEATHER,))],  # the template trims reasoning: its render drops the space
            RENDER_MISMATCH,
            "renders the history differently",
            id="render-mismatch",
        ),
    ],
)
def test_each_way_a_conversation_ends_is_named_on_its_last_step(
    chat: ChatTokenizer,
    regen: Regenerator,
    recorded: list[dict[str, Any]],
    follow_up: str | None,
    outputs: list[Step],
    outcome: str,
    detail: str,
) -> None:
    lines = _drive(regen, _tool_turn_prompt(recorded, follow_up), [_completion(chat, s) for s in outputs])
    assert [c.outcome for c in lines] == [None] * (len(lines) - 1) + [outcome]
    assert detail in lines[-1].meta["outcome_detail"]
    assert [c.step for c in lines] == list(range(len(lines)))


def test_a_step_failing_the_per_sample_checks_ends_the_conversation(chat: ChatTokenizer, regen: Regenerator) -> None:
    """A placeholder where the recorded turn called a tool: `rejected_placeholder` on it, nothing generated after.

    Validation would cut the conversation at that step anyway (tests/unit/test_turn_rows.py); the check comes
    before the tool-call comparison, so the reason is the placeholder, not the missing call.
    """
    built = three_turn_tool_conversation(chat)
    outputs = [*built.steps[:1], _completion(chat, Step("Ok.", "OK."))]
    lines = _drive(regen, _recorded(built), outputs)
    assert [c.outcome for c in lines] == [None, "rejected_placeholder"]
    assert lines[0].to_json() == built.steps[0].to_json()
    assert "reasoning and" in lines[1].meta["outcome_detail"] and lines[1].turn_index == 1


def test_context_exceeded_is_decided_before_the_step_is_written(chat: ChatTokenizer) -> None:
    """The next request would not fit: the step that was generated carries `context_exceeded` (both ways on)."""
    prompt = _tool_turn_prompt(CALLED, "Now write me a long packing list. " * 40)
    first = Regenerator(Preparer(chat, True, 8192)).first(Script.of(prompt))
    call, answer = _completion(chat, Step(THINK, "", (WEATHER,))), _completion(chat, Step(THINK, "Rain."))
    # Within the user turn: the continuation (prompt + output + bridge) is over the limit.
    tight = Regenerator(Preparer(chat, True, len(first.prompt_ids) + len(call.output_ids) + 5, "(tight)"))
    lines = _drive(tight, prompt, [call])
    assert lines[-1].outcome == CONTEXT_EXCEEDED and "limit is" in lines[-1].meta["outcome_detail"]
    # Across user turns: the next question's fresh render is over the limit.
    roomy = Regenerator(Preparer(chat, True, len(first.prompt_ids) + 200))
    lines = _drive(roomy, prompt, [call, answer])
    assert [c.outcome for c in lines] == [None, CONTEXT_EXCEEDED]
    assert lines[-1].meta["outcome_detail"].startswith("user turn 1: prompt has ")


def test_tool_response_text_results_continue_token_exact(chat: ChatTokenizer, regen: Regenerator) -> None:
    """Results recorded as `<tool_response>` user text are spliced as they are; the turn continues token-exact."""
    recorded = [
        {"role": "assistant", "content": "<tool_call>\n<function=get_weather>\n</function>\n</tool_call>"},
        {"role": "user", "content": f"<tool_response>\n{RESULT}\n</tool_response>"},
    ]
    lines = _drive(
        regen,
        _tool_turn_prompt(recorded),
        [_completion(chat, Step(THINK, "", (WEATHER,))), _completion(chat, Step(THINK, "Rain, 11C."))],
    )
    assert [c.outcome for c in lines] == [None, COMPLETE] and lines[1].bridge_ids
    assert lines[1].messages[-1].role == "user" and lines[1].turn_index == 0
    sent = chat.encode(chat.render(lines[0].messages, True, WEATHER_TOOLS)) + lines[0].output_ids + lines[1].bridge_ids
    assert sent == chat.encode(chat.render(lines[1].messages, True, WEATHER_TOOLS))
    assert len(sent) == lines[1].prompt_tokens


def test_thinking_off_continues_token_exact(chat: ChatTokenizer) -> None:
    """Thinking off: the generation prompt holds the empty think block, the output is the answer alone."""
    regen = Regenerator(Preparer(chat, False, 8192))
    call = "<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n</tool_call>"
    outputs = []
    for text in (call, "Rain in Paris tomorrow."):
        ids = [*chat.encode(text), IM_END_ID]
        calls = parse_tool_calls(text, WEATHER_TOOLS) or None
        outputs.append(
            Completion("p", "s", 0, [], "k", 0, ids, text, "stop", len(ids), tools=WEATHER_TOOLS, tool_calls=calls)
        )
    lines = _drive(regen, _tool_turn_prompt(CALLED), outputs)
    assert [c.outcome for c in lines] == [None, COMPLETE] and lines[1].bridge_ids
    sent = chat.encode(chat.render(lines[0].messages, False, WEATHER_TOOLS)) + lines[0].output_ids + lines[1].bridge_ids
    assert (
        sent == chat.encode(chat.render(lines[1].messages, False, WEATHER_TOOLS))
        and len(sent) == lines[1].prompt_tokens
    )
