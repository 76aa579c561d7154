"""What the model sees of a prompt, decided at load before any GPU time: normalized text, bounded tokenization.

The tokenizer normalizes text before it splits it (Qwen: NFC), so the ids of a prompt whose text NFC changes
(an Ohm sign, decomposed accents, CJK compatibility ideographs) decode to the normalized text, not the text
given. The model sees the normalized text either way; `model_view` keeps such a prompt with its messages
normalized (`normalized="NFC"` on the row), so every later check (the tokenize stage's decode round trip)
holds. A prompt that still does not round-trip is a load reject with its reason.

Large rows: a prompt's content is tokenized in chunks cut at pre-token boundaries (so the counts add up to
the whole text's count) and counting stops once past the token limit; only a prompt that fits is rendered
and encoded whole, so the work per row is bounded by the limit, not by the row's size.
"""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Literal

from datagen.chat import ChatTokenizer, TemplateError, Tools
from datagen.records import ContentPart, Message

__all__ = [
    "CHUNK_CHARS",
    "PromptView",
    "PromptViewError",
    "content_over_limit",
    "model_view",
    "normalization_form",
    "normalize_messages",
]

NormalForm = Literal["NFC", "NFD", "NFKC", "NFKD"]
_FORMS: tuple[NormalForm, ...] = ("NFKC", "NFKD", "NFC", "NFD")  # NFKC first: "NFC" is inside its name

# Characters tokenized at once while counting a large prompt: small enough that the tokenizer's working memory
# (~170 bytes per character for Qwen's BPE) stays at tens of MB, large enough that per-call overhead is noise.
CHUNK_CHARS = 64 << 10
_CHARS_PER_TOKEN = 4


