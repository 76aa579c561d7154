"""PlanOrderGate: the dispatcher's one admission mechanism (its queue and the preparation turn)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest

from datagen.engine.gate import GateClosed, PlanOrderGate


def _wait_for(predicate: Callable[[], bool], timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition never came true"
        time.sleep(0.005)


def test_raising_the_capacity_lets_waiters_in_lowest_plan_position_first_and_lowering_it_lets_none_in() -> None:
    gate = PlanOrderGate(2)
    assert gate.acquire((0,)) and gate.acquire((0,))  # full
    admitted: list[int] = []
    lock = threading.Lock()

    def wait(shard: int) -> None:
        assert gate.acquire((shard,), timeout=30)
        with lock:
            admitted.append(shard)

    threads = [threading.Thread(target=wait, args=(s,)) for s in (7, 3, 5, 1)]
    for i, t in enumerate(threads):
        t.start()
        _wait_for(lambda i=i: gate.waiting == i + 1)
    gate.set_capacity(4)  # two more places: the two lowest waiting positions get them
    _wait_for(lambda: len(admitted) == 2)
    assert sorted(admitted) == [1, 3] and gate.held == 4
    gate.set_capacity(1)  # lower than held: nobody new gets in until enough leave
    for _ in range(3):
        gate.release()
    assert gate.held == 1 and gate.waiting == 2 and len(admitted) == 2
    gate.release()  # below the capacity now: the next lowest gets the place
    _wait_for(lambda: len(admitted) == 3)
    assert admitted[2] == 5 and gate.held == 1
    gate.set_capacity(2)
    for t in threads:
        t.join(30)
    assert sorted(admitted[:2]) == [1, 3] and admitted[2:] == [5, 7]


def test_a_waiter_times_out_without_a_place_and_closing_wakes_the_rest() -> None:
    gate = PlanOrderGate(1)
    assert gate.acquire((0,))
    assert gate.acquire((1,), timeout=0.05) is False and gate.waiting == 0 and gate.held == 1
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            gate.acquire((2,))
        except GateClosed as exc:
            errors.append(exc)

    t = threading.Thread(target=wait)
    t.start()
    _wait_for(lambda: gate.waiting == 1)
    gate.close()
    t.join(30)
    assert len(errors) == 1
    with pytest.raises(GateClosed):
        gate.acquire((3,))
