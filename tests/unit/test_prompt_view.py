"""What the model sees, decided at load with the real Qwen3.6 tokenizer: normalization kept, bounded token counting."""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path

import pytest

from datagen.chat import ChatTokenizer
from datagen.identity import PromptIdentity
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Message, Prompt, Reject
from datagen.runspec import PromptSource
from datagen.sources.preparation import Preparer, Unsendable
from datagen.sources.prompt_view import CHUNK_CHARS, content_over_limit, model_view, normalization_form
from datagen.sources.prompts import iter_prompts
from tasks.tokenization import build_token_exact

# Text that NFC changes: OHM SIGN -> GREEK CAPITAL OMEGA, e + COMBINING ACUTE -> é, CJK compatibility
# ideographs -> their unified ideographs.
NOT_NFC = {
    "ohm": "A 4.7 k\u2126 resistor in series with 220 \u2126: what is the total resistance?",
    "accents": "Translate: \u201ccafe\u0301 and nai\u0308ve re\u0301sume\u0301\u201d into German.",
    "cjk": "What do \uf900 and \ufa10 mean, and how are they written today?",
}


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.shared(ensure_model_dir())


def _load(chat: ChatTokenizer, path: Path, limit: int = 4096) -> tuple[list[Prompt], list[Reject]]:
    items = list(iter_prompts([PromptSource(path=str(path))], identity=PromptIdentity(Preparer(chat, True, limit))))
    return [i for i in items if isinstance(i, Prompt)], [i for i in items if isinstance(i, Reject)]


def _completion(p: Prompt, chat: ChatTokenizer) -> Completion:
    ids = chat.prompt_ids(p.messages, True)
    out = [*chat.encode("Let me think about it carefully.</think>\n\nThe answer is 4.9 kilo-ohms."), 248046]
    return Completion(
        prompt_id=p.prompt_id,
        source=p.source,
        row=p.row,
        messages=p.messages,
        request_key="k",
        prompt_tokens=len(ids),
        output_ids=out,
        text=chat.decode(out[:-1]),
        finish_reason="stop",
        completion_tokens=len(out),
        normalized=p.normalized,
    )


def test_the_tokenizer_normalizes_to_nfc(chat: ChatTokenizer) -> None:
    assert normalization_form(chat) == "NFC"
    for text in NOT_NFC.values():
        assert not unicodedata.is_normalized("NFC", text)
        assert chat.decode(chat.encode(text)) == unicodedata.normalize("NFC", text) != text


def test_prompts_that_nfc_changes_are_kept_normalized_and_say_so(chat: ChatTokenizer, tmp_path: Path) -> None:
    # Issue 23.1: they used to be generated, then rejected at tokenization as prompt_decode_mismatch.
    f = tmp_path / "unicode.jsonl"
    rows = [{"instruction": t} for t in NOT_NFC.values()] + [{"instruction": "Plain ASCII, nothing to normalize."}]
    f.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    prompts, rejects = _load(chat, f)
    assert rejects == []
    assert [p.normalized for p in prompts] == ["NFC", "NFC", "NFC", None]
    for p, text in zip(prompts, [*NOT_NFC.values(), "Plain ASCII, nothing to normalize."], strict=True):
        assert p.messages == [Message(role="user", content=unicodedata.normalize("NFC", text))]
        # The id is what the model sees: the same token ids as the text given (the tokenizer normalizes anyway).
        identity = PromptIdentity(Preparer(chat, True, 4096))
        assert p.prompt_id == identity.prompt_id("unicode", [Message(role="user", content=text)])
        row = build_token_exact(_completion(p, chat), chat, True)  # the tokenize stage's round trip holds
        assert row.normalized == p.normalized
    assert json.loads(prompts[0].to_json())["normalized"] == "NFC"


