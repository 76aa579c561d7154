"""Repetition that is the answer versus a loop: which tokens are words, and how much prose repeats.

A correct answer can repeat itself: a 12x12 zero matrix, a table, rows of code or data, separators, a chorus.
A degenerate loop repeats prose: the same sentence again and again, back to back or between other text. So
the rules tell the two apart by what repeats, not only by how much:

- structural: a repeated block whose tokens are mostly not words (digits, punctuation, markup, whitespace,
  code symbols) is the answer's structure when the completion finished (`stop`) and the block repeats at most
  `max_structural_copies` times; the same block until the token limit is still a loop.
- prose loops: the tokens inside prose 8-grams (at least 5 of 8 tokens are words) that occur `min_loop_copies`
  (5) times or more, wherever they are, must stay under `max_loop_coverage` of the completion. A chorus sung
  up to 4 times is not a loop by this rule; a sentence the model keeps coming back to is, interleaved or not.

Which tokens are words is read once per tokenizer from its vocabulary (`word_tokens`).
"""

from __future__ import annotations

import functools

import numpy as np

from datagen.chat import ChatTokenizer

__all__ = ["PROSE_WORDS", "ProseLoops", "prose_loops", "word_share", "word_tokens"]

PROSE_WORDS = 5  # an 8-gram is prose when at least this many of its tokens are words


def word_tokens(chat: ChatTokenizer) -> np.ndarray:
    """A bool per token id: its text (leading space stripped) is letters only, two or more, or one non-ASCII letter.

    One ASCII letter is not a word here: it is a matrix's `x`, a variable or an option letter far more often.
    """
    return _word_tokens(chat.model_dir.resolve().as_posix(), chat)


@functools.lru_cache(maxsize=4)
def _word_tokens(key: str, chat: ChatTokenizer) -> np.ndarray:
    del key  # the cache key: one table per model directory
    texts = chat.backend.decode_batch([[i] for i in range(chat.vocab_size)], skip_special_tokens=False)
    return np.fromiter((_word(t.strip()) for t in texts), dtype=bool, count=len(texts))


def _word(t: str) -> bool:
    return t.isalpha() and (len(t) > 1 or not t.isascii())


def _is_word(ids: np.ndarray, words: np.ndarray) -> np.ndarray:
    inside = ids < len(words)
    out = np.zeros(len(ids), dtype=bool)
    out[inside] = words[ids[inside]]
    return out


def word_share(ids: list[int], words: np.ndarray) -> float:
    """Share of `ids` that are word tokens (0 for none)."""
    if not ids:
        return 0.0
    return float(_is_word(np.asarray(ids, dtype=np.int64), words).mean())


class ProseLoops:
    """Tokens inside prose n-grams that occur `min_copies` times or more, and the most repeated one's position."""

    def __init__(self, covered: int, copies: int, first: int) -> None:
        self.covered = covered
        self.copies = copies  # occurrences of the most repeated prose n-gram
        self.first = first  # where it first occurs (token index)


def prose_loops(ids: list[int], words: np.ndarray, min_copies: int, n: int = 8) -> ProseLoops:
    """How much of `ids` lies in prose n-grams repeated `min_copies` times or more (back to back or not)."""
    size = len(ids)
    if size < n:
        return ProseLoops(0, 0, 0)
    a = np.asarray(ids, dtype=np.int64)
    windows = np.lib.stride_tricks.sliding_window_view(a, n).astype(np.uint64)
    weights = np.array([pow(1_000_003, k, 1 << 64) for k in range(n)], dtype=np.uint64)
    hashes = (windows * weights).sum(axis=1, dtype=np.uint64)
    prose = np.lib.stride_tricks.sliding_window_view(_is_word(a, words), n).sum(axis=1) >= PROSE_WORDS
    if not prose.any():
        return ProseLoops(0, 0, 0)
    _, inverse, counts = np.unique(hashes, return_inverse=True, return_counts=True)
    per_window = counts[inverse]
    hot = prose & (per_window >= min_copies)
    if not hot.any():
        return ProseLoops(0, 0, 0)
    # Tokens covered by any hot window: +1 where one starts, -1 where it ends.
    edges = np.zeros(size + 1, dtype=np.int64)
    starts = np.flatnonzero(hot)
    np.add.at(edges, starts, 1)
    np.add.at(edges, starts + n, -1)
    covered = int((np.cumsum(edges[:-1]) > 0).sum())
    top = int(np.argmax(np.where(hot, per_window, 0)))
    return ProseLoops(covered, int(per_window[top]), top)
