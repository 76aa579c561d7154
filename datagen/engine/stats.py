"""The dispatcher's counters as a snapshot (`DispatcherStats`, one `ServerStats` per server) and their log line.

Kept apart from the dispatcher: it only fills them in; what they mean to a reader lives here.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DispatcherStats", "ServerStats"]


@dataclass(frozen=True, slots=True)
class ServerStats:
    """One server's state and progress."""

    name: str
    state: str  # "starting" | "up" | "down" | "fatal"
    capacity: int  # running slots: read from the server, or seeded from provisioning until it is contacted
    target: int  # requests the dispatcher keeps in flight there (capacity + a small queue, less when it lags)
    in_flight: int  # requests sent to it and not answered yet (running + waiting in its own queue)
    waiting: int | None  # requests waiting in the server's own queue (its /v1/loads); None until read
    completed: int
    output_tokens: int
    tokens_per_s: float
    last_error: str
    running: int | None = None  # requests the server says it runs (its /v1/loads); None until read

    def part(self) -> str:
        """Its part of the progress line: `gpu0 up, 68/68 in flight (64 running, 4 queued there), 12.8k tok/s`."""
        if self.running is None or self.waiting is None:
            there = "server load not read yet"
        else:
            there = f"{self.running} running, {self.waiting} queued there"
        rate = _si(self.tokens_per_s)
        return f"{self.name} {self.state}, {self.in_flight}/{self.target} in flight ({there}), {rate} tok/s"


@dataclass(frozen=True, slots=True)
class DispatcherStats:
    """A snapshot of the dispatcher's counters (thread-safe copy)."""

    elapsed_s: float
    submitted: int
    completed: int
    rejected: int
    failed: int
    retries: int
    requeued: int
    output_tokens: int
    queued: int
    in_flight: int
    completions_per_s: float
    output_tokens_per_s: float
    eta_s: float | None
    servers: list[ServerStats]
    to_submit: int = 0  # announced by shard workers (`add_expected`) and not handed to `submit` yet
    queue_limit: int = 0  # most requests the queue holds before `submit` blocks (live figure)
    blocked_submitters: int = 0  # threads waiting in `submit` for room in the queue
    prompt_tokens: int = 0  # of the finished requests
    cached_tokens: int = 0  # of those prompt tokens, found in the server's radix cache (`meta_info.cached_tokens`)
    affine: int = 0  # steps sent to the server that served their conversation's previous step (prefix affinity)
    affinity_missed: int = 0  # steps with such a server up that went elsewhere (it stayed full past the wait)

    @property
    def cache_hit_rate(self) -> float | None:
        """Share of the finished requests' prompt tokens the servers' radix caches held (None before any)."""
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def underfed(self) -> list[str]:
        """Up servers with room for more while requests wait to be sent: the servers run below what they could."""
        if not (self.queued or self.to_submit):
            return []
        return [s.name for s in self.servers if s.state == "up" and s.in_flight < s.target]

    def line(self) -> str:
        """One log line, e.g.::

            generation: 1,234 done, 3 rejected, 0 failed; 1,700 to submit, 608 queued (limit 608, 12 shard workers
            waiting for room), 544 in flight; 98.1k tok/s, 66.00 req/s, 0 retries, ETA 0.4 min | gpu0 up, 68/68 in
            flight (64 running, 4 queued there), 12.8k tok/s; gpu1 ...

        Fields: done / rejected (the server refused the prompt) / failed (no result: retries used up, stall);
        to submit: requests the shard workers announced and have not handed to the dispatcher yet; queued: handed
        to the dispatcher, not yet sent to a server (retries waiting out their backoff included); limit: how many
        the queue takes before shard workers block (one round of every server's capacity plus its small queue),
        and how many are blocked on it now; in flight: sent, not answered. Rates are over the last minute; ETA
        from that rate. Per server: state (starting, up, down, fatal), in flight / the number the dispatcher
        keeps there, what the server itself reports running and queued (its /v1/loads, polled every few
        seconds), its output tokens/s. `UNDERFED` names up servers below their number while requests wait: the
        servers are not being kept full.
        """
        eta = f"{self.eta_s / 60:.1f} min" if self.eta_s is not None else "?"
        waiting = f", {self.blocked_submitters} shard workers waiting for room" if self.blocked_submitters else ""
        text = (
            f"generation: {self.completed:,} done, {self.rejected:,} rejected, {self.failed:,} failed; "
            f"{self.to_submit:,} to submit, {self.queued:,} queued (limit {self.queue_limit:,}{waiting}), "
            f"{self.in_flight:,} in flight; {_si(self.output_tokens_per_s)} tok/s, {self.completions_per_s:.2f} "
            f"req/s, {self.retries:,} retries, ETA {eta} | " + "; ".join(s.part() for s in self.servers)
        )
        if self.cached_tokens or self.affine or self.affinity_missed:
            rate = self.cache_hit_rate or 0.0
            text += (
                f" | prefix cache: {rate:.1%} of prompt tokens cached; {self.affine:,} steps to their "
                f"conversation's server, {self.affinity_missed:,} elsewhere"
            )
        underfed = self.underfed
        if underfed:
            text += f" | UNDERFED: {', '.join(underfed)} below their number while requests wait"
        return text


def _si(x: float) -> str:
    """12784 -> 12.8k, 950 -> 950."""
    return f"{x / 1000:.1f}k" if x >= 1000 else f"{x:.0f}"
