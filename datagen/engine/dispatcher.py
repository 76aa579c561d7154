"""One continuous dispatcher per box: keeps every server full, retries what is worth retrying.

All shard workers submit into one shared queue, so the servers never drain at a shard boundary. The queue
is ordered by each job's plan position (`GenerateJob.order`), so concurrent shard workers cannot reorder the
plan (long outputs first); requeued and retried requests go ahead of new ones.

Back-pressure lives here and nowhere else: `submit` takes a place at a `PlanOrderGate` (gate.py) whose
capacity is `queue_limit`, a live figure (one round of every live server's running capacity plus its small
queue) that follows what the dispatcher learns: capacities seeded from provisioning
(`ServerEndpoint.max_running_requests`), then read from each server, and servers going down (their share
leaves the limit) or coming back. The place is given back once the request is sent. Callers keep no window of
their own, so none can freeze a figure learned later. Blocked submitters are let in lowest plan position first.

The dispatcher runs its own asyncio loop in a background thread; `submit` is thread-safe and returns a
`concurrent.futures.Future` that ends with a `GenerateResult` or one of these errors:

- `RequestRejected`: the server refused this prompt (reject row, never retried);
- `ProtocolError`: the server's answers for this request were garbage `max_protocol_errors` times;
- `RetriesExhausted`: transient failures (5xx, timeouts) `max_attempts` times on servers that stayed up;
- `AuthError`: every server refused the API key;
- `EngineStalled`: no server finished anything for `stall_timeout_s` (message names servers and log tails);
- `DispatcherClosed`: the dispatcher was closed first.

A server that refuses connections, or that drops one or times out repeatedly and then fails its health
probe, is marked down; its in-flight requests go back to the front of the queue (without using up their
attempts) and it is probed until healthy again.

A hung server (a frozen process, a stuck scheduler) neither refuses nor answers: it is found by its lack of
progress, not its latency. With requests there, a server that finished none and whose scheduler published no
new `/v1/loads` snapshot (SGLang stamps each with the scheduler's time; the HTTP side answers even while the
scheduler is stuck) for `hang_timeout_s` is marked down and its requests are queued again, their attempts
there left running: whichever answer arrives first settles a request, once, and the other is dropped. A
slow, loaded server keeps finishing requests and publishing snapshots, so it is never taken for hung.
Detection takes at most `hang_timeout_s` plus one watchdog tick (1 s); the requeued requests then go out at
once wherever there is room.

Prefix affinity (every-turn conversations, `GenerateJob.affinity`): SGLang's radix cache is per server process,
so a conversation's step k+1, whose prompt extends step k's prompt and output, re-uses that prefix only on the
server that ran step k (`meta_info.cached_tokens` says how much it found). A server keeps the cache unless its
/server_info says `disable_radix_cache`. The rule, for a step's first attempt whose conversation's previous step
finished on such a server still up since (a server that goes down drops its affinities: a restart's cache is
empty):

- that server has a free slot: the step goes there, before anything behind it in the queue;
- it has none: the step waits for it, keeping its place in the queue, while work behind it takes the free slots
  elsewhere; once no queued work is left to use a free slot elsewhere, it goes there rather than idle that slot;
  and after `affinity_wait_s` (about the re-prefill it would save: seconds; `DATAGEN_AFFINITY_WAIT_S` in a run) it
  goes wherever a slot frees first.

So no slot idles while a step waits (occupancy as without affinity), no step waits past the bound (no
starvation), and the queue order holds among the steps that can be sent. Retries and requeued steps, and jobs
without `affinity` (`turns: last`), go as before. The stats count the prompt tokens found cached
(`cache_hit_rate`) and the steps sent to their conversation's server or elsewhere.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import heapq
import itertools
import logging
import random
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from datagen.engine.client import (
    AuthError,
    EngineError,
    GenerateResult,
    LoadInfo,
    ProtocolError,
    RequestRejected,
    ServerUnreachable,
    SGLangClient,
    TransientError,
)
from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.gate import GateClosed, PlanOrderGate
from datagen.engine.memory_plan import QUEUED_PER_SERVER
from datagen.engine.stats import DispatcherStats, ServerStats
from datagen.operations.redact import redact_text

__all__ = [
    "Dispatcher",
    "DispatcherClosed",
    "EngineStalled",
    "GenerateJob",
    "RetriesExhausted",
    "SubmitTimeout",
    "backoff_delay",
]

logger = logging.getLogger("datagen.engine")

ClientFactory = Callable[[ServerEndpoint], SGLangClient]


class EngineStalled(EngineError):
    """No server finished a request for too long."""


class RetriesExhausted(EngineError):
    """A request failed transiently on every attempt."""


class DispatcherClosed(EngineError):
    """The dispatcher was closed before the request finished."""


class SubmitTimeout(TimeoutError):
    """`submit(..., timeout=)` found no room in the dispatcher's queue in time (nothing was queued)."""


