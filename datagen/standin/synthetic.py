"""The stand-in's "model": deterministic Qwen3.6-style outputs over the real vocabulary, planned up front."""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from datagen.chat import IM_END_ID, THINK_END_ID, THINK_START_ID, ChatTokenizer
from datagen.standin.knobs import Knobs
from datagen.standin.toolcall import call_text, declared_tools

__all__ = ["NEWLINES_ID", "NEWLINE_ID", "OutputPlan", "SyntheticModel"]

NEWLINE_ID = 198  # "\n"
NEWLINES_ID = 271  # "\n\n"
_COMMA_ID = 11
_PERIOD_ID = 13
# Sentence openers for the first token of the reasoning and of the answer (no leading space, as a model writes).
_STARTERS = ("Okay", "The", "So", "Let", "First", "Here", "We", "This", "Sure", "Yes", "To", "In", "Well", "Now")
_WORD = re.compile(r" [a-z]{2,10}")
_SCAN_IDS = 60_000  # the word-like tokens among the first ids are plenty (>10k) and scanning is quick
_PUNCT_RATE = 0.12

IdArray = npt.NDArray[np.int64]


@dataclass(frozen=True, slots=True)
class OutputPlan:
    """Every token a request will emit, and why it stops after the last one."""

    ids: IdArray
    finish_reason: dict[str, Any]
    reasoning_tokens: int  # tokens up to and including </think> (all of them if </think> was never reached)


