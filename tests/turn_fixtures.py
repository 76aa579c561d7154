"""Every-turn checkpoint lines of real regenerated conversations, built with the fixture model's chat template.

`build_conversation` plays the engine's part of the contract (docs/conversations.md, "Every turn"): each step's
prompt is the template's render of the regenerated history, its output ids the encoding of a model-style answer
(reasoning, `</think>`, answer, tool calls in Qwen3.6's format, `<|im_end|>`), the assistant turn split from it as
`datagen.conversation.export.assistant_turn` splits it, the recorded tool results spliced after a calling step
and the next step's `bridge_ids` the template's text between. It also keeps, independently of that split, the
clean regenerated conversation (`Built.segment_messages`): what `apply_chat_template` is given in the exactness
test. The same assertions then run on the engine's real lines (`check_segment_rows`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.conversation.export import assistant_turn
from datagen.conversation.regeneration import is_query
from datagen.conversation.toolcalls import parse_tool_calls
from datagen.conversation.turn_mode import EveryTurn
from datagen.records import Completion, Message, TokenRow
from datagen.runspec import SamplingSpec, ValidationSpec
from tasks.tokenization import TokenizationSummary, tokenize_accepted
from tasks.validation import validate_shards

__all__ = [
    "WEATHER_TOOLS",
    "Built",
    "Step",
    "Turn",
    "build_conversation",
    "check_published_rows",
    "check_segment_rows",
    "published_segment",
    "stage_steps",
    "template_ids",
    "three_turn_tool_conversation",
]

WEATHER_TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                "required": ["city"],
            },
        },
    }
]


@dataclass(frozen=True)
class Step:
    """One generation the model makes: its reasoning, its answer, the calls it writes and the recorded results."""

    reasoning: str
    answer: str
    calls: tuple[tuple[str, dict[str, Any]], ...] = ()
    results: tuple[str, ...] = ()  # the dataset's recorded tool results, spliced after this step
    finish_reason: str = "stop"  # "length": output cut at the token limit (no <|im_end|>)


@dataclass(frozen=True)
class Turn:
    """One user turn and the steps that answer it."""

    user: str
    steps: tuple[Step, ...]


@dataclass
class Built:
    """A built conversation: its checkpoint lines and, per user turn, the clean conversation up to its end."""

    steps: list[Completion]
    segment_messages: list[list[dict[str, Any]]] = field(default_factory=list)
    tools: list[dict[str, Any]] | None = None


def _model_text(step: Step) -> str:
    """What Qwen3.6 writes after the generation prompt `<|im_start|>assistant\\n<think>\\n` (canonical spacing)."""
    calls = "\n".join(
        "<tool_call>\n<function="
        + name
        + ">\n"
        + "".join(
            f"<parameter={k}>\n{v if isinstance(v, str) else json.dumps(v)}\n</parameter>\n" for k, v in args.items()
        )
        + "</function>\n</tool_call>"
        for name, args in step.calls
    )
    answer = step.answer + ("\n\n" if step.answer and calls else "") + calls
    return f"{step.reasoning}\n</think>\n\n{answer}"


def _clean_assistant(step: Step) -> dict[str, Any]:
    """The assistant turn as a person would write it for apply_chat_template (not via our splitter)."""
    out: dict[str, Any] = {"role": "assistant", "content": step.answer, "reasoning_content": step.reasoning}
    if step.calls:
        out["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": a}} for n, a in step.calls]
    return out


def build_conversation(
    chat: ChatTokenizer,
    turns: list[Turn],
    *,
    prompt_id: str = "conv-0",
    system: str | None = "You are a helpful assistant.",
    tools: list[dict[str, Any]] | None = None,
    source: str = "conversations.jsonl",
    row: int = 0,
    plan_index: int = 0,
    outcome: str = "complete",
) -> Built:
    """The checkpoint lines of one conversation, step by step, as the every-turn engine writes them."""
    history: list[Message] = [Message(role="system", content=system)] if system else []
    clean: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    built = Built(steps=[], tools=tools)
    step_no = 0
    for k, turn in enumerate(turns):
        history.append(Message(role="user", content=turn.user))
        clean.append({"role": "user", "content": turn.user})
        prompt_text = chat.render(history, True, tools)
        prompt_ids = chat.encode(prompt_text)
        bridge: list[int] | None = None
        for j, step in enumerate(turn.steps):
            text = _model_text(step)
            output_ids = chat.encode(text) + ([IM_END_ID] if step.finish_reason == "stop" else [])
            calls = parse_tool_calls(text.rsplit("</think>", 1)[-1], tools) if tools else []
            c = Completion(
                prompt_id=prompt_id,
                source=source,
                row=row,
                messages=list(history),
                request_key=f"rk-{prompt_id}:step-{step_no}",
                prompt_tokens=len(prompt_ids),
                output_ids=output_ids,
                text=text,
                finish_reason=step.finish_reason,
                completion_tokens=len(output_ids),
                meta={"plan_index": plan_index},
                tools=tools,
                tool_calls=calls or None,
                step=step_no,
                turn_index=k,
                bridge_ids=bridge,
            )
            built.steps.append(c)
            step_no += 1
            history.append(assistant_turn(c, True))
            clean.append(_clean_assistant(step))
            if j + 1 == len(turn.steps):
                break
            calls_made = history[-1].tool_calls or ()
            for i, result in enumerate(step.results):
                # The engine pairs each spliced result with the call it answers (datagen.conversation.regeneration).
                answers = calls_made[i].id if len(calls_made) == len(step.results) else None
                history.append(Message(role="tool", content=result, tool_call_id=answers))
                clean.append({"role": "tool", "content": result})
            # The continuation's prompt: the template's render of the longer history must extend what was sent
            # plus what was generated; the ids between are the bridge.
            sent = prompt_text + chat.decode(output_ids)
            next_text = chat.render(history, True, tools)
            assert next_text.startswith(sent), (sent[-200:], next_text[len(sent) - 200 :])
            bridge = chat.encode(next_text[len(sent) :])
            prompt_ids = prompt_ids + output_ids + bridge
            prompt_text = next_text
            assert len(chat.encode(next_text)) == len(prompt_ids)
        built.segment_messages.append([dict(m) for m in clean])
    built.steps[-1].outcome = outcome
    return built


def three_turn_tool_conversation(chat: ChatTokenizer, prompt_id: str = "conv-tools", plan_index: int = 0) -> Built:
    """Three user turns: a plain answer, a turn that calls a tool twice before answering, and a last answer."""
    turns = [
        Turn(
            "I am planning a weekend trip to Paris. What should I pack for early spring?",
            (
                Step(
                    "The user asks about packing for Paris in early spring, so I will cover layers and rain.",
                    "Pack layers: a light sweater, a waterproof jacket, comfortable walking shoes and an umbrella.",
                ),
            ),
        ),
        Turn(
            "Can you check the weather there for the next two days?",
            (
                Step(
                    "I need the forecast for Paris, so I should call the weather function with two days.",
                    "Let me look up the forecast.",
                    calls=(("get_weather", {"city": "Paris", "days": 2}),),
                    results=('{"forecast": ["rain, 11C", "cloudy, 13C"]}',),
                ),
                Step(
                    "The forecast came back; I should also check Lyon in case they take a day trip there.",
                    "",
                    calls=(("get_weather", {"city": "Lyon", "days": 1}),),
                    results=('{"forecast": ["sunny, 15C"]}',),
                ),
                Step(
                    "Paris will be rainy and cool, Lyon sunny; I will summarize both for the traveller.",
                    "Paris: rain at 11C tomorrow, cloudy at 13C the day after. Lyon is sunny at 15C.",
                ),
            ),
        ),
        Turn(
            "Great, then which museum would you visit on the rainy day?",
            (
                Step(
                    "A rainy day suits a large indoor museum; the Louvre or the Musee d'Orsay are good picks.",
                    "On the rainy day I would visit the Musee d'Orsay: it is large, indoors and less crowded.",
                ),
            ),
        ),
    ]
    return build_conversation(chat, turns, prompt_id=prompt_id, tools=WEATHER_TOOLS, plan_index=plan_index)


def template_ids(
    chat: ChatTokenizer,
    messages: list[dict[str, Any]],
    tools: list[dict[str, Any]] | None,
    add_generation_prompt: bool = False,
) -> list[int]:
    """`apply_chat_template(messages, tools=..., tokenize=True)` of the real template (thinking on)."""
    extra: dict[str, Any] = {"tools": tools} if tools else {}
    out = chat._hf.apply_chat_template(
        messages, tokenize=True, enable_thinking=True, add_generation_prompt=add_generation_prompt, **extra
    )
    ids = out["input_ids"] if not isinstance(out, list) else out
    return list(ids)


def check_segment_rows(chat: ChatTokenizer, rows: list[TokenRow], built: Built) -> None:
    """Every segment row equals the template's tokenization of the conversation up to the segment's end.

    The one documented difference: the template closes the last turn with `<|im_end|>\\n`, the model stops at
    `<|im_end|>`. The loss mask is 1 exactly on the assistant-generated spans: each step's output ids.
    """
    assert [r.turn_index for r in rows] == list(range(len(rows)))
    for row in rows:
        k = row.turn_index
        expected = template_ids(chat, built.segment_messages[k], built.tools)
        newline = chat.encode("\n")
        assert expected[-1:] == newline and row.input_ids == expected[:-1], f"segment {k} differs from the template"
        steps = [s for s in built.steps if s.turn_index == k]
        mask = [0] * len(row.input_ids)
        for s in steps:
            start = len(chat.encode(chat.render(s.messages, True, built.tools)))
            mask[start : start + len(s.output_ids)] = [1] * len(s.output_ids)
            assert row.input_ids[start : start + len(s.output_ids)] == s.output_ids
        assert row.loss_mask == mask, f"segment {k}: loss mask is not exactly the generated spans"
        assert row.num_loss_spans == len(steps) and row.span_finish_reasons == [s.finish_reason for s in steps]
        assert row.conversation_id == built.steps[0].prompt_id


def _is_query(m: dict[str, Any]) -> bool:
    """A user message the template counts as a query (not `<tool_response>` text): where a segment starts."""
    return is_query(Message.from_dict(m))


def published_segment(
    line: dict[str, Any], turn_index: int
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """A published conversations/*.jsonl line cut at the end of user turn `turn_index`'s segment, as the template
    takes it: (messages, tools), with the JSON text of `tools` and of each call's arguments parsed back (the line
    keeps them as text for Arrow, docs/conversations.md) and the line's own keys (`outcome`) left out."""
    messages: list[dict[str, Any]] = []
    users = 0
    for m in line["conversations"]:
        if _is_query(m):
            if users == turn_index + 1:
                break
            users += 1
        m = dict(m)
        if "tool_calls" in m:
            m["tool_calls"] = [
                {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]
            ]
        messages.append(m)
    assert users == turn_index + 1, f"{line['id']}: no user turn {turn_index}"
    tools = json.loads(line["tools"]) if "tools" in line else None
    return messages, tools


def check_published_rows(chat: ChatTokenizer, line: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """A published conversation and its token rows (parquet dicts, in turn order), from published data alone.

    One row per user turn of the line; each equals `apply_chat_template` of the line cut at its segment's end
    (tools included) except the closing `"\n"`, and its loss mask is 1 exactly on the segment's assistant turns:
    from the end of the generation prompt the template writes before each to its `<|im_end|>`.
    """
    n_users = sum(_is_query(m) for m in line["conversations"])
    assert [r["turn_index"] for r in rows] == list(range(n_users)), f"{line['id']}: not one row per user turn"
    newline = chat.encode("\n")
    for row in rows:
        k = row["turn_index"]
        messages, tools = published_segment(line, k)
        expected = template_ids(chat, messages, tools)
        assert expected[-1:] == newline and row["input_ids"] == expected[:-1], f"{line['id']} segment {k}"
        query = max(i for i, m in enumerate(messages) if _is_query(m))
        mask = [0] * len(row["input_ids"])
        spans = 0
        for j in range(query + 1, len(messages)):
            if messages[j]["role"] != "assistant":
                continue
            start = len(template_ids(chat, messages[:j], tools, add_generation_prompt=True))
            end = len(template_ids(chat, messages[: j + 1], tools)) - 1  # through <|im_end|>, not the "\n"
            assert row["input_ids"][end - 1] == IM_END_ID
            mask[start:end] = [1] * (end - start)
            spans += 1
        assert row["loss_mask"] == mask, f"{line['id']} segment {k}: loss mask is not exactly the generated spans"
        assert row["num_loss_spans"] == spans == len(row["span_finish_reasons"])
        assert row["conversation_id"] == line["id"]


def stage_steps(
    chat: ChatTokenizer, steps: list[Completion], work: Path, spec: ValidationSpec | None = None
) -> tuple[Path, TokenizationSummary]:
    """Validate and tokenize one shard of step lines as a run does; return the staging dir (with its card)."""
    from datagen.publishing.dataset_card import Lineage, write_dataset_card

    shard = work / "shard-00000.completions.jsonl"
    shard.write_text("".join(c.to_json() + "\n" for c in steps), encoding="utf-8")
    summary = validate_shards([shard], work / "validated", spec or ValidationSpec(), True, turns=EveryTurn())
    staging = work / "staging"
    tokenized = tokenize_accepted(
        [Path(p) for p in summary.accepted_paths],
        staging,
        chat,
        True,
        extra_reject_paths=summary.reject_paths,
        turns=EveryTurn(),
    )
    lineage = Lineage(model_fingerprint=chat.fingerprint, template_hash=chat.template_hash)
    write_dataset_card(
        staging, namespace=work.name, model="fixture", sampling=SamplingSpec(), lineage=lineage, sizes=tokenized.sizes()
    )
    return staging, tokenized
