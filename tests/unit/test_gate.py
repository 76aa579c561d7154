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


def test_a_reserved_shard_holds_back_later_positions_until_it_is_released() -> None:
    """A shard still reading its checkpoint keeps its place in the plan: a higher shard waiting first gets no turn."""
    gate = PlanOrderGate(1)
    admitted: list[tuple[int, ...]] = []

    def take(order: tuple[int, ...]) -> None:
        assert gate.acquire(order, timeout=30)
        admitted.append(order)
        gate.release()

    with gate.reserved((2,)):
        later = threading.Thread(target=take, args=((5, 0),))
        later.start()
        _wait_for(lambda: gate.waiting == 1)
        assert gate.acquire((5, 1), timeout=0.05) is False  # free capacity, and still held back
        take((1, 9))  # lower than the reservation: in at once
        take((2, 0))  # the reserved shard's own positions: in at once
        take((2, 149))
        assert admitted == [(1, 9), (2, 0), (2, 149)] and gate.waiting == 1
    later.join(30)
    assert admitted[-1] == (5, 0) and gate.held == 0 and gate.waiting == 0

    with gate.reserved((3,)), gate.reserved((1,)):  # the lowest reservation counts; both must go
        late = threading.Thread(target=take, args=((4,),))
        late.start()
        _wait_for(lambda: gate.waiting == 1)
    late.join(30)
    assert admitted[-1] == (4,)