class PromptViewError(ValueError):
    """A prompt the model cannot be given as it is; `reason` is the load reject reason."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True, slots=True)
class PromptView:
    """The prompt as sent: its token ids, the messages they decode to, and the normalization applied (if any)."""

    ids: list[int]
    messages: list[Message]
    normalized: str | None
    text: str = ""  # the template's rendering the ids encode (they decode back to it)


def normalization_form(chat: ChatTokenizer) -> NormalForm | None:
    """The Unicode normalization the tokenizer applies before splitting (None: none, or one we cannot name)."""
    normalizer = chat.backend.normalizer
    if normalizer is None:
        return None
    name = repr(normalizer)
    for form in _FORMS:
        if name.startswith(form + "(") or f"{form}()" in name:
            return form
    return None


def _texts(m: Message) -> Iterator[tuple[str, str]]:
    """(field, text) for every text of a message the template renders: its content (or text parts), its reasoning."""
    if isinstance(m.content, str):
        yield "content", m.content
    else:
        yield from (("content", p["text"]) for p in m.content if isinstance(p.get("text"), str))
    if m.reasoning_content is not None:
        yield "reasoning_content", m.reasoning_content


def _normalized(m: Message, form: NormalForm) -> Message:
    """`m` with its content (every text part) and reasoning in `form`."""
    if isinstance(m.content, str):
        content: str | list[ContentPart] = unicodedata.normalize(form, m.content)
    else:
        content = [
            {**p, "text": unicodedata.normalize(form, p["text"])} if isinstance(p.get("text"), str) else p
            for p in m.content
        ]
    reasoning = m.reasoning_content
    return replace(
        m, content=content, reasoning_content=None if reasoning is None else unicodedata.normalize(form, reasoning)
    )


def normalize_messages(messages: list[Message], form: NormalForm | None) -> tuple[list[Message], bool]:
    """`messages` with every text in `form`, and whether any text changed."""
    if form is None or all(unicodedata.is_normalized(form, t) for m in messages for _, t in _texts(m)):
        return messages, False
    return [_normalized(m, form) for m in messages], True


def _safe_cut(chat: ChatTokenizer, text: str, start: int, end: int) -> tuple[int, bool]:
    """A cut in text[start:end] at a pre-token boundary the whole text shares; (cut, exact).

    Pieces are found by the tokenizer's own pre-tokenizer; the last two pieces of the window are left for the
    next chunk (the last may continue past `end`, and a whitespace piece depends on what follows it). A window
    that is one piece (30 MB of letters without a space) is cut where it ends: not exact.
    """
    pre = chat.backend.pre_tokenizer
    if pre is None:
        return end, False
    pieces = pre.pre_tokenize_str(text[start:end])
    if len(pieces) < 3:
        return end, False
    return start + pieces[-2][1][0], True


def content_over_limit(
    chat: ChatTokenizer, messages: list[Message], limit: int, chunk_chars: int = CHUNK_CHARS
) -> tuple[int, int] | None:
    """(tokens counted, characters read) once the messages' content alone surely exceeds `limit`; None if it may fit.

    Each content is counted as the template renders it (trimmed). A cut inside one pre-token may merge
    differently, so one token per inexact cut and per message edge is taken off before comparing.
    """
    counted = 0
    slack = 0
    read = 0
    for m in messages:
        text = m.text.strip()
        slack += 1
        pos = 0
        while pos < len(text):
            end = min(len(text), pos + chunk_chars)
            exact = True
            if end < len(text):
                end, exact = _safe_cut(chat, text, pos, end)
            counted += len(chat.encode(text[pos:end]))
            slack += 0 if exact else 1
            read += end - pos
            pos = end
            if counted - slack > limit:
                return counted - slack, read
    return None


def model_view(
    chat: ChatTokenizer,
    messages: list[Message],
    enable_thinking: bool,
    limit: int,
    limit_note: str = "",
    tools: Tools = None,
) -> PromptView:
    """The prompt as the model will see it, or PromptViewError (reason: a load reject reason) if it cannot be sent.

    Bounded by `limit`: a prompt over it is told after tokenizing at most about `limit` tokens of its content.
    """
    for i, m in enumerate(messages):
        for name, text in _texts(m):
            try:
                text.encode("utf-8")
            except UnicodeEncodeError as exc:
                bad = text[exc.start : exc.end]
                raise PromptViewError(
                    "invalid_unicode",
                    f"messages[{i}].{name} holds {bad!r} at character {exc.start} ({exc.reason}): not text the "
                    "tokenizer can encode",
                ) from exc
    chars = chat.surely_over(messages, limit)
    if chars is not None:
        raise PromptViewError(
            "prompt_too_long",
            f"{chars} characters of content cannot fit in {limit} prompt tokens (a token holds at most "
            f"{chat.max_token_bytes} bytes); rejected without tokenizing",
        )
    form = normalization_form(chat)
    sent, changed = normalize_messages(messages, form)
    total = sum(len(m.text) for m in sent)
    # Counting first pays only for rows that are likely over: up to ~4 characters a token (English prose) a row is
    # usually within the limit and is encoded once, whole, below; that work is bounded by 4 x limit characters.
    over = content_over_limit(chat, sent, limit) if total > max(CHUNK_CHARS, _CHARS_PER_TOKEN * limit) else None
    if over is not None:
        tokens, read = over
        raise PromptViewError(
            "prompt_too_long",
            f"at least {tokens} tokens in the first {read} of {total} characters of content, limit is {limit}; "
            "stopped counting there",
        )
    try:
        text = chat.render(sent, enable_thinking, tools)
    except TemplateError as exc:
        raise PromptViewError("template_error", f"the chat template refused it: {exc}") from exc
    ids = chat.encode(text)
    if len(ids) > limit:
        note = f" {limit_note}" if limit_note else ""
        raise PromptViewError("prompt_too_long", f"prompt has {len(ids)} tokens, limit is {limit}{note}")
    decoded = chat.decode(ids)
    if decoded != text:
        i = next(
            (k for k, (x, y) in enumerate(zip(decoded, text, strict=False)) if x != y), min(len(decoded), len(text))
        )
        raise PromptViewError(
            "prompt_decode_mismatch",
            f"the prompt's token ids do not decode back to it (after {form or 'no'} normalization): first "
            f"difference at character {i}: {decoded[i : i + 20]!r} vs {text[i : i + 20]!r}",
        )
    return PromptView(ids, sent, form if changed else None, text)
