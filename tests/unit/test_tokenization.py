"""Token-exact rows, the rerender mode beside it, parquet output loaded with `datasets`, and the dataset card."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import datasets
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from datagen.chat import IM_END_ID, THINK_END_ID, ChatTokenizer, TemplateError
from datagen.conversation.turn_mode import LastTurn
from datagen.identity import prompt_id_from_messages
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.dataset_card import DatasetSizes, Lineage, arrow_features_yaml, write_dataset_card
from datagen.records import REJECT_SCHEMA, TOKEN_ROW_SCHEMA, Completion, Message, Reject
from datagen.runspec import SamplingSpec
from tasks.tokenization import RowRejected, build_rerendered, build_token_exact, tokenize_accepted

REASONING = "The user asks about tides. Gravity from the Moon differs across the Earth, so I explain bulges."
ANSWER = "Tides are caused mainly by the Moon's gravity, which pulls the oceans into two bulges."

CONVERSATIONS: dict[str, list[Message]] = {
    "single": [{"role": "user", "content": "Why are there tides?"}],
    "system": [
        {"role": "system", "content": "You are a concise physics tutor."},
        {"role": "user", "content": "Why are there tides?"},
    ],
    "multi_turn": [
        {"role": "system", "content": "You are a concise physics tutor."},
        {"role": "user", "content": "What pulls on the oceans?"},
        {"role": "assistant", "content": "Mostly the Moon, and the Sun a little."},
        {"role": "user", "content": "So why are there two tides a day?"},
    ],
}


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(ensure_model_dir())


def output_text(thinking: bool, reasoning: str = REASONING, answer: str = ANSWER) -> str:
    return f"{reasoning}\n</think>\n\n{answer}" if thinking else answer


def make(
    chat: ChatTokenizer,
    messages: list[Message],
    thinking: bool,
    text: str | None = None,
    ids: list[int] | None = None,
    source: str = "src",
) -> Completion:
    """A completion as /generate returns it: output ids ending with <|im_end|>, text without it."""
    text = output_text(thinking) if text is None else text
    output_ids = (chat.encode(text) if ids is None else ids) + [IM_END_ID]
    pid = prompt_id_from_messages(source, messages)
    return Completion(
        prompt_id=pid,
        source=source,
        row=0,
        messages=messages,
        request_key=f"rk-{pid}",
        prompt_tokens=len(chat.prompt_ids(messages, thinking)),
        output_ids=output_ids,
        text=text,
        finish_reason="stop",
        completion_tokens=len(output_ids),
        category="science",
    )


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking_on", "thinking_off"])
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_token_exact_round_trip(chat: ChatTokenizer, conv: str, thinking: bool) -> None:
    messages = CONVERSATIONS[conv]
    c = make(chat, messages, thinking)
    row = build_token_exact(c, chat, thinking)
    p = row.prompt_tokens
    assert row.input_ids[:p] == chat.prompt_ids(messages, thinking)
    assert row.input_ids[p:] == c.output_ids  # exactly the server's ids, EOS included
    assert row.loss_mask == [0] * p + [1] * len(c.output_ids)
    assert sum(row.loss_mask) == row.completion_tokens == c.completion_tokens
    assert chat.decode(row.input_ids) == chat.render(messages, thinking) + c.text + "<|im_end|>"
    assert (THINK_END_ID in row.input_ids[p:]) is thinking
    assert row.num_turns == (2 if conv == "multi_turn" else 1)


def test_prompt_token_mismatch_is_rejected(chat: ChatTokenizer) -> None:
    c = make(chat, CONVERSATIONS["system"], True)
    c.prompt_tokens += 1
    with pytest.raises(RowRejected) as err:
        build_token_exact(c, chat, True)
    assert err.value.reason == "prompt_token_mismatch"
    assert f"server counted {c.prompt_tokens}" in err.value.detail and chat.template_hash in err.value.detail


def test_prompt_that_does_not_round_trip_is_rejected(chat: ChatTokenizer) -> None:
    # The tokenizer NFC-normalizes: decomposed "é" encodes to the composed form, so the ids do not give the text back.
    messages: list[Message] = [{"role": "user", "content": "Cafe\u0301 au lait?"}]
    c = make(chat, messages, True)
    with pytest.raises(RowRejected) as err:
        build_token_exact(c, chat, True)
    assert err.value.reason == "prompt_decode_mismatch"


def test_completion_text_that_does_not_match_ids_is_rejected(chat: ChatTokenizer) -> None:
    c = make(chat, CONVERSATIONS["single"], True)
    c.text = c.text.replace("Moon", "Sun")
    with pytest.raises(RowRejected) as err:
        build_token_exact(c, chat, True)
    assert err.value.reason == "completion_decode_mismatch"
    assert "'Moon" in err.value.detail


def test_template_error_is_rejected(chat: ChatTokenizer) -> None:
    messages: list[Message] = [{"role": "user", "content": "hi"}, {"role": "system", "content": "late system"}]
    c = make(chat, CONVERSATIONS["single"], True)
    c.messages = messages
    with pytest.raises(RowRejected) as err:
        build_token_exact(c, chat, True)
    assert err.value.reason == "template_error"


@pytest.mark.parametrize("thinking", [True, False], ids=["thinking_on", "thinking_off"])
@pytest.mark.parametrize("conv", sorted(CONVERSATIONS))
def test_rerender_agrees_when_ids_are_canonical_and_whitespace_is_regular(
    chat: ChatTokenizer, conv: str, thinking: bool
) -> None:
    c = make(chat, CONVERSATIONS[conv], thinking)
    exact, rerendered = build_token_exact(c, chat, thinking), build_rerendered(c, chat, thinking)
    assert rerendered.input_ids == exact.input_ids
    assert rerendered.loss_mask == exact.loss_mask


def test_rerender_differs_on_non_canonical_ids(chat: ChatTokenizer) -> None:
    # The model emitted "\n" "\n" (198 198) where BPE of the same text gives "\n\n" (271).
    messages = CONVERSATIONS["single"]
    ids = [*chat.encode(REASONING + "\n"), THINK_END_ID, 198, 198, *chat.encode(ANSWER)]
    c = make(chat, messages, True, ids=ids)
    exact, rerendered = build_token_exact(c, chat, True), build_rerendered(c, chat, True)
    assert exact.input_ids[exact.prompt_tokens :] == c.output_ids
    assert rerendered.input_ids != exact.input_ids
    assert 271 in rerendered.input_ids[rerendered.prompt_tokens :]
    assert chat.decode(rerendered.input_ids) == chat.decode(exact.input_ids)  # same text, different tokens
    assert sum(rerendered.loss_mask) == sum(exact.loss_mask) - 1


def test_rerender_differs_when_the_template_normalizes_whitespace(chat: ChatTokenizer) -> None:
    # Reasoning opening with a blank line: the template strips it, so the trained text is not the generated one.
    text = output_text(True, reasoning="\n" + REASONING)
    c = make(chat, CONVERSATIONS["single"], True, text=text)
    exact, rerendered = build_token_exact(c, chat, True), build_rerendered(c, chat, True)
    assert chat.decode(exact.input_ids).endswith(text + "<|im_end|>")
    assert chat.decode(rerendered.input_ids).endswith(text[1:] + "<|im_end|>")
    assert rerendered.completion_tokens == exact.completion_tokens - 1


def test_rerender_drops_whitespace_the_template_trims_at_the_prompt_boundary(chat: ChatTokenizer) -> None:
    # Thinking off, answer opening with "\n": the family's template trims content, so rerender loses the model's
    # leading "\n" (and no BPE token can straddle the boundary); token-exact keeps the ids as generated.
    c = make(chat, CONVERSATIONS["single"], False, text="\n" + ANSWER)
    exact, rerendered = build_token_exact(c, chat, False), build_rerendered(c, chat, False)
    assert chat.decode(exact.input_ids[exact.prompt_tokens :]) == "\n" + ANSWER + "<|im_end|>"
    assert chat.decode(rerendered.input_ids[rerendered.prompt_tokens :]) == ANSWER + "<|im_end|>"
    assert rerendered.prompt_tokens == exact.prompt_tokens
    assert exact.input_ids[exact.prompt_tokens - 1 : exact.prompt_tokens + 1] == [271, 198]


def test_rerender_rejects_truncated(chat: ChatTokenizer) -> None:
    c = make(chat, CONVERSATIONS["single"], True)
    c.finish_reason = "length"
    with pytest.raises(RowRejected) as err:
        build_rerendered(c, chat, True)
    assert err.value.reason == "rerender_unsupported"


def _jsonl(path: Path, records: list[str]) -> Path:
    path.write_text("".join(r + "\n" for r in records), encoding="utf-8")
    return path


@pytest.fixture
def staged(chat: ChatTokenizer, tmp_path: Path) -> tuple[Path, list[Completion]]:
    """Five good completions over two shards, one with a bad prompt count, one malformed line, two upstream rejects."""
    good = [
        make(chat, [{"role": "user", "content": f"Question {i}: why are there tides?"}], True, source=f"s{i % 2}")
        for i in range(5)
    ]
    bad = make(chat, [{"role": "user", "content": "Mismatched prompt"}], True)
    bad.prompt_tokens -= 3
    shard0 = _jsonl(tmp_path / "shard-00000.accepted.jsonl", [c.to_json() for c in good[:3]] + [bad.to_json()])
    shard1 = _jsonl(tmp_path / "shard-00001.accepted.jsonl", [good[3].to_json(), "{oops", good[4].to_json()])
    upstream = _jsonl(
        tmp_path / "load-rejects.jsonl",
        [
            Reject("load", "malformed_row", "row 7: no messages", "s0", row=7).to_json(),
            Reject("validate", "short_answer", "answer has 2 tokens", "s1", 3, "p3", 9).to_json(),
        ],
    )
    staging = tmp_path / "dataset"
    (staging / "data").mkdir(parents=True)
    (staging / "data" / "train-00000-of-00009.parquet").write_bytes(b"stale")  # from an earlier attempt
    summary = tokenize_accepted(
        [shard0, shard1],
        staging,
        chat,
        enable_thinking=True,
        rows_per_file=2,
        extra_reject_paths=[upstream, tmp_path / "absent.jsonl"],
        batch_size=2,
        turns=LastTurn(),
    )
    assert summary.rows == 5
    assert summary.data_files == [f"data/train-{i:05d}-of-00003.parquet" for i in range(3)]
    assert summary.reject_files == ["rejects/rejects-00000-of-00001.parquet"]
    assert summary.rejects_by_reason == {
        "load/malformed_row": 1,
        "validate/short_answer": 1,
        "tokenize/prompt_token_mismatch": 1,
        "tokenize/malformed_record": 1,
    }
    assert (summary.tokenize_rejected, summary.n_rejects, summary.n_rows) == (2, 4, 5)
    assert summary.missing_reject_paths == [str(tmp_path / "absent.jsonl")]
    return staging, good


def test_parquet_loads_with_datasets_and_loss_masks_cover_completions(
    staged: tuple[Path, list[Completion]], tmp_path: Path
) -> None:
    staging, good = staged
    files = sorted(str(p) for p in (staging / "data").glob("*.parquet"))
    assert len(files) == 3 and not (staging / "data" / ".parts").exists()
    assert pq.read_schema(files[0]) == TOKEN_ROW_SCHEMA
    ds = datasets.load_dataset("parquet", data_files=files, split="train", cache_dir=str(tmp_path / "cache"))
    assert ds.num_rows == 5
    by_id = {c.prompt_id: c for c in good}
    for row in ds:
        c = by_id[row["prompt_id"]]
        assert sum(row["loss_mask"]) == row["completion_tokens"] == len(c.output_ids)
        assert row["input_ids"][row["prompt_tokens"] :] == c.output_ids
        assert len(row["input_ids"]) == len(row["loss_mask"])
    assert [r["prompt_id"] for r in ds] == [c.prompt_id for c in good]  # input order kept

    rejects = pq.read_table(staging / "rejects" / "rejects-00000-of-00001.parquet")
    assert rejects.schema == REJECT_SCHEMA
    assert rejects.column("stage").to_pylist() == ["load", "validate", "tokenize", "tokenize"]


def test_dataset_card_front_matter_is_what_datasets_reads(
    chat: ChatTokenizer, staged: tuple[Path, list[Completion]], tmp_path: Path
) -> None:
    staging, _ = staged
    summary_rows = pq.ParquetDataset(sorted((staging / "data").glob("*.parquet"))).read().num_rows
    lineage = Lineage(
        model_fingerprint=chat.fingerprint, template_hash=chat.template_hash, source_mix={"s0": 3, "s1": 2}
    )
    sizes = DatasetSizes(num_examples=summary_rows, num_bytes=1234, num_files=3)
    path = write_dataset_card(
        staging, namespace="expansion_v1", model="Qwen3.6-27B", sampling=SamplingSpec(), lineage=lineage, sizes=sizes
    )
    text = path.read_text(encoding="utf-8")
    front = yaml.safe_load(text.split("---\n")[1])
    assert front["dataset_info"]["features"] == datasets.Features.from_arrow_schema(TOKEN_ROW_SCHEMA)._to_yaml_list()
    assert front["dataset_info"]["splits"] == [{"name": "train", "num_bytes": 1234, "num_examples": 5}]
    meta = front["datagen"]
    assert meta["lineage"]["model_fingerprint"] == chat.fingerprint
    assert meta["lineage"]["template_hash"] == chat.template_hash
    assert meta["lineage"]["pipeline_version"] and meta["sampling"]["enable_thinking"] is True
    assert "| s0 | 3 | 60.0% |" in text

    cache = str(tmp_path / "cache")
    train = datasets.load_dataset(str(staging), "default", split="train", cache_dir=cache)
    assert train.num_rows == 5 and train.features == datasets.Features.from_arrow_schema(TOKEN_ROW_SCHEMA)
    rejects = datasets.load_dataset(str(staging), "rejects", split="train", cache_dir=cache)
    assert rejects.num_rows == 4


def test_arrow_features_yaml_rejects_unknown_types() -> None:
    assert arrow_features_yaml(pa.schema([pa.field("x", pa.float32())])) == [{"name": "x", "dtype": "float32"}]
    with pytest.raises(ValueError, match="no dataset-card dtype"):
        arrow_features_yaml(pa.schema([pa.field("m", pa.map_(pa.string(), pa.int32()))]))


def test_rerender_mode_end_to_end_writes_same_rows_for_canonical_data(chat: ChatTokenizer, tmp_path: Path) -> None:
    completions = [make(chat, CONVERSATIONS[k], True) for k in sorted(CONVERSATIONS)]
    shard = _jsonl(tmp_path / "a.jsonl", [c.to_json() for c in completions])
    exact = tokenize_accepted([shard], tmp_path / "exact", chat, True, turns=LastTurn())
    rer = tokenize_accepted([shard], tmp_path / "rer", chat, True, mode="rerender", turns=LastTurn())
    assert (exact.rows, rer.rows, rer.mode) == (3, 3, "rerender")
    a = pq.read_table(tmp_path / "exact" / exact.data_files[0]).select(["input_ids", "loss_mask"])
    b = pq.read_table(tmp_path / "rer" / rer.data_files[0]).select(["input_ids", "loss_mask"])
    assert a.equals(b)
    assert json.loads(exact.model_dump_json())["loss_tokens"]["counts"]


# ------------------------------------------------------------------------- the fixture's chat template (#13.10)


def test_fixture_template_renders_the_reference_example_exactly(chat: ChatTokenizer) -> None:
    messages: list[Message] = [
        {"role": "system", "content": "You are helpful."},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = chat.render(messages)
    assert text == (
        "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
        "<|im_start|>assistant\n<think>\n"
    )
    # The reference's token ids for the same prompt without the system turn (shared reference, section 5.2).
    assert chat.prompt_ids(messages[1:]) == [
        248045, 846, 198, 3710, 369, 220, 17, 10, 17, 30, 248046, 198, 248045, 74455, 198, 248068, 198
    ]  # fmt: skip


def test_fixture_template_trims_content_like_the_qwen3_family(chat: ChatTokenizer) -> None:
    padded = chat.render(
        [{"role": "system", "content": "  Be brief.\n"}, {"role": "user", "content": "\n  Hi there  \n"}]
    )
    assert padded == chat.render([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}])
    # An empty system prompt still renders its (empty) block: what the user gave is what the model sees.
    assert chat.render([{"role": "system", "content": " "}, {"role": "user", "content": "q"}]).startswith(
        "<|im_start|>system\n<|im_end|>\n<|im_start|>user\nq<|im_end|>\n"
    )


def test_fixture_template_renders_list_content_and_tool_turns(chat: ChatTokenizer) -> None:
    parts: Any = [{"type": "text", "text": "Look at "}, {"type": "text", "text": "this."}]
    assert chat.render([{"role": "user", "content": parts}]) == chat.render(
        [{"role": "user", "content": "Look at this."}]
    )
    call = {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris", "days": 2}}}
    messages: Any = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": '{"temp": 21}'},
        {"role": "tool", "content": '{"temp": 23}'},
    ]
    text = chat.render(messages)
    assert (
        "<|im_start|>assistant\n<think>\n\n</think>\n\n<tool_call>\n<function=weather>\n<parameter=city>\nParis\n"
        "</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call><|im_end|>\n"
        '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>\n<tool_response>\n{"temp": 23}\n'
        "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n"
    ) in text


@pytest.mark.parametrize(
    ("messages", "error"),
    [
        ([{"role": "system", "content": "Only a system prompt."}], "No user query found"),
        ([{"role": "assistant", "content": "A reply to nobody."}], "No user query found"),
        (
            [{"role": "user", "content": "q"}, {"role": "system", "content": "late"}],
            "System message must be at the beginning",
        ),
        ([{"role": "user", "content": [{"type": "audio", "audio": "x"}]}], "Unexpected item type"),
        ([{"role": "critic", "content": "?"}, {"role": "user", "content": "q"}], "Unexpected message role"),
    ],
)
def test_fixture_template_raises_where_the_real_ones_do(chat: ChatTokenizer, messages: Any, error: str) -> None:
    with pytest.raises(TemplateError, match=error):
        chat.render(messages)
