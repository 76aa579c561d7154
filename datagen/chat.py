"""The model's tokenizer and chat template, loaded from its directory (one object per model)."""

from __future__ import annotations

import functools
import hashlib
import os
import sys
from collections.abc import Mapping, Sequence
from functools import cached_property
from pathlib import Path
from typing import Any

from datagen.records import Message

# What the template renders: typed messages, or raw dicts passed to it as they are (the template is the judge
# of what it accepts, e.g. in the conformance tests of its error messages).
TemplateMessages = Sequence[Message | Mapping[str, Any]]
# The functions a prompt declares (OpenAI function schemas), passed to the template as `tools=`; None: none.
Tools = Sequence[Mapping[str, Any]] | None

__all__ = [
    "ENDOFTEXT_ID",
    "IM_END_ID",
    "IM_START_ID",
    "THINK_END_ID",
    "THINK_START_ID",
    "ChatTokenizer",
    "TemplateError",
    "TemplateMessages",
    "Tools",
]

ENDOFTEXT_ID = 248044
IM_START_ID = 248045
IM_END_ID = 248046
THINK_START_ID = 248068
THINK_END_ID = 248069


class TemplateError(ValueError):
    """The chat template refused a conversation (e.g. a system message that is not first)."""


def _sha(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(hashlib.sha256(p).digest())
    return h.hexdigest()[:16]


def _import_transformers_quietly() -> None:
    """Import transformers without its "PyTorch was not found" advice: this venv has no torch by design."""
    if "transformers" in sys.modules:
        return
    # The advice is printed during the import when TRANSFORMERS_NO_ADVISORY_WARNINGS is unset; only the import
    # runs with it set, so later advisory and all real warnings still show.
    previous = os.environ.get("TRANSFORMERS_NO_ADVISORY_WARNINGS")
    os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = "1"
    try:
        import transformers  # noqa: F401
    finally:
        if previous is None:
            os.environ.pop("TRANSFORMERS_NO_ADVISORY_WARNINGS", None)
        else:
            os.environ["TRANSFORMERS_NO_ADVISORY_WARNINGS"] = previous


class ChatTokenizer:
    """Renders conversations with the checkpoint's own chat template and maps text <-> token ids."""

    def __init__(self, model_dir: Path, hf_tokenizer: Any) -> None:
        self.model_dir = model_dir
        self._hf = hf_tokenizer
        # The Rust tokenizer does the encoding/decoding; transformers only renders the template.
        self._fast = hf_tokenizer.backend_tokenizer

    @classmethod
    def from_model_dir(cls, path: str | Path) -> ChatTokenizer:
        """Load tokenizer.json, tokenizer_config.json and the chat template from a model directory."""
        _import_transformers_quietly()
        from transformers import AutoTokenizer

        model_dir = Path(path)
        if not (model_dir / "tokenizer.json").exists():
            raise FileNotFoundError(f"{model_dir}: no tokenizer.json (is the model staged there?)")
        hf = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
        if not getattr(hf, "chat_template", None):
            raise FileNotFoundError(f"{model_dir}: no chat template in tokenizer_config.json or chat_template.jinja")
        return cls(model_dir, hf)

    @classmethod
    def shared(cls, path: str | Path) -> ChatTokenizer:
        """One instance per model directory and process, reloaded when its tokenizer or config files change.

        The flow and the prompt loader (prompt identity) both need it: one load saves seconds and, with Qwen's
        250K-token vocabulary, a few hundred MB of resident memory per run.
        """
        model_dir = Path(path).resolve()
        stamp = tuple(
            (st.st_mtime_ns, st.st_size) if (st := _stat(model_dir / name)) is not None else None
            for name in _TOKENIZER_FILES
        )
        return _shared_tokenizer(str(model_dir), stamp)

    @property
    def backend(self) -> Any:
        """The Rust `tokenizers.Tokenizer` (its normalizer and pre-tokenizer; see datagen.sources.prompt_view)."""
        return self._fast

    @property
    def chat_template(self) -> str:
        template = self._hf.chat_template
        assert isinstance(template, str)
        return template

    @cached_property
    def template_hash(self) -> str:
        """Short sha256 of the chat template text."""
        return _sha(self.chat_template.encode("utf-8"))

    @cached_property
    def fingerprint(self) -> str:
        """Short sha256 over config.json, tokenizer.json and the chat template: the model's identity here."""
        parts = [
            (self.model_dir / name).read_bytes()
            for name in ("config.json", "tokenizer.json")
            if (self.model_dir / name).exists()
        ]
        return _sha(*parts, self.chat_template.encode("utf-8"))

    def render(self, messages: TemplateMessages, enable_thinking: bool = True, tools: Tools = None) -> str:
        """The prompt text for generating the next assistant turn (generation prompt included)."""
        return self._apply(messages, add_generation_prompt=True, enable_thinking=enable_thinking, tools=tools)

    def render_conversation(self, messages: TemplateMessages, enable_thinking: bool = True, tools: Tools = None) -> str:
        """A whole conversation (ending with an assistant turn), without a generation prompt."""
        return self._apply(messages, add_generation_prompt=False, enable_thinking=enable_thinking, tools=tools)

    def _apply(
        self, messages: TemplateMessages, *, add_generation_prompt: bool, enable_thinking: bool, tools: Tools
    ) -> str:
        # `tools=` only when the prompt declares some: a prompt without them renders exactly as it always did.
        extra: dict[str, Any] = {"tools": list(tools)} if tools else {}
        try:
            text = self._hf.apply_chat_template(
                [m.to_dict() if isinstance(m, Message) else dict(m) for m in messages],
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                enable_thinking=enable_thinking,
                **extra,
            )
        except Exception as exc:  # jinja2 raise_exception surfaces as TemplateError/ValueError
            raise TemplateError(str(exc)) from exc
        assert isinstance(text, str)
        return text

    def prompt_ids(self, messages: TemplateMessages, enable_thinking: bool = True, tools: Tools = None) -> list[int]:
        """Token ids of the rendered prompt."""
        return self.encode(self.render(messages, enable_thinking, tools))

    def encode(self, text: str) -> list[int]:
        """Token ids of `text`; special tokens written in the text map to their ids, nothing is added."""
        ids: list[int] = self._fast.encode(text, add_special_tokens=False).ids
        return ids

    def encode_with_offsets(self, text: str) -> tuple[list[int], list[tuple[int, int]]]:
        """Token ids of `text` and each token's (start, end) character offsets into `text`."""
        enc = self._fast.encode(text, add_special_tokens=False)
        return list(enc.ids), [(int(a), int(b)) for a, b in enc.offsets]

    def encode_batch(self, texts: list[str]) -> list[list[int]]:
        """Token ids of many texts (parallel in the Rust tokenizer)."""
        return [e.ids for e in self._fast.encode_batch(texts, add_special_tokens=False)]

    def decode(self, ids: list[int], skip_special_tokens: bool = False) -> str:
        """Text of token ids."""
        text: str = self._fast.decode(ids, skip_special_tokens=skip_special_tokens)
        return text

    def token_count(self, text: str) -> int:
        """Number of tokens in `text`."""
        return len(self.encode(text))

    @cached_property
    def max_token_bytes(self) -> int:
        """UTF-8 bytes of the longest token's text: a prompt of B bytes has at least B / this many tokens."""
        return max(len(self.decode([i]).encode("utf-8")) for i in range(self.vocab_size))

    def surely_over(self, messages: list[Message], token_limit: int) -> int | None:
        """Characters of the messages' (trimmed) content when they cannot fit in `token_limit` tokens, else None.

        Needs no tokenizing: every token holds at most `max_token_bytes` bytes, so more characters than
        token_limit x max_token_bytes are more tokens than the limit whatever the template does around them.
        """
        chars = sum(len(m.text.strip()) for m in messages)
        return chars if chars > token_limit * self.max_token_bytes else None

    @property
    def vocab_size(self) -> int:
        size: int = self._fast.get_vocab_size(with_added_tokens=True)
        return size


_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json")


def _stat(path: Path) -> os.stat_result | None:
    try:
        return path.stat()
    except OSError:
        return None


@functools.lru_cache(maxsize=4)
def _shared_tokenizer(model_dir: str, stamp: tuple[tuple[int, int] | None, ...]) -> ChatTokenizer:
    del stamp  # part of the cache key only
    return ChatTokenizer.from_model_dir(model_dir)
