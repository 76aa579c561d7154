"""The chain-aware perfect-client bound (tasks/chains.py): single-step chains give the FIFO bound, policies rank."""

from __future__ import annotations

import random

import pytest

from tasks.chains import POLICIES, Chain, DecodeModel, simulate_chains, simulate_wall

MODEL = DecodeModel(0.004, 0.0002)
FLAT = DecodeModel(1.0, 0.0)  # one token per second per running request, whatever the batch


# The FIFO bound of single requests as `tasks.pilot.simulate_slots` computed it (main at 2fc14b0, its own loop, now
# replaced by one-step chains): (servers, slots, n) -> (wall_s, last_start_s, tokens_at_last_start, output tokens).
FIFO_FIGURES = {
    (1, 1, 5): (5.796, 5.7834, 1377.0, 1380),
    (2, 4, 37): (40.0004, 12.873600000000001, 21196.0, 34092),
    (8, 16, 300): (20.96320000000001, 5.623200000000008, 99968.0, 191722),
    (3, 64, 100): (22.3808, 0.0, 0.0, 59509),
}


@pytest.mark.parametrize("policy", ["plan_order_successors_first", "ready_fifo", "most_turns_first"])
@pytest.mark.parametrize(("servers", "slots", "n"), list(FIFO_FIGURES))
def test_single_step_chains_equal_the_fifo_bound(policy: str, servers: int, slots: int, n: int) -> None:
    rng = random.Random(n * 31 + slots)
    lengths = [max(0, int(rng.lognormvariate(6, 1.0))) for _ in range(n)] + [0, 3]
    run = simulate_chains([Chain((x,)) for x in lengths], servers, slots, MODEL, policy)  # type: ignore[arg-type]
    wall, last_start, tokens_at_last_start, total = FIFO_FIGURES[(servers, slots, n)]
    assert (run.wall_s, run.last_start_s, run.tokens_at_last_start) == (wall, last_start, tokens_at_last_start)
    assert run.output_tokens == total == sum(lengths)
    assert simulate_wall(lengths, servers, slots, MODEL) == run.wall_s
    assert [i for i, _ in run.started] == list(range(len(lengths)))  # plan order, one start each


def test_single_step_oracle_is_the_long_first_bound() -> None:
    rng = random.Random(3)
    lengths = [int(rng.lognormvariate(6, 1.0)) + 1 for _ in range(200)]
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    expected = simulate_wall([lengths[i] for i in order], 4, 8, MODEL)
    run = simulate_chains([Chain((x,)) for x in lengths], 4, 8, MODEL, "oracle_longest_first")
    assert run.wall_s == pytest.approx(expected)
    assert [i for i, _ in run.started] == order


def test_a_step_waits_for_its_predecessor() -> None:
    run = simulate_chains([Chain((5, 7, 3))], 2, 8, FLAT)
    assert run.wall_s == pytest.approx(15.0)  # free slots everywhere, yet one step at a time
    assert run.started == ((0, 0), (0, 1), (0, 2))
    assert run.utilization == pytest.approx(15 / (15 * 2 * 8))


def test_the_long_chain_last_in_plan_order() -> None:
    # Three one-step conversations, then one of three steps: 2 slots, one token per second each.
    chains = [Chain((10,)), Chain((10,)), Chain((10,)), Chain((10, 10, 10), turns=3)]
    walls = {p: simulate_chains(chains, 1, 2, FLAT, p).wall_s for p in POLICIES}
    # Plan order (and FIFO) start the chain at t=10 and end on it alone: 40 s. Ranking it by work left, steps
    # left or turns starts it at once: 30 s, the 60 tokens over 2 slots.
    assert walls["plan_order_successors_first"] == pytest.approx(40.0)
    assert walls["ready_fifo"] == pytest.approx(40.0)
    for policy in ("most_turns_first", "most_steps_left", "expected_work_left", "oracle_longest_first"):
        assert walls[policy] == pytest.approx(30.0), policy


def test_successors_first_against_fifo() -> None:
    # A successor goes ahead of a conversation that has not started under successors-first, not under FIFO.
    chains = [Chain((4, 4)), Chain((4,)), Chain((4,))]
    first = simulate_chains(chains, 1, 2, FLAT, "plan_order_successors_first").started
    fifo = simulate_chains(chains, 1, 2, FLAT, "ready_fifo").started
    assert first == ((0, 0), (1, 0), (0, 1), (2, 0))
    assert fifo == ((0, 0), (1, 0), (2, 0), (0, 1))


def test_expected_work_left_follows_the_expected_lengths_not_the_step_count() -> None:
    # Many short steps against two long ones: counting steps opens the short chain first, the lengths do not.
    short = Chain((1, 1, 1, 1), turns=4, expected=(1.0, 1.0, 1.0, 1.0))
    long_ = Chain((20, 20), turns=2, expected=(20.0, 20.0))
    filler = Chain((15,), turns=1, expected=(15.0,))
    chains = [filler, short, long_]
    by_steps = simulate_chains(chains, 1, 1, FLAT, "most_steps_left").started
    by_work = simulate_chains(chains, 1, 1, FLAT, "expected_work_left").started
    assert by_steps[0] == (1, 0)
    assert by_work[0] == (2, 0)
    # Re-ranked as each step ends: with one slot the long chain's second step (20 left) still beats the filler.
    assert by_work[:3] == ((2, 0), (2, 1), (0, 0))


def test_expected_work_left_with_true_lengths_is_the_oracle() -> None:
    rng = random.Random(11)
    chains = []
    for _ in range(120):
        steps = tuple(int(rng.lognormvariate(5.5, 0.8)) + 1 for _ in range(rng.randint(1, 5)))
        chains.append(Chain(steps, turns=len(steps), expected=tuple(float(x) for x in steps)))
    oracle = simulate_chains(chains, 2, 8, MODEL, "oracle_longest_first")
    known = simulate_chains(chains, 2, 8, MODEL, "expected_work_left")
    assert known.started == oracle.started
    assert known.wall_s == oracle.wall_s
    plan = simulate_chains(chains, 2, 8, MODEL, "plan_order_successors_first")
    assert plan.output_tokens == oracle.output_tokens == sum(sum(c.steps) for c in chains)