class SyntheticModel:
    """Picks output lengths and word tokens so that text decodes cleanly and re-encodes to the same ids."""

    def __init__(self, tokenizer: ChatTokenizer, knobs: Knobs) -> None:
        self.tokenizer = tokenizer
        self.knobs = knobs
        candidates = [i for i in range(_SCAN_IDS) if _WORD.fullmatch(tokenizer.decode([i]))]
        texts = [tokenizer.decode([i]) for i in candidates]
        # Keep only tokens that the tokenizer itself produces for their text: then encode(text) == ids.
        self.words: IdArray = np.array(
            [i for i, ids in zip(candidates, tokenizer.encode_batch(texts), strict=True) if ids == [i]],
            dtype=np.int64,
        )
        starters = [tokenizer.encode(w) for w in _STARTERS]
        self.starters: IdArray = np.array([ids[0] for ids in starters if len(ids) == 1], dtype=np.int64)
        if len(self.words) < 100 or len(self.starters) == 0:
            raise RuntimeError("the tokenizer has too few plain word tokens for synthetic text")

    def _rng(self, prompt_ids: list[int], sampling_seed: int | None) -> np.random.Generator:
        # Same prompt + same seed -> same output (a retry reproduces it), across processes and runs.
        h = hashlib.blake2b(digest_size=16)
        h.update(np.asarray(prompt_ids, dtype=np.int64).tobytes())
        h.update(f"|{sampling_seed}|{self.knobs.seed}".encode())
        return np.random.default_rng(int.from_bytes(h.digest(), "little"))

    def _words(self, rng: np.random.Generator, n: int, end_with_period: bool) -> IdArray:
        ids = self.words[rng.integers(0, len(self.words), n)]
        if n == 0:
            return ids
        ids[0] = self.starters[rng.integers(0, len(self.starters))]
        punct = rng.random(n) < _PUNCT_RATE
        punct[0] = False
        punct[1:] &= ~punct[:-1]  # never two punctuation marks in a row (they would merge when re-encoded)
        if n > 1:
            punct[-1] = end_with_period
            if end_with_period:
                punct[-2] = False
        else:
            punct[-1] = False
        ids[punct] = np.where(rng.random(int(punct.sum())) < 0.5, _COMMA_ID, _PERIOD_ID)
        if n > 1 and end_with_period:
            ids[-1] = _PERIOD_ID
        return ids

    def plan(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        sampling_seed: int | None = None,
        min_new_tokens: int = 0,
        ignore_eos: bool = False,
        stop_token_ids: list[int] | None = None,
    ) -> OutputPlan:
        """The full output for a prompt: thinking-format when the prompt ends with the thinking generation prompt."""
        k = self.knobs
        rng = self._rng(prompt_ids, sampling_seed)
        sigma = k.length_sigma
        mu = math.log(k.length_mean) - sigma * sigma / 2  # so that the lognormal's mean is length_mean
        total = int(np.clip(round(float(rng.lognormal(mu, sigma))), 2, k.length_max))
        total = max(total, min_new_tokens + 1)
        if ignore_eos:
            total = max(total, max_new_tokens + 1)
        thinking = prompt_ids[-2:] == [THINK_START_ID, NEWLINE_ID]
        # Only a prompt that declares tools draws for a call: every other output stays what it always was.
        tools = declared_tools(self.tokenizer, prompt_ids) if k.tool_call_rate > 0 else []
        calls = bool(tools) and float(rng.random()) < k.tool_call_rate
        if thinking:
            frac = float(np.clip(rng.normal(k.reasoning_fraction, 0.1), 0.05, 0.95))
            n_reason = max(1, round((total - 4) * frac))
            n_answer = max(1, total - 4 - n_reason)
            parts = [
                self._words(rng, n_reason, end_with_period=False),
                np.array([NEWLINE_ID, THINK_END_ID, NEWLINES_ID], dtype=np.int64),
                self._call(tools) if calls else self._words(rng, n_answer, end_with_period=True),
            ]
        else:
            parts = [self._call(tools) if calls else self._words(rng, max(1, total - 1), end_with_period=True)]
        if not ignore_eos:
            parts.append(np.array([IM_END_ID], dtype=np.int64))
        ids = np.concatenate(parts)
        finish: dict[str, Any] = {"type": "stop", "matched": IM_END_ID}
        if stop_token_ids:
            hits = np.flatnonzero(np.isin(ids[:-1], np.asarray(stop_token_ids, dtype=np.int64)))
            if len(hits) and hits[0] + 1 >= min_new_tokens:
                ids = ids[: hits[0] + 1]
                finish = {"type": "stop", "matched": int(ids[-1])}
        if len(ids) > max_new_tokens:
            ids = ids[:max_new_tokens]
            finish = {"type": "length", "length": max_new_tokens}
        reasoning = 0
        if thinking:
            ends = np.flatnonzero(ids == THINK_END_ID)
            reasoning = int(ends[0]) + 1 if len(ends) else len(ids)
        return OutputPlan(ids=ids, finish_reason=finish, reasoning_tokens=reasoning)

    def _call(self, tools: list[dict[str, Any]]) -> IdArray:
        """An answer that is one tool call in the model's format (DATAGEN_STANDIN_TOOL_CALL_MATCH: which function)."""
        return np.array(self.tokenizer.encode(call_text(tools, self.knobs.tool_call_match)), dtype=np.int64)

    def cut_at_stop_strings(self, plan: OutputPlan, stops: list[str]) -> OutputPlan:
        """Shorten a plan to end at the token that completes the first stop string (SGLang's stop-string rule)."""
        if not stops:
            return plan

        def hit(n: int) -> bool:
            text = self.tokenizer.decode(plan.ids[:n].tolist(), skip_special_tokens=True)
            return any(s in text for s in stops)

        if not hit(len(plan.ids)):
            return plan
        lo, hi = 1, len(plan.ids)
        while lo < hi:  # the shortest prefix whose text contains a stop string (bisection: ~log2(n) decodes)
            mid = (lo + hi) // 2
            if hit(mid):
                hi = mid
            else:
                lo = mid + 1
        ids = plan.ids[:lo]
        text = self.tokenizer.decode(ids.tolist(), skip_special_tokens=True)
        matched = min((s for s in stops if s in text), key=text.find)
        reasoning = min(plan.reasoning_tokens, len(ids))
        return OutputPlan(ids=ids, finish_reason={"type": "stop", "matched": matched}, reasoning_tokens=reasoning)
