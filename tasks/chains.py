"""A perfect client's bound for conversations: chains of steps on `servers` x `slots`, one policy for what goes next.

In `turns: every` mode a conversation is a chain of generations ("steps"): step k+1 is conditioned on step k's
output, so it cannot start before step k has ended. `simulate_chains` decodes such chains on a server model (every
running request advances one token per `DecodeModel.step_s(batch)`; a freed slot is refilled at once), choosing
among the steps that are ready by a `Policy`:

    plan_order_successors_first  a step of a conversation under way first, then new conversations in plan order
                                 (what the shard driver did before it ranked by work left)
    ready_fifo                   steps in the order they became ready (plan order among ties)
    most_turns_first             conversations with the most user turns first (known from the recording)
    most_steps_left              the step whose conversation has the most steps left, re-ranked as each ends
    expected_work_left           the most expected tokens left: remaining steps times their expected lengths (what
                                 a run knows before generating: the recording's turns and tool rounds, the
                                 pilot's mean step lengths); the shard driver's policy
    oracle_longest_first         the most true tokens left (needs the outputs: a bound no run can reach)

Ties go to plan order (the chain's index). With chains of one step, `plan_order_successors_first` and `ready_fifo`
dispatch in plan order: the single-request bound (`simulate_wall`, the pilot's single-turn projection).
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

from datagen.conversation.turn_mode import work_left

__all__ = ["POLICIES", "Chain", "ChainRun", "DecodeModel", "Policy", "simulate_chains", "simulate_wall"]

Policy = Literal[
    "plan_order_successors_first",
    "ready_fifo",
    "most_turns_first",
    "most_steps_left",
    "expected_work_left",
    "oracle_longest_first",
]
POLICIES: tuple[Policy, ...] = (
    "plan_order_successors_first",
    "ready_fifo",
    "most_turns_first",
    "most_steps_left",
    "expected_work_left",
    "oracle_longest_first",
)


@dataclass(frozen=True, slots=True)
class DecodeModel:
    """Time per decode step (every running request advances one token) as a function of the batch B.

    step_s(B) = step_base_s + step_per_req_s * B, the shape of both SGLang's memory-bound decode and the stand-in's
    timing model. Per-server throughput at batch B is B / step_s(B); a lone request decodes at 1 / step_s(1).
    """

    step_base_s: float
    step_per_req_s: float

    def step_s(self, batch: int) -> float:
        return self.step_base_s + self.step_per_req_s * batch

    def tokens_per_s(self, batch: int) -> float:
        return batch / self.step_s(batch)


@dataclass(frozen=True, slots=True)
class Chain:
    """One conversation: its steps' true output lengths, in order, and what a run knows of it beforehand."""

    steps: tuple[int, ...]
    turns: int = 1  # user turns in the recording
    expected: tuple[float, ...] | None = None  # each step's expected length (None: every step counts 1)

    def expected_left(self, step: int) -> float:
        """Expected tokens of steps `step`, `step` + 1, ... (the step about to start included): the shard driver's
        rank (`datagen.conversation.turn_mode.work_left`), or the true steps left when nothing is expected."""
        return work_left(self.expected, step) if self.expected is not None else float(len(self.steps) - step)


@dataclass(frozen=True, slots=True)
class ChainRun:
    """What `simulate_chains` found: the wall time, when and after how many tokens the last step started, tokens."""

    wall_s: float
    last_start_s: float  # no step is ready after this (the tail starts)
    tokens_at_last_start: float
    output_tokens: int
    utilization: float  # output tokens / (wall x every server's full-batch rate)
    started: tuple[tuple[int, int], ...]  # (chain, step) in the order they started


# A ready step's rank (lowest first) from (chain index, step index, the ready counter, the chain).
_Rank = Callable[[int, int, int, Chain], tuple[float, ...]]
_RANKS: dict[Policy, _Rank] = {
    "plan_order_successors_first": lambda i, s, seq, c: (0 if s else 1, i),
    "ready_fifo": lambda i, s, seq, c: (seq, i),
    "most_turns_first": lambda i, s, seq, c: (-c.turns, i),
    "most_steps_left": lambda i, s, seq, c: (-(len(c.steps) - s), i),
    "expected_work_left": lambda i, s, seq, c: (-c.expected_left(s), i),
    "oracle_longest_first": lambda i, s, seq, c: (-sum(c.steps[s:]), i),
}