def test_a_prompt_that_cannot_round_trip_is_a_load_reject_with_its_reason(chat: ChatTokenizer, tmp_path: Path) -> None:
    # A lone surrogate (valid JSON escape, not encodable text) used to crash planning with a TypeError.
    f = tmp_path / "surrogate.jsonl"
    f.write_text('{"instruction": "broken \\ud800 text"}\n{"instruction": "fine"}\n', encoding="utf-8")
    prompts, rejects = _load(chat, f)
    assert [p.messages[0].content for p in prompts] == ["fine"]
    assert [(r.reason, r.location) for r in rejects] == [("invalid_unicode", f"{f}:1")]
    assert "'\\ud800' at character 7" in rejects[0].detail


def test_generation_prepares_through_the_same_view(chat: ChatTokenizer) -> None:
    # One preparation (datagen.sources.preparation) for load and generation: a shard rendered again at generation (no
    # render cache) gets the ids load hashed, and an unsendable prompt the same reason.
    prepare = Preparer(chat, True, 4096)
    for text in NOT_NFC.values():
        for content in (text, [{"type": "text", "text": text}]):
            view = prepare.view([Message(role="user", content=content)])
            assert view.normalized == "NFC" and view.messages[0].text == unicodedata.normalize("NFC", text)
            assert prepare(view.messages) == view.ids == chat.prompt_ids([Message(role="user", content=text)])
    with pytest.raises(Unsendable) as err:
        prepare(
            [Message(role="user", content="fine"), Message(role="assistant", content="ok", reasoning_content="\ud800")]
        )
    assert err.value.reason == "invalid_unicode" and "messages[1].reasoning_content" in err.value.detail


def _words(rng: random.Random, n: int) -> str:
    pool = ["alpha", "beta", "matrix", "theorem", "2024", "über", "naïve", "東京", ",", ".", "\n\n", "x+y", "(a)"]
    return " ".join(rng.choice(pool) for _ in range(n))


@pytest.mark.parametrize("chunk", [97, 1000, CHUNK_CHARS])
def test_chunked_count_matches_the_whole_text_near_the_limit(chat: ChatTokenizer, chunk: int) -> None:
    rng = random.Random(chunk)
    for _ in range(5):
        messages = [
            Message(role="system", content=_words(rng, 300)),
            Message(role="user", content=_words(rng, 900)),
            Message(role="assistant", content=_words(rng, 200)),
            Message(role="user", content="  " + _words(rng, 700) + "  "),
        ]
        content = sum(len(chat.encode(m.text.strip())) for m in messages)
        whole = len(chat.prompt_ids(messages))
        # Content alone over the limit: surely over (the template only adds tokens).
        assert content_over_limit(chat, messages, content - 20, chunk) is not None
        # The whole prompt fits: never rejected by the count.
        assert content_over_limit(chat, messages, whole, chunk) is None
        assert model_view(chat, messages, True, whole).ids == chat.prompt_ids(messages)


def test_a_large_row_is_counted_only_up_to_the_limit(chat: ChatTokenizer, tmp_path: Path) -> None:
    # Issue 23.3: a 30 MB row under the length-only shortcut was tokenized whole (58 s, 5 GB) before the reject.
    limit = 250_000  # like a long-context run: 30 MB of content is under limit x 128 bytes, so no length shortcut
    row = "The quick brown fox jumps over the lazy dog. " * (30_000_000 // 45)
    assert chat.surely_over([Message(role="user", content=row)], limit) is None
    over = content_over_limit(chat, [Message(role="user", content=row)], limit)
    assert over is not None
    tokens, read = over
    assert limit < tokens <= limit + CHUNK_CHARS  # one chunk past the limit at most
    assert read < len(row) // 10
    f = tmp_path / "big.jsonl"
    f.write_text(json.dumps({"instruction": row}) + "\n" + json.dumps({"instruction": "short"}) + "\n")
    prompts, rejects = _load(chat, f, limit)
    assert [p.messages[0].content for p in prompts] == ["short"]
    assert [r.reason for r in rejects] == ["prompt_too_long"]
    assert f"in the first {read} of " in rejects[0].detail and "stopped counting" in rejects[0].detail