@dataclass(frozen=True, slots=True)
class GenerateJob:
    """One request to run: prompt token ids and `sampling_params` (see `sampling_params_for`)."""

    input_ids: list[int]
    sampling: dict[str, Any]
    label: str = ""  # e.g. the prompt id; only for log lines
    # Plan position, e.g. (shard, row): lower goes out first, whichever thread submitted it and when. Shard
    # workers submit concurrently, so without it the plan's order (long outputs first) would be interleaved away.
    order: tuple[int, ...] = ()
    # The conversation this step belongs to ("" for none): a step after its conversation's first goes to the server
    # that served the one before, whose radix cache holds its prefix (module docstring, "Prefix affinity").
    affinity: str = ""


@dataclass(eq=False, slots=True)
class _Work:
    job: GenerateJob
    future: concurrent.futures.Future[GenerateResult]
    attempts: int = 0  # transient failures charged to this request
    protocol_errors: int = 0
    drops: int = 0  # dropped connections (not charged unless they keep happening)
    started: bool = False
    last_server: str = ""
    errors: list[str] = field(default_factory=list)
    seq: int = 0  # arrival number: ties in job.order go first come, first served
    counted: bool = True  # holds a place under queue_limit (until first sent, or done without being sent)
    waiting: bool = False  # in the queue now (never twice)
    # Attempts running now and where: usually one; more while a hung server's attempt runs on beside its copy.
    running: dict[asyncio.Task[None], _ServerState] = field(default_factory=dict)
    home: _Home | None = None  # the server that served its conversation's previous step (prefix affinity)
    held_since: float | None = None  # when it first waited for its home server's free slot

    def queue_key(self, requeued: bool) -> tuple[int, tuple[int, ...], int]:
        # Requeued work (its server went down, or a retry came due) goes before anything not yet started.
        return (0 if requeued else 1, self.job.order, self.seq)


@dataclass(eq=False, slots=True)
class _ServerState:
    endpoint: ServerEndpoint
    client: SGLangClient
    state: str = "starting"
    capacity: int = 0
    target: int = 0
    inflight: dict[asyncio.Task[None], _Work] = field(default_factory=dict)
    load: LoadInfo | None = None
    consecutive_failures: int = 0
    checking: bool = False
    probing: bool = False
    completed: int = 0
    output_tokens: int = 0
    speed: float | None = None  # per-request decode tok/s (EMA of completion_tokens / e2e_latency)
    alive_at: float = 0.0  # last sign of progress: an answer to a request, or its scheduler publishing a load
    sched_stamp: float | None = None  # newest scheduler timestamp read from its /v1/loads
    recent: collections.deque[tuple[float, int]] = field(default_factory=collections.deque)
    last_error: str = ""
    radix_cache: bool = True  # keeps its radix (prefix) cache (its /server_info), so affinity pays there
    epoch: int = 0  # times it went down: an affinity made before (its radix cache then) is void

    @property
    def name(self) -> str:
        return self.endpoint.name

    @property
    def free(self) -> int:
        return self.target - len(self.inflight) if self.state == "up" else 0


@dataclass(frozen=True, slots=True)
class _Home:
    """Where a conversation's previous step ran: valid while that server stays up since (same epoch)."""

    server: _ServerState
    epoch: int

    @property
    def valid(self) -> bool:
        return self.server.state == "up" and self.server.epoch == self.epoch and self.server.radix_cache


_RATE_WINDOW_S = 60.0
_HOMES_KEPT = 4096  # conversations whose last server is remembered, at least (else 16 rounds of the queue)


def backoff_delay(attempt: int, base_s: float, cap_s: float, rng: random.Random) -> float:
    """Capped exponential backoff with jitter: uniform in [0.5, 1] x min(cap, base * 2^(attempt-1))."""
    # Jitter spreads the retries of requests that failed together (a server restart) over time.
    ceiling: float = min(cap_s, base_s * 2.0 ** max(attempt - 1, 0))
    return ceiling * rng.uniform(0.5, 1.0)