def simulate_chains(
    chains: Sequence[Chain], servers: int, slots: int, model: DecodeModel, policy: Policy = "ready_fifo"
) -> ChainRun:
    """Decode `chains` (in plan order) on `servers` x `slots`, every slot refilled at once from the ready steps.

    A step becomes ready when its predecessor ends (the first step of every chain at t=0); a freed slot takes the
    ready step that `policy` ranks first. The first wave is spread round-robin over the servers, as a dispatcher
    spreads the first requests; afterwards each server, in turn, refills its free slots.
    """
    rank = _RANKS[policy]
    # First steps wait in `opening`, sorted once by their rank (static: nothing has run yet); successors enter the
    # `ready` heap as their predecessors end. The best of both goes next, so a million one-step chains (the
    # single-turn projection) cost one sort, not a heap of a million.
    firsts = [i for i, c in enumerate(chains) if c.steps]
    opening = sorted((rank(i, 0, seq, chains[i]), i, 0) for seq, i in enumerate(firsts))
    seq = len(opening)
    opened = 0
    ready: list[tuple[tuple[float, ...], int, int]] = []  # (rank, chain, step)

    def make_ready(i: int, s: int) -> None:
        nonlocal seq
        heapq.heappush(ready, (rank(i, s, seq, chains[i]), i, s))
        seq += 1

    heaps: list[list[tuple[float, int, int]]] = [[] for _ in range(servers)]  # (progress at its end, chain, step)
    progress = [0.0] * servers
    t = tokens = last_start = tokens_at_last_start = 0.0
    started: list[tuple[int, int]] = []

    def take(k: int) -> bool:
        """Start the best ready step on server `k`; False when none is ready."""
        nonlocal last_start, tokens_at_last_start, opened
        if ready and (opened == len(opening) or ready[0] < opening[opened]):
            _, i, s = heapq.heappop(ready)
        elif opened < len(opening):
            _, i, s = opening[opened]
            opened += 1
        else:
            return False
        last_start, tokens_at_last_start = t, tokens
        started.append((i, s))
        n = chains[i].steps[s]
        if n > 0:
            heapq.heappush(heaps[k], (progress[k] + n, i, s))
        elif s + 1 < len(chains[i].steps):  # an empty step ends as it starts: its successor is ready now
            make_ready(i, s + 1)
        return True

    def fill(k: int) -> None:
        while len(heaps[k]) < slots and take(k):
            pass

    for _ in range(slots):
        for k in range(servers):
            if len(heaps[k]) < slots and not take(k):
                break
    for k in range(servers):
        fill(k)
    while True:
        active = [k for k in range(servers) if heaps[k]]
        if not active:
            break
        dt = min((heaps[k][0][0] - progress[k]) * model.step_s(len(heaps[k])) for k in active)
        t += dt
        for k in active:  # each server in turn advances, its ended steps' successors become ready, it refills
            advanced = dt / model.step_s(len(heaps[k]))
            progress[k] += advanced
            tokens += advanced * len(heaps[k])
            while heaps[k] and heaps[k][0][0] <= progress[k] + 1e-9:
                _, i, s = heapq.heappop(heaps[k])
                if s + 1 < len(chains[i].steps):
                    make_ready(i, s + 1)
            fill(k)
        for k in range(servers):  # an idle server, or one that refilled before a later one's step ended
            fill(k)
    total = sum(sum(c.steps) for c in chains)
    full_rate = servers * model.tokens_per_s(slots)
    utilization = total / (t * full_rate) if t > 0 else 0.0
    return ChainRun(t, last_start, tokens_at_last_start, total, utilization, tuple(started))


def simulate_wall(lengths: Sequence[int], servers: int, slots: int, model: DecodeModel) -> float:
    """Seconds to decode single requests dispatched in this order (one-step chains, FIFO) onto `servers` x `slots`."""
    return simulate_chains([Chain((n,)) for n in lengths], servers, slots, model, "ready_fifo").wall_s
