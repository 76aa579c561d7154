"""`PlanOrderGate`: up to `capacity` holders at once; waiters get in lowest plan position first (not first come).

The dispatcher uses it twice. Its queue is one: `submit` takes a place (capacity = the live queue limit, set
again whenever the servers change) and the place is given back once the request is sent. Request preparation
is the other (capacity 1, "the turn"): shard workers render and tokenize under it, so when the client is the
bottleneck (fast servers, a busy CPU) the lowest shards still advance first and finish first, and are validated
and tokenized while the rest still generate.

A waiter only gets in ahead of those that are waiting. A shard worker that is still reading its checkpoint when a
higher shard's worker asks for the turn is not waiting yet, so `reserved(prefix)` holds its place from the start:
while it is held, no waiter whose position comes after the prefix (and does not start with it) gets in. Without it,
a long-first plan's longest requests could miss the first wave and wait a whole generation for a free slot.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

__all__ = ["GateClosed", "PlanOrderGate"]


class GateClosed(RuntimeError):
    """The gate was closed while waiting (or before)."""


@dataclass(order=True, slots=True)
class _Waiter:
    """A thread waiting for a place: ordered by (plan position, arrival)."""

    key: tuple[tuple[int, ...], int]
    event: threading.Event = field(default_factory=threading.Event, compare=False)
    granted: bool = field(default=False, compare=False)


class PlanOrderGate:
    """A counting gate with a settable capacity whose waiters are let in by plan position; thread-safe."""

    def __init__(self, capacity: int = 1) -> None:
        self._lock = threading.Lock()
        self._capacity = max(1, capacity)
        self._held = 0
        self._waiting: list[_Waiter] = []
        self._reserved: list[tuple[int, ...]] = []  # sorted prefixes held by `reserved`
        self._tickets = itertools.count()
        self._closed = False

    @property
    def capacity(self) -> int:
        """Holders allowed at once."""
        with self._lock:
            return self._capacity

    @property
    def held(self) -> int:
        """Places taken now."""
        with self._lock:
            return self._held

    @property
    def waiting(self) -> int:
        """Threads waiting for a place now."""
        with self._lock:
            return len(self._waiting)

    def set_capacity(self, capacity: int) -> None:
        """Change the capacity (at least 1); a larger one lets waiters in at once, a smaller one lets none in."""
        with self._lock:
            self._capacity = max(1, capacity)
            self._grant()

    def acquire(self, order: tuple[int, ...], timeout: float | None = None) -> bool:
        """Take a place, waiting (lowest plan position first) while there is none; False after `timeout` s.

        Raises `GateClosed` when the gate is closed before a place was granted.
        """
        with self._lock:
            if self._closed:
                raise GateClosed("gate is closed")
            if not self._waiting and self._held < self._capacity and not self._held_back(order):
                self._held += 1
                return True
            me = _Waiter((order, next(self._tickets)))
            bisect.insort(self._waiting, me)
            self._grant()  # it may be first in line already (e.g. behind a reservation it is part of)
        me.event.wait(timeout)
        with self._lock:
            if me.granted:
                return True
            self._waiting.remove(me)
            self._grant()  # whoever was behind may fit now
            if self._closed:
                raise GateClosed("gate is closed")
            return False

    def release(self) -> None:
        """Give a place back; the lowest waiting plan position gets it."""
        with self._lock:
            self._held -= 1
            self._grant()

    def close(self) -> None:
        """Wake every waiter without a place (they raise `GateClosed`); later acquires raise too."""
        with self._lock:
            self._closed = True
            for waiter in self._waiting:
                waiter.event.set()

    @contextlib.contextmanager
    def reserved(self, prefix: tuple[int, ...]) -> Iterator[None]:
        """Hold back every waiter whose position comes after `prefix` and does not start with it, for the block."""
        with self._lock:
            bisect.insort(self._reserved, prefix)
        try:
            yield
        finally:
            with self._lock:
                self._reserved.remove(prefix)
                self._grant()

    @contextlib.contextmanager
    def __call__(self, order: tuple[int, ...]) -> Iterator[None]:
        """Hold a place for the block: `with gate(order): ...`."""
        self.acquire(order)
        try:
            yield
        finally:
            self.release()

    def _held_back(self, order: tuple[int, ...]) -> bool:
        """A reservation comes before `order` (caller holds the lock)."""
        return bool(self._reserved) and self._reserved[0] < order[: len(self._reserved[0])]

    def _grant(self) -> None:
        """Let waiters in, lowest plan position first, while there is room (caller holds the lock)."""
        while self._waiting and self._held < self._capacity and not self._closed:
            if self._held_back(self._waiting[0].key[0]):
                return
            first = self._waiting.pop(0)
            first.granted = True
            self._held += 1
            first.event.set()
