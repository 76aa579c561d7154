"""The stand-in's radix cache, as far as a client sees it: how many of a prompt's tokens this server holds.

SGLang's radix cache is per server process: a request's `meta_info.cached_tokens` is the longest prefix of its
input ids that this server's tree holds (from requests it ran before: their input and output ids), at most all but
the last input token (one is always prefilled), and 0 with `--disable-radix-cache`. The stand-in keeps the same
figure without a tree: a fingerprint of every prefix it stored (a polynomial hash over the ids, mod 2^64) in two
generations of about half the KV pool each, the older one dropped when the newer fills (an LRU at coarse grain:
it holds what SGLang's pool would, roughly). A cached prefix's own prefixes are always cached too, so the longest
match is a binary search.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["PrefixCache"]

_BASE = np.uint64(0x9E3779B97F4A7C15)  # odd: every power is a unit mod 2^64
_LENGTH = np.uint64(0xC2B2AE3D27D4EB4F)


def _fingerprints(ids: Sequence[int]) -> np.ndarray:
    """A fingerprint of each prefix of `ids` (entry i: ids[: i + 1]), the length mixed in."""
    if not ids:
        return np.zeros(0, dtype=np.uint64)
    tokens = np.asarray(ids, dtype=np.uint64) + np.uint64(1)
    n = len(tokens)
    with np.errstate(over="ignore"):
        powers = np.cumprod(np.full(n, _BASE, dtype=np.uint64), dtype=np.uint64)
        sums = np.cumsum(tokens * powers, dtype=np.uint64)
        return sums ^ (np.arange(1, n + 1, dtype=np.uint64) * _LENGTH)


class PrefixCache:
    """One server's prefixes held (module docstring); `capacity_tokens`: its KV pool."""

    def __init__(self, capacity_tokens: int, *, enabled: bool = True) -> None:
        self.enabled = enabled
        self.generation_tokens = max(1, capacity_tokens // 2)
        self._new: set[int] = set()
        self._old: set[int] = set()

    def match(self, ids: Sequence[int]) -> int:
        """Tokens of `ids` this server holds as a prefix (at most all but the last; 0 without the cache)."""
        if not self.enabled or len(ids) < 2:
            return 0
        prints = _fingerprints(ids[:-1])
        lo, hi = 0, len(prints)  # prefixes of length <= lo are held; of length > hi are not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            p = int(prints[mid - 1])
            if p in self._new or p in self._old:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def insert(self, ids: Sequence[int]) -> None:
        """A finished request's ids (input, then output but its last token: that one's KV was never computed)."""
        if not self.enabled or not ids:
            return
        self._new.update(_fingerprints(ids).tolist())
        if len(self._new) >= self.generation_tokens:
            self._old, self._new = self._new, set()
