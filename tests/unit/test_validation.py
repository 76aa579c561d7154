"""Per-sample validation: one crafted completion per reject reason, and the shard-level stage body."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from datagen.chat import IM_END_ID, THINK_END_ID, ChatTokenizer
from datagen.checks.quality import (
    VALIDATION_REASONS,
    DuplicateIndex,
    check_completion,
    find_loops,
    render_validation_report,
    repeated_ngram_share,
)
from datagen.conversation.turn_mode import LastTurn
from datagen.identity import prompt_id_from_messages
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Reject
from datagen.runspec import ValidationSpec
from tasks.validation import SUMMARY_NAME, validate_shards

SPEC = ValidationSpec()
REASONING = "The user wants a short explanation of photosynthesis, so I will describe light and sugar."
ANSWER = "Photosynthesis turns light, water and carbon dioxide into sugar and oxygen inside chloroplasts."


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(ensure_model_dir())


def make(
    chat: ChatTokenizer,
    text: str,
    *,
    thinking: bool = True,
    finish: str = "stop",
    question: str = "Explain photosynthesis.",
    source: str = "src",
    category: str | None = None,
    request_key: str | None = None,
) -> Completion:
    """A completion as the server would return it: canonical ids of `text`, plus EOS when it stopped."""
    messages = [{"role": "user", "content": question}]
    ids = chat.encode(text) + ([IM_END_ID] if finish == "stop" else [])
    pid = prompt_id_from_messages(source, messages)
    return Completion(
        prompt_id=pid,
        source=source,
        row=0,
        messages=messages,
        request_key=request_key or f"rk-{pid}",
        prompt_tokens=len(chat.prompt_ids(messages, thinking)),
        output_ids=ids,
        text=text,
        finish_reason=finish,
        completion_tokens=len(ids),
        category=category,
    )


def thinking_text(reasoning: str = REASONING, answer: str = ANSWER) -> str:
    return f"{reasoning}\n</think>\n\n{answer}"


def test_good_thinking_completion_is_accepted_and_counts_answer_tokens(chat: ChatTokenizer) -> None:
    c = make(chat, thinking_text())
    assert THINK_END_ID in c.output_ids
    v = check_completion(c, SPEC, enable_thinking=True)
    assert v.accepted, v.detail
    assert v.answer_tokens == len(chat.encode(ANSWER))


def test_good_thinking_off_completion_is_accepted(chat: ChatTokenizer) -> None:
    v = check_completion(make(chat, ANSWER, thinking=False), SPEC, enable_thinking=False)
    assert v.accepted, v.detail


def _invalid_utf8_completion(chat: ChatTokenizer) -> Completion:
    # A CJK character spans several byte-level tokens; its first token alone is an incomplete UTF-8 sequence.
    ids = chat.encode("龘")
    assert len(ids) > 1
    c = make(chat, thinking_text())
    c.output_ids = chat.encode(REASONING + "\n</think>\n\n") + ids[:1] + chat.encode(ANSWER) + [IM_END_ID]
    c.completion_tokens = len(c.output_ids)
    c.text = chat.decode(c.output_ids[:-1])
    assert "\ufffd" in c.text
    return c


CASES: list[tuple[str, str, bool]] = [
    # (reason, how the completion is crafted, enable_thinking)
    ("empty_completion", "no_ids", True),
    ("token_count_mismatch", "bad_count", True),
    ("aborted", "abort", True),
    ("unknown_finish_reason", "weird_finish", True),
    ("truncated", "length", True),
    ("invalid_utf8", "utf8", True),
    ("unclosed_thinking", "no_think_end", True),
    ("malformed_thinking", "two_think_ends", True),
    ("malformed_thinking", "think_end_with_thinking_off", False),
    ("unclosed_thinking", "no_think_end", True),
    ("placeholder", "ok_without_think_end", True),
    ("empty_thinking", "empty_reasoning", True),
    ("empty_answer", "empty_answer", True),
    ("placeholder", "placeholder", True),
    ("placeholder", "placeholder", False),
    ("repeated_block", "loop", True),
    ("repeated_tail", "tail_loop_cut", True),
    ("repetition", "scattered_repeats", True),
]


def _craft(chat: ChatTokenizer, how: str, thinking: bool) -> Completion:
    if how == "no_ids":
        c = make(chat, "")
        c.output_ids, c.completion_tokens = [], 0
        return c
    if how == "bad_count":
        c = make(chat, thinking_text())
        c.completion_tokens += 5
        return c
    if how == "abort":
        return make(chat, REASONING, finish="abort")
    if how == "weird_finish":
        return make(chat, thinking_text(), finish="nan")
    if how == "length":
        return make(chat, REASONING, finish="length")
    if how == "utf8":
        return _invalid_utf8_completion(chat)
    if how == "no_think_end":
        return make(chat, REASONING + " " + ANSWER)
    if how == "two_think_ends":
        return make(chat, thinking_text(answer=f"{ANSWER}\n</think>\n\n{ANSWER}"))
    if how == "think_end_with_thinking_off":
        return make(chat, thinking_text(), thinking=False)
    if how == "empty_reasoning":
        return make(chat, thinking_text(reasoning="  "))
    if how == "empty_answer":
        return make(chat, thinking_text(answer=""))
    if how == "placeholder":
        return make(chat, thinking_text(reasoning="", answer="OK.") if thinking else "OK.", thinking=thinking)
    if how == "ok_without_think_end":
        return make(chat, "OK.")
    if how == "loop":
        return make(chat, thinking_text(reasoning="Wait, let me check that again. " * 60))
    if how == "tail_loop_cut":
        return make(chat, REASONING + " Hmm, so the answer is sugar. No, wait." * 40, finish="length")
    if how == "scattered_repeats":
        # The same two sentences alternate with fresh ones: never back to back, yet most 8-grams repeat.
        parts = [f"{FILLER[:60]} {i}. {REASONING} {i * 7}." for i in range(30)]
        return make(chat, thinking_text(reasoning=" ".join(parts)))
    raise AssertionError(how)


FILLER = "Photosynthesis needs light, water and carbon dioxide in the leaf, as noted"


def varied(n: int, seed: int = 0) -> str:
    """Real-looking text of `n` sentences of random words: no loop, hardly a repeated 8-gram."""
    rng = random.Random(seed)
    words = [
        "light",
        "water",
        "leaf",
        "sugar",
        "oxygen",
        "root",
        "stem",
        "cell",
        "energy",
        "carbon",
        "sun",
        "soil",
        "green",
        "plant",
        "grow",
        "night",
        "day",
        "heat",
        "store",
        "starch",
        "glucose",
        "enzyme",
        "membrane",
        "layer",
        "chlorophyll",
        "photon",
        "electron",
        "gradient",
        "cycle",
        "fixation",
    ]
    return " ".join(" ".join(rng.choice(words) for _ in range(9)).capitalize() + f" {i}." for i in range(n))


@pytest.mark.parametrize(("reason", "how", "thinking"), CASES, ids=[f"{r}-{h}" for r, h, _ in CASES])
def test_each_reject_reason(chat: ChatTokenizer, reason: str, how: str, thinking: bool) -> None:
    v = check_completion(_craft(chat, how, thinking), SPEC, enable_thinking=thinking)
    assert v.reason == reason, v.detail
    assert v.detail
    assert reason in VALIDATION_REASONS


def test_placeholder_detail_quotes_the_answer(chat: ChatTokenizer) -> None:
    v = check_completion(make(chat, thinking_text(reasoning="Ok", answer="OK.")), SPEC, enable_thinking=True)
    assert v.reason == "placeholder"
    assert "'OK.'" in v.detail and "1 reasoning and 2 answer tokens" in v.detail


def test_short_correct_answer_after_real_reasoning_is_accepted(chat: ChatTokenizer) -> None:
    # Issue 13.4: `42` after real reasoning used to be rejected as short_answer.
    reasoning = "The user asks for 6 times 7. 6 * 7 = 42; checking: 7 + 7 + 7 + 7 + 7 + 7 = 42. Reply with the number."
    v = check_completion(make(chat, thinking_text(reasoning=reasoning, answer="42"), question="6*7?"), SPEC, True)
    assert v.accepted, v.detail
    assert v.answer_tokens == len(chat.encode("42")) == 2  # digits are single tokens


def test_loop_of_just_under_half_the_completion_is_caught(chat: ChatTokenizer) -> None:
    # Issue 13.4: a loop making up just under half of a completion was accepted (8-gram share below 50%).
    head, block = varied(30), " Let me recount the chloroplast steps once more to be sure."
    n_head, n_block = len(chat.encode(head)), len(chat.encode(block))
    copies = n_head // n_block  # the loop ends up just under half of reasoning + loop + answer
    c = make(chat, thinking_text(reasoning=head + block * copies, answer=ANSWER))
    share = copies * n_block / len(c.output_ids)
    assert 0.4 < share < 0.5
    assert repeated_ngram_share(c.output_ids) < SPEC.max_repeated_ngram_share  # the old check let it through
    v = check_completion(c, SPEC, enable_thinking=True)
    assert v.reason == "repeated_block", v.detail
    assert "-token block span" in v.detail


@pytest.mark.parametrize("block_tokens", [1, 3, 40, 400])
def test_loops_of_any_block_size_are_found(chat: ChatTokenizer, block_tokens: int) -> None:
    head = chat.encode(varied(40))
    block = chat.encode(varied(60))[7 : 7 + block_tokens]
    copies = max(2, 500 // block_tokens)
    ids = head + block * copies + chat.encode(ANSWER)
    longest, tail = find_loops(ids)
    assert longest is not None and longest.span >= copies * block_tokens
    assert longest.period <= block_tokens and block_tokens % longest.period == 0
    assert tail is None or tail.span < 64
    assert find_loops(head + chat.encode(ANSWER))[0] is None or find_loops(head)[0].span < 64  # type: ignore[union-attr]


def test_long_varied_completion_with_short_repeats_is_accepted(chat: ChatTokenizer) -> None:
    table = "| a | b |\n|---|---|\n" + "".join(f"| {i} | {i * i} |\n" for i in range(20))
    zeros = "x = [" + "0, " * 20 + "0]"
    c = make(chat, thinking_text(reasoning=varied(40), answer=f"{ANSWER}\n\n{table}\n{zeros}\nDone, thanks!"))
    v = check_completion(c, SPEC, enable_thinking=True)
    assert v.accepted, v.detail


def test_truncation_names_where_it_was_cut(chat: ChatTokenizer) -> None:
    v = check_completion(make(chat, varied(20), finish="length"), SPEC, enable_thinking=True)
    assert v.reason == "truncated" and "inside the reasoning" in v.detail
    v = check_completion(make(chat, thinking_text(reasoning=varied(20), answer=ANSWER), finish="length"), SPEC, True)
    assert v.reason == "truncated" and "in the answer" in v.detail


def test_truncated_kept_when_allowed_even_inside_thinking(chat: ChatTokenizer) -> None:
    spec = ValidationSpec(reject_truncated=False)
    v = check_completion(make(chat, REASONING, finish="length"), spec, enable_thinking=True)
    assert v.accepted, v.detail


def test_repeated_ngram_share() -> None:
    assert repeated_ngram_share(list(range(100))) == 0.0
    assert repeated_ngram_share([1, 2, 3]) == 0.0
    # 10 distinct ids repeated 10 times: every window after the first 10 repeats one seen before.
    assert repeated_ngram_share(list(range(10)) * 10) == pytest.approx(83 / 93)


def test_duplicates_first_kept_later_rejected_naming_first(chat: ChatTokenizer) -> None:
    index = DuplicateIndex()
    first = make(chat, thinking_text(), question="Q1")
    second = make(chat, thinking_text(), question="Q2")
    assert index.check_and_add(first, True).accepted
    v = index.check_and_add(second, True)
    assert v.reason == "duplicate_completion"
    assert first.prompt_id in v.detail
    again = make(chat, thinking_text(answer=ANSWER + " Again."), question="Q3", request_key=first.request_key)
    assert index.check_and_add(again, True).reason == "duplicate_request"
    assert DuplicateIndex().check_and_add(second, False).accepted


def _write(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def test_validate_shards_accounts_for_every_line(chat: ChatTokenizer, tmp_path: Path) -> None:
    good = [make(chat, thinking_text(answer=f"{ANSWER} Fact {i}."), question=f"Q{i}") for i in range(5)]
    dup = make(chat, thinking_text(answer=f"{ANSWER} Fact 0."), question="another question")
    shard0 = _write(
        tmp_path / "shard-00000.completions.jsonl",
        [
            good[0].to_json(),
            good[1].to_json(),
            make(chat, thinking_text(reasoning="", answer="OK."), question="p").to_json(),
        ],
    )
    shard1 = _write(
        tmp_path / "shard-00001.completions.jsonl",
        [good[2].to_json(), "{not json", json.dumps({"source": "x", "row": 3}), dup.to_json(), "", good[3].to_json()],
    )
    out = tmp_path / "validated"
    summary = validate_shards([shard0, shard1], out, SPEC, enable_thinking=True, turns=LastTurn())

    assert (summary.total, summary.accepted, summary.rejected) == (8, 4, 4)
    assert summary.reject_reasons == {"placeholder": 1, "malformed_record": 2, "duplicate_completion": 1}
    assert summary.accepted_by_source == {"src": 4}
    assert summary.loss_tokens.n == 4
    assert [Path(p).name for p in summary.accepted_paths] == [
        "shard-00000.accepted.jsonl",
        "shard-00001.accepted.jsonl",
    ]
    accepted = [Completion.from_json(line) for p in summary.accepted_paths for line in Path(p).read_text().splitlines()]
    assert [c.prompt_id for c in accepted] == [good[i].prompt_id for i in range(4)]
    rejects = [Reject.from_json(line) for p in summary.reject_paths for line in Path(p).read_text().splitlines()]
    assert len(rejects) == 4 and all(r.stage == "validate" for r in rejects)
    by_reason = {r.reason: r for r in rejects}
    assert good[0].prompt_id in by_reason["duplicate_completion"].detail
    assert by_reason["duplicate_completion"].prompt_id == dup.prompt_id
    assert "shard-00001.completions.jsonl:2" in {r.detail.split(": ")[0] for r in rejects}
    assert json.loads((out / SUMMARY_NAME).read_text())["accepted"] == 4
    assert not list(out.glob(".*.tmp"))

    report = render_validation_report(summary)
    assert "| placeholder | 1 | 12.5% | src row 0 (prompt " in report and "| src | 4 | 100.0% |" in report


def test_validation_rejects_name_the_input_file_and_line(chat: ChatTokenizer, tmp_path: Path) -> None:
    # Issue 13.8: a reject after loading names the input row, not only the checkpoint line.
    bad = make(chat, "OK.", question="loc")
    bad.location = "/data/prompts/set.jsonl:17"
    shard = _write(tmp_path / "shard-00000.completions.jsonl", [bad.to_json()])
    summary = validate_shards([shard], tmp_path / "out", SPEC, enable_thinking=True, turns=LastTurn())
    [reject] = [Reject.from_json(line) for line in Path(summary.reject_paths[0]).read_text().splitlines()]
    assert (reject.reason, reject.location) == ("placeholder", "/data/prompts/set.jsonl:17")
    assert summary.reject_samples["placeholder"][0].startswith("/data/prompts/set.jsonl:17 (prompt ")


def test_duplicates_keep_the_copy_earlier_in_plan_order_whatever_finished_first(
    chat: ChatTokenizer, tmp_path: Path
) -> None:
    # Issue 13.5: the kept copy was the one that happened to finish first.
    early, late = (make(chat, thinking_text(), question=q) for q in ("planned first", "planned second"))
    early.meta, late.meta = {"plan_index": 0}, {"plan_index": 1}
    other = make(chat, thinking_text(answer=f"{ANSWER} Other."), question="planned third")
    other.meta = {"plan_index": 2}
    shard = _write(tmp_path / "shard-00000.completions.jsonl", [other.to_json(), late.to_json(), early.to_json()])
    summary = validate_shards([shard], tmp_path / "out", SPEC, enable_thinking=True, turns=LastTurn())
    accepted = [Completion.from_json(line) for line in Path(summary.accepted_paths[0]).read_text().splitlines()]
    assert [c.prompt_id for c in accepted] == [early.prompt_id, other.prompt_id]  # plan order
    [dup] = [Reject.from_json(line) for line in Path(summary.reject_paths[0]).read_text().splitlines()]
    assert (dup.reason, dup.prompt_id) == ("duplicate_completion", late.prompt_id)
    assert early.prompt_id in dup.detail


def test_validate_shards_rejects_colliding_output_names(tmp_path: Path) -> None:
    (tmp_path / "a").mkdir()
    a = _write(tmp_path / "a" / "shard-00000.completions.jsonl", [])
    b = _write(tmp_path / "shard-00000.completions.jsonl", [])
    with pytest.raises(ValueError, match="same output name"):
        validate_shards([a, b], tmp_path / "out", SPEC, enable_thinking=True, turns=LastTurn())