def _tail(path: str | None, lines: int = 10) -> str:
    """The last lines of a server log, for failure messages."""
    if not path:
        return ""
    try:
        with open(path, "rb") as f:
            f.seek(0, 2)
            size = f.tell()
            f.seek(max(0, size - 8192))
            text = f.read().decode("utf-8", "replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class Dispatcher:
    """Keeps each server at its running capacity plus a small queue, fed from one shared queue."""

    def __init__(
        self,
        endpoints: list[ServerEndpoint],
        *,
        queue_depth: int = QUEUED_PER_SERVER,  # the memory plan's radix-cache trade assumes it
        queue_rounds: int = 1,
        max_attempts: int = 8,
        max_protocol_errors: int = 3,
        backoff_base_s: float = 0.5,
        backoff_max_s: float = 30.0,
        stall_timeout_s: float = 900.0,
        hang_timeout_s: float = 30.0,
        timeout_floor_s: float = 600.0,
        timeout_factor: float = 4.0,
        assumed_tokens_per_s: float = 5.0,
        failures_before_probe: int = 3,
        probe_interval_s: float = 5.0,
        load_poll_interval_s: float = 2.0,
        log_interval_s: float = 30.0,
        default_capacity: int = 32,
        max_connections_per_server: int = 1024,
        affinity_wait_s: float = 2.0,
        on_server_down: Callable[[ServerEndpoint], None] | None = None,
        client_factory: ClientFactory | None = None,
        seed: int | None = None,
    ) -> None:
        if not endpoints:
            raise ValueError("Dispatcher needs at least one endpoint")
        if len({e.name for e in endpoints}) != len(endpoints):
            raise ValueError("endpoint names must be unique")
        self.queue_depth = queue_depth
        self.queue_rounds = queue_rounds
        self.max_attempts = max_attempts
        self.max_protocol_errors = max_protocol_errors
        self.backoff_base_s = backoff_base_s
        self.backoff_max_s = backoff_max_s
        self.stall_timeout_s = stall_timeout_s
        self.hang_timeout_s = hang_timeout_s
        self.timeout_floor_s = timeout_floor_s
        self.timeout_factor = timeout_factor
        self.assumed_tokens_per_s = assumed_tokens_per_s
        self.failures_before_probe = failures_before_probe
        self.probe_interval_s = probe_interval_s
        self.load_poll_interval_s = load_poll_interval_s
        self.log_interval_s = log_interval_s
        self.default_capacity = default_capacity
        self.max_connections_per_server = max_connections_per_server
        self.affinity_wait_s = affinity_wait_s
        self.on_server_down = on_server_down
        self._rng = random.Random(seed)
        factory = client_factory or (lambda e: SGLangClient(e, max_connections=max_connections_per_server))

        # Capacity known from provisioning (its /server_info) seeds the server until the dispatcher reads it itself.
        self._servers = [
            _ServerState(endpoint=e, client=factory(e), capacity=e.max_running_requests or 0) for e in endpoints
        ]
        # Waiting requests as a heap of (Work.queue_key(), work): plan order, requeued work first.
        self._pending: list[tuple[tuple[int, tuple[int, ...], int], _Work]] = []
        self._arrivals = itertools.count()
        self._delayed: dict[_Work, asyncio.TimerHandle] = {}
        self._background: set[asyncio.Task[Any]] = set()
        self._closed = False
        self._ready = threading.Event()
        self._started = time.monotonic()
        self._last_progress = time.monotonic()
        self._done_times: collections.deque[tuple[float, int]] = collections.deque()
        self._c = collections.Counter[str]()
        self._fatal: EngineError | None = None  # the error that took the last server out for good
        # Prefix affinity: conversation -> the server of its last finished step, oldest first; taken by its next
        # step when queued. A conversation that ended leaves its entry until `_HOMES_KEPT` newer ones push it out.
        self._homes: collections.OrderedDict[str, _Home] = collections.OrderedDict()
        self._hold_timer: asyncio.TimerHandle | None = None
        # Back-pressure: a place per request accepted and not sent yet, as many as the live queue limit; blocked
        # submitters get in lowest plan position first. `_counted_lock` makes giving a place back idempotent.
        self._room = PlanOrderGate(self._compute_queue_limit())
        self._counted_lock = threading.Lock()
        # Request preparation in plan order (see gate.py): `with dispatcher.turn(job_order): ...`.
        self.turn = PlanOrderGate(1)

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="datagen-dispatcher", daemon=True)
        self._thread.start()

    # --- public, thread-safe ---------------------------------------------------------------------

    def submit(self, job: GenerateJob, *, timeout: float | None = None) -> concurrent.futures.Future[GenerateResult]:
        """Queue one request once the queue has room (blocks meanwhile); callable from any thread.

        Raises `SubmitTimeout` when no room came within `timeout` seconds (nothing was queued), and
        `DispatcherClosed` once the dispatcher is closed.
        """
        self._admit(job.order, timeout)
        fut: concurrent.futures.Future[GenerateResult] = concurrent.futures.Future()
        work = _Work(job=job, future=fut)
        # Frees the place however the request ends without being sent (cancelled while queued, failed early).
        fut.add_done_callback(lambda _: self._release(work))
        try:
            self._loop.call_soon_threadsafe(self._enqueue, work)
        except RuntimeError as exc:  # loop already stopped by close()
            self._release(work)
            raise DispatcherClosed("dispatcher is closed") from exc
        return fut

    def add_expected(self, n: int) -> None:
        """Announce `n` more requests to come, or `-n` fewer than announced (for `to_submit` and the ETA only)."""
        self._loop.call_soon_threadsafe(self._c.update, {"expected": n})

    def wait_ready(self, timeout_s: float = 60.0) -> bool:
        """Block until every server was contacted once; True when at least one is up."""
        self._ready.wait(timeout_s)
        return any(s.state == "up" for s in self._servers)

    @property
    def queue_limit(self) -> int:
        """Requests the queue takes before `submit` blocks (now: it follows what the dispatcher learns)."""
        return self._room.capacity

    def stats(self) -> DispatcherStats:
        """A consistent snapshot of the counters."""
        return asyncio.run_coroutine_threadsafe(self._snapshot(), self._loop).result(timeout=30)

    def close(self) -> None:
        """Fail whatever is still pending, close connections and stop the loop thread."""
        if self._closed:
            return
        self._closed = True
        self._room.close()  # blocked submitters wake without a place: they raise DispatcherClosed
        try:
            asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=30)

    def __enter__(self) -> Dispatcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # --- back-pressure (any thread) -----------------------------------------------------------------

    def _admit(self, order: tuple[int, ...], timeout: float | None) -> None:
        """Take a place under queue_limit, waiting (lowest plan position first) while there is none."""
        try:
            if self._room.acquire(order, timeout):
                return
        except GateClosed as exc:
            raise DispatcherClosed("dispatcher is closed") from exc
        raise SubmitTimeout(f"no room in the dispatcher's queue within {timeout} s (limit {self._room.capacity})")

    def _release(self, work: _Work) -> None:
        """A request left the not-yet-sent count (sent, or done without being sent); idempotent."""
        with self._counted_lock:
            if not work.counted:
                return
            work.counted = False
        self._room.release()

    def _compute_queue_limit(self) -> int:
        """`queue_rounds` x every live server's capacity plus its queue; seeded until the server answers.

        Live: up, or starting (not contacted yet). A server that is down or fatal adds nothing, so the queue does
        not hold a round of work for servers that cannot take it; it grows again when they come back.
        """
        total = 0
        for s in self._servers:
            if s.state not in ("up", "starting"):
                continue
            capacity = s.capacity or s.endpoint.max_running_requests or self.default_capacity
            total += min(capacity + self.queue_depth, self.max_connections_per_server - 4)
        return max(1, total * self.queue_rounds)  # none live: one at a time (fatal everywhere: it fails at once)

    def _update_queue_limit(self) -> None:
        self._room.set_capacity(self._compute_queue_limit())

    # --- loop side ---------------------------------------------------------------------------------

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._spawn(self._startup())
        try:
            self._loop.run_forever()
        finally:
            self._loop.close()

    def _spawn(self, coro: Any) -> None:
        # Keep a reference: the loop holds tasks only weakly.
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _startup(self) -> None:
        await asyncio.gather(*(self._discover(s) for s in self._servers))
        self._ready.set()
        for s in self._servers:
            if s.state == "down":
                self._start_probe(s)
        self._spawn(self._watchdog())
        for s in self._servers:
            self._spawn(self._poll_loads(s))
        self._spawn(self._log_progress())
        self._pump()

    async def _discover(self, server: _ServerState) -> bool:
        """Health + capacity; on success the server is up."""
        try:
            if not await server.client.health():
                raise EngineError("/health did not answer 200", server=server.name)
            capacity, server.radix_cache = await server.client.serving_shape()
        except AuthError as exc:
            server.state, server.last_error = "fatal", str(exc)
            self._fatal = exc
            logger.error("%s", exc)
            self._update_queue_limit()
            return False
        except EngineError as exc:
            server.state, server.last_error = "down", str(exc)
            self._update_queue_limit()  # no longer "starting": its seeded share of the queue goes with it
            logger.warning("server %s not available: %s", server.name, exc)
            return False
        server.capacity = capacity
        server.target = min(capacity + self.queue_depth, self.max_connections_per_server - 4)
        server.state, server.consecutive_failures = "up", 0
        server.alive_at, server.sched_stamp = time.monotonic(), None
        self._update_queue_limit()
        logger.info(
            "server %s up: %d running slots, keeping %d in flight, radix cache %s",
            server.name,
            capacity,
            server.target,
            "kept (a conversation's steps go back to it)" if server.radix_cache else "off",
        )
        return True

    def _enqueue(self, work: _Work) -> None:
        if self._closed:
            work.future.set_exception(DispatcherClosed("dispatcher is closed"))
            return
        self._c["submitted"] += 1
        if self._fatal is not None and all(s.state == "fatal" for s in self._servers):
            self._c["failed"] += 1
            work.future.set_exception(self._fatal)
            return
        if not self._busy():
            self._last_progress = time.monotonic()
        work.seq = next(self._arrivals)
        if work.job.affinity:
            work.home = self._homes.pop(work.job.affinity, None)
        work.waiting = True
        heapq.heappush(self._pending, (work.queue_key(requeued=False), work))
        self._pump()

    def _busy(self) -> bool:
        return bool(self._pending or self._delayed or any(s.inflight for s in self._servers))

    def _pick(self, avoid: str) -> _ServerState | None:
        """The up server with the most free room relative to its target; faster servers first on ties."""
        candidates = [s for s in self._servers if s.free > 0]
        if not candidates:
            return None
        candidates.sort(key=lambda s: (s.free / max(s.target, 1), s.load.gen_throughput if s.load else 0.0))
        best = candidates[-1]
        if best.name == avoid and len(candidates) > 1:
            return candidates[-2]
        return best

    def _pump(self) -> None:
        """Start queued requests, in queue order, while any server has room (prefix affinity: `_affine`)."""
        held: list[tuple[tuple[int, tuple[int, ...], int], _Work]] = []
        try:
            while self._pending and not self._closed:
                work = self._pending[0][1]
                home = self._affine(work)
                if home is not None:
                    if home.free > 0:
                        self._send(work, home)
                        continue
                    if self._may_hold(work):  # its home is full: later work may use the room elsewhere meanwhile
                        held.append(heapq.heappop(self._pending))
                        continue
                server = self._pick(work.last_server)
                if server is None:
                    return
                self._send(work, server)
            # Only held steps are left and room elsewhere would idle: they go there, in queue order.
            while held and not self._closed:
                server = self._pick(held[0][1].last_server)
                if server is None:
                    return
                self._send(heapq.heappop(held)[1], server, popped=True)
        finally:
            for entry in held:
                heapq.heappush(self._pending, entry)
            if held:
                self._wake_after_hold(held)

    def _affine(self, work: _Work) -> _ServerState | None:
        """The server a step should go to: its conversation's previous one while it stays up with its radix cache.

        Only a first attempt: a retry or a requeued step goes wherever there is room, as any request does.
        """
        if work.home is None or work.started:
            return None
        if not work.home.valid:
            work.home = None  # its server went down (a restarted server's cache is empty) or keeps no cache
            return None
        return work.home.server

    def _may_hold(self, work: _Work) -> bool:
        """A step may wait for its full home server up to `affinity_wait_s` (the rule: docstring)."""
        now = time.monotonic()
        if work.held_since is None:
            work.held_since = now
        return now - work.held_since < self.affinity_wait_s

    def _wake_after_hold(self, held: list[tuple[tuple[int, tuple[int, ...], int], _Work]]) -> None:
        """Pump again when the first held step's wait runs out (a free slot elsewhere may be waiting for it)."""
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        started = min(w.held_since or 0.0 for _, w in held)
        delay = max(0.0, started + self.affinity_wait_s - time.monotonic())
        self._hold_timer = self._loop.call_later(delay + 1e-3, self._pump)

    def _send(self, work: _Work, server: _ServerState, *, popped: bool = False) -> None:
        """Take the queue's head (or a held step already taken off it) and start its attempt on `server`."""
        if not popped:
            heapq.heappop(self._pending)
        work.waiting = False
        if work.future.done():
            return
        if not work.started:
            if not work.future.set_running_or_notify_cancel():
                return  # cancelled by the submitter while queued (its done-callback freed the place)
            work.started = True
            self._release(work)
            if work.home is not None:
                self._c["affine" if work.home.server is server else "affinity_missed"] += 1
        if not server.inflight:  # the hang clock starts when it has work, not at its last answer before
            server.alive_at = max(server.alive_at, time.monotonic())
        task = self._loop.create_task(self._attempt(server, work))
        server.inflight[task] = work
        work.running[task] = server

    def _request_timeout(self, server: _ServerState, job: GenerateJob) -> float:
        """Generous deadline from max_new_tokens and the slowest observed per-request decode speed."""
        speeds = [s.speed for s in self._servers if s.speed]
        speed = server.speed or (min(speeds) if speeds else self.assumed_tokens_per_s)
        max_new = int(job.sampling.get("max_new_tokens") or 0)
        return max(self.timeout_floor_s, self.timeout_factor * max_new / max(speed, 1e-3))

    async def _attempt(self, server: _ServerState, work: _Work) -> None:
        task = asyncio.current_task()
        work.last_server = server.name
        rid = uuid.uuid4().hex  # fresh per attempt: a reused in-flight rid is a 400
        try:
            result = await server.client.generate(
                work.job.input_ids, work.job.sampling, rid=rid, timeout_s=self._request_timeout(server, work.job)
            )
        except asyncio.CancelledError:
            raise  # server marked down, answered elsewhere, or shutdown: whoever cancelled us took care of the work
        except Exception as exc:
            self._attempt_ended(server, work, task)
            if isinstance(exc, RequestRejected):
                server.alive_at = time.monotonic()  # it answered: not hung
            if not self._answered_before(server, work) and not self._other_attempt(work):
                self._failed_attempt(server, work, exc)
        else:
            self._attempt_ended(server, work, task)
            server.alive_at = time.monotonic()
            if not self._answered_before(server, work):  # the first answer settles it, whichever attempt gave it
                self._succeeded(server, result)
                self._remember_home(work, server)
                self._finish(work, result)
        self._pump()

    @staticmethod
    def _attempt_ended(server: _ServerState, work: _Work, task: asyncio.Task[None] | None) -> None:
        server.inflight.pop(task, None)  # type: ignore[arg-type]
        work.running.pop(task, None)  # type: ignore[arg-type]

    def _answered_before(self, server: _ServerState, work: _Work) -> bool:
        """True when another attempt already settled this request: this late outcome is dropped.

        Only after a server was found hung does a request have two attempts (the hung one runs on beside its
        copy); whichever answer comes first settles it, once.
        """
        if not work.future.done():
            return False
        self._c["discarded"] += 1
        logger.info("%s: late answer from %s dropped (settled by another attempt)", work.job.label, server.name)
        return True

    def _other_attempt(self, work: _Work) -> bool:
        """Another attempt of this request runs or waits: a failure of this one changes nothing."""
        return bool(work.running or work.waiting or work in self._delayed)

    def _failed_attempt(self, server: _ServerState, work: _Work, exc: Exception) -> None:
        """Route one failed attempt by error class: reject, retry here or elsewhere, or give up."""
        if isinstance(exc, RequestRejected):
            self._progress()
            self._c["rejected"] += 1
            server.consecutive_failures = 0
            self._finish(work, exc)
        elif isinstance(exc, AuthError):
            server.state, server.last_error = "fatal", str(exc)
            self._drop_homes(server)
            logger.error("%s", exc)
            self._update_queue_limit()
            self._requeue_front(server)
            self._requeue_now(work)
            if all(s.state == "fatal" for s in self._servers):
                self._fatal = exc
                self._fail_all(exc)
        elif isinstance(exc, ServerUnreachable):
            # Not the request's fault: requeue without charging an attempt.
            server.last_error = str(exc)
            self._c["requeued"] += 1
            work.drops += 1
            if work.drops > self.max_attempts:  # a server that keeps dropping it while looking healthy
                self._charge(server, work, exc)
            else:
                self._requeue_now(work)
            if isinstance(exc.__cause__, httpx.ConnectError):
                self._mark_down(server, str(exc))  # refused: nothing listens, down for sure
            elif not server.checking:
                # A dropped connection or a connect timeout alone is not proof: under load a kept-alive connection
                # that the server closed as idle races with its reuse (ReadError), and a starved server (or client)
                # accepts late. Marking it down would throw away every request running there; only a failed health
                # probe does that.
                self._spawn(self._check_health(server))
        elif isinstance(exc, TransientError | ProtocolError):
            self._charge(server, work, exc)
        else:  # a bug, not a server fault: surface it on the future
            logger.error("unexpected error in request %s: %r", work.job.label, exc)
            self._c["failed"] += 1
            self._finish(work, exc)

    def _charge(self, server: _ServerState, work: _Work, exc: TransientError | ProtocolError) -> None:
        """Count a failure against the request and the server; retry with backoff or give up."""
        server.last_error = str(exc)
        server.consecutive_failures += 1
        work.errors.append(str(exc))
        if server.consecutive_failures >= self.failures_before_probe and not server.checking:
            self._spawn(self._check_health(server))
        if isinstance(exc, ProtocolError):
            work.protocol_errors += 1
            used, budget = work.protocol_errors, self.max_protocol_errors
        else:
            work.attempts += 1
            used, budget = work.attempts, self.max_attempts
        if used >= budget:
            self._c["failed"] += 1
            if isinstance(exc, ProtocolError):
                self._finish(work, exc)
            else:
                detail = "; ".join(work.errors[-3:])
                self._finish(work, RetriesExhausted(f"gave up after {used} attempts: {detail}", server=server.name))
            return
        self._c["retries"] += 1
        delay = backoff_delay(used, self.backoff_base_s, self.backoff_max_s, self._rng)
        logger.debug("retrying %s in %.1f s after %s", work.job.label, delay, exc)
        self._delayed[work] = self._loop.call_later(delay, self._retry_due, work)

    def _retry_due(self, work: _Work) -> None:
        self._delayed.pop(work, None)
        self._requeue_now(work)

    def _requeue_now(self, work: _Work) -> None:
        if not work.future.done() and not work.waiting:
            work.waiting = True
            heapq.heappush(self._pending, (work.queue_key(requeued=True), work))

    def _requeue_front(self, server: _ServerState) -> None:
        """Cancel a server's in-flight requests and put them back at the front of the queue."""
        for task, work in list(server.inflight.items()):
            task.cancel()
            work.running.pop(task, None)
            self._c["requeued"] += 1
            self._requeue_now(work)
        server.inflight.clear()

    def _succeeded(self, server: _ServerState, result: GenerateResult) -> None:
        now = time.monotonic()
        self._progress()
        server.consecutive_failures = 0
        server.completed += 1
        server.output_tokens += result.completion_tokens
        server.recent.append((now, result.completion_tokens))
        self._done_times.append((now, result.completion_tokens))
        self._c["completed"] += 1
        self._c["output_tokens"] += result.completion_tokens
        self._c["prompt_tokens"] += result.prompt_tokens
        self._c["cached_tokens"] += min(result.cached_tokens, result.prompt_tokens)
        if result.e2e_latency > 0 and result.completion_tokens > 0:
            speed = result.completion_tokens / result.e2e_latency
            server.speed = speed if server.speed is None else 0.9 * server.speed + 0.1 * speed

    def _remember_home(self, work: _Work, server: _ServerState) -> None:
        """The conversation's next step goes back here: this server's radix cache now holds its prefix."""
        key = work.job.affinity
        if not key or not server.radix_cache or server.state != "up":  # (a hung server's late answer: it may restart)
            return
        self._homes[key] = _Home(server, server.epoch)
        self._homes.move_to_end(key)
        while len(self._homes) > max(_HOMES_KEPT, 16 * self._room.capacity):
            self._homes.popitem(last=False)

    def _drop_homes(self, server: _ServerState) -> None:
        """A server going down drops its affinities: its radix cache is gone (a restart starts it empty)."""
        server.epoch += 1
        for key in [k for k, home in self._homes.items() if home.server is server]:
            del self._homes[key]

    def _progress(self) -> None:
        self._last_progress = time.monotonic()

    def _finish(self, work: _Work, outcome: GenerateResult | BaseException) -> None:
        self._delayed.pop(work, None)
        if work.future.done():
            return
        if isinstance(outcome, BaseException):
            work.future.set_exception(outcome)
        else:
            work.future.set_result(outcome)
        for task, server in list(work.running.items()):  # a hung server's attempt still running: not needed now
            task.cancel()
            server.inflight.pop(task, None)
        work.running.clear()

    def _mark_down(self, server: _ServerState, reason: str) -> None:
        if server.state != "up":
            return
        server.state = "down"
        self._drop_homes(server)
        self._update_queue_limit()
        n = len(server.inflight)
        self._requeue_front(server)
        logger.warning("server %s marked down (%s); %d in-flight requests requeued", server.name, reason, n)
        if self.on_server_down is not None:
            callback, endpoint = self.on_server_down, server.endpoint
            self._spawn(self._call_down_hook(callback, endpoint))
        self._start_probe(server)

    def _mark_hung(self, server: _ServerState, silent_s: float) -> None:
        """No progress for hang_timeout_s with work there: down, its requests copied to the queue, not cancelled.

        A frozen process or a stuck scheduler answers nothing, or a /v1/loads whose scheduler timestamp stands
        still; a slow one still finishes requests or publishes loads, so latency alone never lands here. Its
        attempts run on: if it comes back first, that answer settles the request and the copy is dropped.
        """
        if server.state != "up":
            return
        server.state = "down"
        self._drop_homes(server)
        server.last_error = f"no progress for {silent_s:.0f} s with {len(server.inflight)} requests there"
        self._update_queue_limit()
        for work in list(server.inflight.values()):
            self._c["requeued"] += 1
            self._requeue_now(work)
        self._c["hung"] += 1
        logger.warning(
            "server %s made no progress for %.0f s (no request finished, its /v1/loads showed no scheduler "
            "activity): marked down, its %d requests requeued on the other servers; an answer that still comes "
            "back first is kept, once",
            server.name,
            silent_s,
            len(server.inflight),
        )
        if self.on_server_down is not None:
            self._spawn(self._call_down_hook(self.on_server_down, server.endpoint))
        self._start_probe(server)

    def _check_hung(self) -> None:
        now = time.monotonic()
        for s in self._servers:
            if s.state == "up" and s.inflight and now - s.alive_at > self.hang_timeout_s:
                self._mark_hung(s, now - s.alive_at)
        self._pump()

    async def _call_down_hook(self, callback: Callable[[ServerEndpoint], None], endpoint: ServerEndpoint) -> None:
        try:
            await asyncio.to_thread(callback, endpoint)
        except Exception:
            logger.exception("on_server_down(%s) failed", endpoint.name)

    def _start_probe(self, server: _ServerState) -> None:
        if not server.probing:
            server.probing = True
            self._spawn(self._probe(server))

    async def _probe(self, server: _ServerState) -> None:
        """Poll a down server until it is healthy, then put it back to work."""
        try:
            while not self._closed and server.state == "down":
                await asyncio.sleep(self.probe_interval_s)
                if await self._discover(server):
                    logger.info("server %s is back", server.name)
                    self._pump()
        finally:
            server.probing = False

    async def _check_health(self, server: _ServerState) -> None:
        """After repeated failures: a server that also fails its health probe is marked down."""
        server.checking = True
        try:
            if server.state == "up" and not await server.client.health():
                self._mark_down(server, f"{server.last_error}; then /health failed")
            else:
                server.consecutive_failures = 0
        finally:
            server.checking = False

    def _fail_all(self, exc: BaseException) -> None:
        for work, handle in list(self._delayed.items()):
            handle.cancel()
            self._finish(work, exc)
        self._delayed.clear()
        while self._pending:
            self._finish(heapq.heappop(self._pending)[1], exc)
        for s in self._servers:
            for task, work in list(s.inflight.items()):
                task.cancel()
                self._finish(work, exc)
            s.inflight.clear()

    async def _watchdog(self) -> None:
        """Fail everything when no server has finished anything for stall_timeout_s."""
        while not self._closed:
            await asyncio.sleep(min(1.0, self.stall_timeout_s / 4, self.hang_timeout_s / 4))
            self._check_hung()
            if not self._busy():
                self._last_progress = time.monotonic()
                continue
            idle = time.monotonic() - self._last_progress
            if idle < self.stall_timeout_s:
                continue
            parts = []
            for s in self._servers:
                part = f"{s.name} ({s.endpoint.url}, {s.state}, {len(s.inflight)} in flight"
                part += f", last error: {s.last_error})" if s.last_error else ")"
                # Server logs hold the API key (SGLang logs its settings): masked before it reaches an error.
                tail = redact_text(_tail(s.endpoint.log_path), [s.endpoint.api_key])
                if tail:
                    part += f"\n  last log lines of {Path(s.endpoint.log_path or '').name}:\n    "
                    part += tail.replace("\n", "\n    ")
                parts.append(part)
            message = f"no request finished on any server for {idle:.0f} s; servers:\n" + "\n".join(parts)
            message = redact_text(message, [s.endpoint.api_key for s in self._servers])  # last errors too
            logger.error("%s", message)
            self._c["failed"] += sum(len(s.inflight) for s in self._servers) + len(self._pending) + len(self._delayed)
            self._fail_all(EngineStalled(message))
            self._last_progress = time.monotonic()

    async def _poll_loads(self, server: _ServerState) -> None:
        """Follow one server's queue (a server with waiting requests gets fewer new ones) and its scheduler's pulse.

        One loop per server: a frozen server's unanswered poll holds up no other server's.
        """
        while not self._closed:
            await asyncio.sleep(self.load_poll_interval_s)
            if server.state != "up":
                continue
            try:
                load = await server.client.loads()
            except Exception as exc:
                logger.debug("load poll of %s failed: %s", server.name, exc)
                continue
            server.load = load
            self._note_pulse(server, load)
            full = min(server.capacity + self.queue_depth, self.max_connections_per_server - 4)
            # Waiting requests beyond our own small queue mean the server runs fewer than it reported
            # (memory pressure, other clients): back off by the excess, never below half capacity.
            excess = max(0, load.num_waiting_reqs - self.queue_depth)
            server.target = max(max(1, server.capacity // 2), full - excess)
            self._pump()

    @staticmethod
    def _note_pulse(server: _ServerState, load: LoadInfo) -> None:
        """A load reading is progress when its scheduler published since the last one (SGLang stamps each rank's
        snapshot when its scheduler loop publishes it; HTTP answers even while the scheduler is stuck).
        A reading without stamps (not SGLang's snapshot) counts as progress by answering at all."""
        ranks = load.raw.get("loads") if isinstance(load.raw, dict) else None
        stamps = [r["timestamp"] for r in ranks or [] if isinstance(r.get("timestamp"), int | float)]
        stamp = max(stamps) if stamps else None
        if stamp is None or server.sched_stamp is None or stamp > server.sched_stamp:
            server.alive_at = time.monotonic()
        if stamp is not None:
            server.sched_stamp = stamp

    async def _log_progress(self) -> None:
        last = -1
        underfed_before = False
        while not self._closed:
            await asyncio.sleep(self.log_interval_s)
            done = self._c["completed"] + self._c["rejected"] + self._c["failed"]
            if done != last or self._busy():
                stats = await self._snapshot()
                # Underfed at two lines in a row is no refill race: say it louder.
                level = logging.WARNING if stats.underfed and underfed_before else logging.INFO
                logger.log(level, "%s", stats.line())
                underfed_before = bool(stats.underfed)
                last = done

    async def _snapshot(self) -> DispatcherStats:
        now = time.monotonic()
        elapsed = now - self._started
        window = min(_RATE_WINDOW_S, max(elapsed, 1e-6))
        while self._done_times and self._done_times[0][0] < now - _RATE_WINDOW_S:
            self._done_times.popleft()
        servers = []
        for s in self._servers:
            while s.recent and s.recent[0][0] < now - _RATE_WINDOW_S:
                s.recent.popleft()
            servers.append(
                ServerStats(
                    name=s.name,
                    state=s.state,
                    capacity=s.capacity,
                    target=s.target,
                    in_flight=len(s.inflight),
                    waiting=s.load.num_waiting_reqs if s.load else None,
                    completed=s.completed,
                    output_tokens=s.output_tokens,
                    tokens_per_s=sum(t for _, t in s.recent) / window,
                    last_error=s.last_error,
                    running=s.load.num_running_reqs if s.load else None,
                )
            )
        limit, blocked = self._room.capacity, self._room.waiting
        rate = len(self._done_times) / window
        finished = self._c["completed"] + self._c["rejected"] + self._c["failed"]
        remaining = max(self._c["expected"] - finished, 0) if self._c["expected"] else self._c["submitted"] - finished
        return DispatcherStats(
            elapsed_s=elapsed,
            submitted=self._c["submitted"],
            completed=self._c["completed"],
            rejected=self._c["rejected"],
            failed=self._c["failed"],
            retries=self._c["retries"],
            requeued=self._c["requeued"],
            output_tokens=self._c["output_tokens"],
            queued=len(self._pending) + len(self._delayed),
            in_flight=sum(len(s.inflight) for s in self._servers),
            completions_per_s=rate,
            output_tokens_per_s=sum(t for _, t in self._done_times) / window,
            eta_s=remaining / rate if rate > 0 else None,
            servers=servers,
            to_submit=max(self._c["expected"] - self._c["submitted"], 0),
            queue_limit=limit,
            blocked_submitters=blocked,
            prompt_tokens=self._c["prompt_tokens"],
            cached_tokens=self._c["cached_tokens"],
            affine=self._c["affine"],
            affinity_missed=self._c["affinity_missed"],
        )

    async def _shutdown(self) -> None:
        if self._hold_timer is not None:
            self._hold_timer.cancel()
        self._fail_all(DispatcherClosed("dispatcher closed"))
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)
        await asyncio.gather(*(s.client.aclose() for s in self._servers), return_exceptions=True)
