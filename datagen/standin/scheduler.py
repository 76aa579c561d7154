"""Continuous-batching timing model: a waiting queue, a running batch, one asyncio loop of decode steps."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from datagen.standin.knobs import Knobs
from datagen.standin.synthetic import OutputPlan

__all__ = ["ABORT_FINISH", "QueueFullError", "Req", "Scheduler"]

logger = logging.getLogger("datagen.standin.scheduler")

ABORT_FINISH: dict[str, Any] = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
_DECODE_LOG_INTERVAL = 40  # decode steps per gen_throughput window and log line (--decode-log-interval default)
_GEN_THROUGHPUT_STALENESS_S = 30.0  # SGLang's GEN_THROUGHPUT_STALENESS_SECONDS


class QueueFullError(Exception):
    """The waiting queue is at --max-queued-requests."""


@dataclass(eq=False)
class Req:
    """One sequence in the scheduler: its planned output and how far it has got."""

    rid: str
    prompt_len: int
    plan: OutputPlan
    future: asyncio.Future[None]
    created: float = field(default_factory=time.time)
    pos: int = 0  # tokens emitted so far
    cached: int = 0  # prompt tokens found in the server's radix cache when it arrived (`meta_info.cached_tokens`)
    finish_reason: dict[str, Any] | None = None

    @property
    def done(self) -> bool:
        return self.finish_reason is not None


class Scheduler:
    """Admits requests up to the running limit and advances every running one per decode step."""

    def __init__(self, knobs: Knobs, *, max_running: int, max_queued: int | None, max_total_tokens: int) -> None:
        self.knobs = knobs
        self.max_running = max_running
        self.max_queued = max_queued
        self.max_total_tokens = max_total_tokens
        self.running: list[Req] = []
        self.waiting: deque[Req] = deque()
        self.inflight: dict[str, Req] = {}
        self._wake = asyncio.Event()
        self._decode_stats_tic = time.monotonic()
        self._window_steps = 0
        self._window_tokens = 0
        self.steps = 0
        # Counters behind /metrics (monotonic over the process lifetime). As SGLang's TokenizerMetricsCollector
        # (`observe_one_finished_request`), prompt and generation tokens and requests count when a request
        # FINISHES (stop, length or abort), with its whole prompt and output: not per decode step.
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_requests_total = 0
        self.num_aborted_total = 0
        # Per-step counters behind /v1/loads (total_prefill_uncached_tokens) and gen_throughput.
        self.prefill_tokens_total = 0
        self.decoded_tokens_total = 0
        self.last_gen_throughput = 0.0
        # (free bytes after the pools and graphs, activation bytes per prefill token, prefill chunk): a prefill
        # batch that needs more than is free kills the server as CUDA's out-of-memory error kills SGLang's
        # scheduler (DATAGEN_STANDIN_ACTIVATION_BYTES). None: activations are not modelled.
        self.activation_budget: tuple[int, float, int] | None = None

    # --- submission -------------------------------------------------------------------------
    def submit(self, reqs: list[Req]) -> None:
        """Queue a whole batch, or none of it (duplicate rid -> ValueError, queue full -> QueueFullError)."""
        rids = [r.rid for r in reqs]
        for i, rid in enumerate(rids):
            if rid in self.inflight or rid in rids[:i]:
                raise ValueError(f"Duplicate request ID detected: {rid}")
        if self.max_queued is not None:
            free_slots = max(0, self.max_running - len(self.running))
            if len(self.waiting) + len(reqs) - free_slots > self.max_queued:
                raise QueueFullError("The request queue is full.")
        for r in reqs:
            self.inflight[r.rid] = r
            self.waiting.append(r)
            self.prefill_tokens_total += r.prompt_len
        self._wake.set()

    def abort(self, rid: str | None = None, *, abort_all: bool = False) -> int:
        """Finish matching requests now with an abort finish reason; returns how many."""
        targets = list(self.inflight.values()) if abort_all else [r for r in [self.inflight.get(rid or "")] if r]
        for r in targets:
            self._finish(r, ABORT_FINISH)
            if r in self.running:
                self.running.remove(r)
            else:
                self.waiting.remove(r)
            self.num_aborted_total += 1
        return len(targets)

    def _finish(self, r: Req, reason: dict[str, Any]) -> None:
        r.finish_reason = reason
        self.inflight.pop(r.rid, None)
        self.num_requests_total += 1
        self.prompt_tokens_total += r.prompt_len
        self.generation_tokens_total += r.pos
        if not r.future.done():
            r.future.set_result(None)

    # --- state for /v1/loads and /metrics -----------------------------------------------------
    @property
    def num_used_tokens(self) -> int:
        return sum(r.prompt_len + r.pos for r in self.running)

    @property
    def gen_throughput(self) -> float:
        """SGLang's gen_throughput: tokens decoded over the last decode-log window, 0 once it is stale."""
        if time.monotonic() - self._decode_stats_tic > _GEN_THROUGHPUT_STALENESS_S:
            self.last_gen_throughput = 0.0
        return self.last_gen_throughput

    def _decode_stats(self, steps: int, tokens: int) -> None:
        """SGLang's metrics_reporter: every decode_log_interval decode steps, rate = tokens / seconds since."""
        self._window_steps += steps
        self._window_tokens += tokens
        if self._window_steps < _DECODE_LOG_INTERVAL:
            return
        now = time.monotonic()
        gap = now - self._decode_stats_tic
        self._decode_stats_tic = now
        self.last_gen_throughput = self._window_tokens / gap if gap > 0 else 0.0
        self._window_steps = self._window_tokens = 0
        if self.running:
            logger.info(
                "Decode batch, #running-req: %d, #token: %d, token usage: %.2f, gen throughput (token/s): %.2f, "
                "#queue-req: %d,",
                len(self.running),
                self.num_used_tokens,
                self.num_used_tokens / self.max_total_tokens,
                self.last_gen_throughput,
                len(self.waiting),
            )

    @staticmethod
    def _prefill_fits(tokens: int, free: int, per_token: float, chunk: int) -> None:
        """Exit as SGLang does when a prefill forward pass (at most one chunk) needs more than the free memory."""
        need = per_token * min(tokens, chunk)
        if need <= free:
            return
        logger.error(
            "Scheduler hit an exception: torch.OutOfMemoryError: CUDA out of memory. Tried to allocate %.2f GiB "
            "(prefill of %d tokens). GPU 0 has %.2f GiB free.",
            need / (1 << 30),
            min(tokens, chunk),
            free / (1 << 30),
        )
        logger.error("Received sigquit from a child process. It usually means the child failed.")
        logging.shutdown()
        os._exit(1)

    # --- the loop ---------------------------------------------------------------------------
    def _token_seconds(self, batch: int) -> float:
        """Time for every running request to advance one token."""
        k = self.knobs
        return (k.step_base_ms + k.step_per_req_ms * batch) * k.time_scale / 1000.0

    async def _sleep_until(self, deadline: float, interruptible: bool) -> bool:
        """Sleep until `deadline`; with free slots, a new arrival ends the sleep early (then True)."""
        delay = deadline - asyncio.get_running_loop().time()
        if not interruptible or self.waiting or delay <= 0:
            await asyncio.sleep(max(0.0, delay))
            return False
        self._wake.clear()
        try:
            await asyncio.wait_for(self._wake.wait(), delay)
        except TimeoutError:
            return False
        return True

    async def run(self) -> None:
        """Decode forever (cancel the task to stop).

        Each iteration advances the batch by up to `tokens_per_step` tokens, but never past the next request's
        last token, so a request ends (and its slot is refilled) at its own token, and throughput equals the
        per-token model whatever `tokens_per_step` is; a larger one only costs less CPU.
        """
        loop = asyncio.get_running_loop()
        clock = loop.time()  # simulated time the batch has been decoded up to
        per_step = self.knobs.tokens_per_step
        while True:
            if not self.running and not self.waiting:
                self._wake.clear()
                await self._wake.wait()
                clock = loop.time()
            admitted = 0
            while self.waiting and len(self.running) < self.max_running:
                r = self.waiting.popleft()
                self.running.append(r)
                admitted += r.prompt_len - r.cached
            if admitted and self.activation_budget is not None:
                self._prefill_fits(admitted, *self.activation_budget)
            per_token = self._token_seconds(len(self.running))
            n = min(per_step, min(len(r.plan.ids) - r.pos for r in self.running))
            if clock < loop.time() - 1.0:  # far behind (process was starved): do not burst to catch up
                clock = loop.time()
            # Deadlines, not plain sleeps: sleep overshoot does not accumulate into lower throughput.
            if await self._sleep_until(clock + n * per_token, len(self.running) < self.max_running):
                n = min(n, int((loop.time() - clock) / per_token))  # woken early: only the tokens due by now
            clock += n * per_token
            if n == 0:
                continue  # woken by an arrival before one token was due: admit it, then decode
            produced = 0
            still: list[Req] = []
            for r in self.running:
                r.pos += n
                produced += n
                if r.pos >= len(r.plan.ids):
                    self._finish(r, r.plan.finish_reason)
                else:
                    still.append(r)
            self.running = still
            self.decoded_tokens_total += produced
            self.steps += 1
            self._decode_stats(n, produced)  # n tokens per request = n decode steps
