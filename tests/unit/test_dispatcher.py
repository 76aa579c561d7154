"""Dispatcher policy: keeping servers full, retries and backoff, mark-down/requeue, stalls (MockTransport)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import dataclasses
import json
import random
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.engine.client import (
    AuthError,
    GenerateResult,
    ProtocolError,
    RequestRejected,
    SGLangClient,
    sampling_params_for,
)
from datagen.engine.dispatcher import (
    Dispatcher,
    DispatcherClosed,
    EngineStalled,
    GenerateJob,
    RetriesExhausted,
    SubmitTimeout,
    backoff_delay,
)
from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.gate import PlanOrderGate
from datagen.engine.stats import DispatcherStats, ServerStats
from datagen.runspec import SamplingSpec

SAMPLING = sampling_params_for(SamplingSpec(max_new_tokens=16))
GenerateHandler = Callable[[str, dict[str, Any]], Awaitable[httpx.Response]]


def ok(body: dict[str, Any]) -> httpx.Response:
    """A finished /generate answer echoing the prompt's first token id (to tell jobs apart)."""
    out = [body["input_ids"][0], 248046]
    meta = {"finish_reason": {"type": "stop", "matched": 248046}, "prompt_tokens": len(body["input_ids"])}
    meta |= {"completion_tokens": 2, "e2e_latency": 0.01}
    return httpx.Response(200, json={"text": "a", "output_ids": out, "meta_info": meta})


class FakeServers:
    """Per-server behaviour for /generate, plus counters; the control endpoints answer like SGLang."""

    def __init__(self, capacity: int = 2) -> None:
        self.capacity = capacity
        self.generate: dict[str, GenerateHandler] = {}
        self.healthy: dict[str, bool] = {}
        self.waiting: dict[str, int] = {}
        self.active: Counter[str] = Counter()
        self.peak: Counter[str] = Counter()
        self.calls: Counter[str] = Counter()
        self.rids: list[str] = []
        self.lock = threading.Lock()
        self.capacity_reported = 2  # /server_info's figure
        self.answering = threading.Event()  # clear: /health hangs, as a server that is not contacted yet
        self.answering.set()
        self.frozen: set[str] = set()  # servers that answer nothing (SIGSTOP): every call waits until thawed
        self.stamps: dict[str, float] = {}  # a /v1/loads scheduler timestamp that stands still (a stuck scheduler)
        self.throughput: dict[str, float] = {}  # /v1/loads gen_throughput (the dispatcher's tie-break): 100

    async def handle(self, request: httpx.Request) -> httpx.Response:
        name = request.url.host
        path = request.url.path
        while not self.answering.is_set() or name in self.frozen:
            await asyncio.sleep(0.01)
        if path == "/health":
            return httpx.Response(200 if self.healthy.get(name, True) else 503)
        if path == "/server_info":
            state = {"effective_max_running_requests_per_dp": self.capacity_reported}
            return httpx.Response(200, json={"internal_states": [state]})
        if path == "/v1/loads":
            load: dict[str, float] = {
                "num_running_reqs": self.active[name],
                "num_waiting_reqs": self.waiting.get(name, 0),
            }
            load |= {"max_running_requests": self.capacity, "gen_throughput": self.throughput.get(name, 100.0)}
            if name in self.stamps:
                load["timestamp"] = self.stamps[name]
            return httpx.Response(200, json={"loads": [load]})
        body = json.loads(request.content)
        with self.lock:
            self.calls[name] += 1
            self.rids.append(body["rid"])
            self.active[name] += 1
            self.peak[name] = max(self.peak[name], self.active[name])
        try:
            handler = self.generate.get(name)
            if handler is None:
                await asyncio.sleep(0.01)
                response = ok(body)
            else:
                response = await handler(name, body)
            while name in self.frozen:  # frozen mid-request: the answer waits for the thaw
                await asyncio.sleep(0.01)
            return response
        finally:
            with self.lock:
                self.active[name] -= 1

    def factory(self, endpoint: ServerEndpoint) -> SGLangClient:
        return SGLangClient(endpoint, transport=httpx.MockTransport(self.handle))


@contextmanager
def dispatcher(fake: FakeServers, names: tuple[str, ...] = ("a", "b"), **kwargs: Any) -> Iterator[Dispatcher]:
    endpoints = [ServerEndpoint(name=n, url=f"http://{n}") for n in names]
    options: dict[str, Any] = {
        "queue_depth": 1,
        "backoff_base_s": 0.01,
        "backoff_max_s": 0.05,
        "probe_interval_s": 0.05,
        "load_poll_interval_s": 0.05,
        "stall_timeout_s": 30.0,
        "seed": 1,
    }
    d = Dispatcher(endpoints, client_factory=fake.factory, **(options | kwargs))
    try:
        assert d.wait_ready(10)
        yield d
    finally:
        d.close()


def job(i: int) -> GenerateJob:
    return GenerateJob(input_ids=[i, 1, 2], sampling=SAMPLING, label=f"p{i}")


def results(futures: list[concurrent.futures.Future[GenerateResult]]) -> list[GenerateResult]:
    return [f.result(timeout=20) for f in futures]


def test_keeps_each_server_at_capacity_plus_queue_and_never_above() -> None:
    fake = FakeServers()

    async def slowish(name: str, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(0.05)
        return ok(body)

    fake.generate = {"a": slowish, "b": slowish}
    with dispatcher(fake) as d:
        out = results([d.submit(job(i)) for i in range(40)])
        stats = d.stats()
    assert sorted(r.output_ids[0] for r in out) == list(range(40))
    # capacity 2 from /server_info + queue_depth 1: full, never more.
    assert fake.peak == Counter({"a": 3, "b": 3})
    assert stats.completed == 40 and stats.output_tokens == 80 and stats.queued == 0 and stats.in_flight == 0
    assert {s.name: s.capacity for s in stats.servers} == {"a": 2, "b": 2}


def test_waiting_requests_go_out_in_plan_order_whoever_submitted_them_first() -> None:
    fake = FakeServers()
    gate = threading.Event()
    arrived: list[int] = []

    async def gated(name: str, body: dict[str, Any]) -> httpx.Response:
        arrived.append(body["input_ids"][0])
        while not gate.is_set():
            await asyncio.sleep(0.01)
        return ok(body)

    fake.generate = {"a": gated}
    with dispatcher(fake, names=("a",), queue_rounds=3) as d:  # room for all nine
        blockers = [d.submit(GenerateJob([100 + i, 1], SAMPLING, order=(0, i))) for i in range(3)]  # 2 + queue 1
        # Shard workers submit concurrently: later shards' rows can reach the queue before earlier ones.
        orders = [(4, 0), (2, 5), (3, 1), (2, 0), (1, 9), (3, 0)]
        waiting = [d.submit(GenerateJob([i, 1], SAMPLING, order=o)) for i, o in enumerate(orders)]
        assert d.stats().queued == len(orders)  # all queued before any slot frees
        gate.set()
        results(blockers + waiting)
    assert arrived[:3] == [100, 101, 102]
    assert [orders[i] for i in arrived[3:]] == sorted(orders)


def test_submit_is_safe_from_many_threads() -> None:
    fake = FakeServers()
    with dispatcher(fake) as d, concurrent.futures.ThreadPoolExecutor(8) as pool:
        batches = list(pool.map(lambda k: [d.submit(job(k * 100 + i)) for i in range(25)], range(8)))
        out = results([f for batch in batches for f in batch])
    assert sorted(r.output_ids[0] for r in out) == sorted(k * 100 + i for k in range(8) for i in range(25))
    assert sum(fake.calls.values()) == 200


def test_transient_errors_retry_with_new_rid_until_success() -> None:
    fake = FakeServers()
    failures = Counter[int]()

    async def flaky(name: str, body: dict[str, Any]) -> httpx.Response:
        key = body["input_ids"][0]
        if failures[key] < 2:
            failures[key] += 1
            status = 500 if failures[key] == 1 else 503
            return httpx.Response(status, json={"object": "error", "message": "The request queue is full."})
        return ok(body)

    fake.generate = {"a": flaky, "b": flaky}
    with dispatcher(fake) as d:
        out = results([d.submit(job(i)) for i in range(5)])
        stats = d.stats()
    assert [r.output_ids[0] for r in out] == list(range(5))
    assert sum(fake.calls.values()) == 15
    assert len(set(fake.rids)) == 15  # a fresh rid per attempt
    assert stats.retries == 10 and stats.failed == 0


def test_retries_are_bounded_and_report_the_last_errors() -> None:
    fake = FakeServers()

    async def broken(name: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(500, json={"error": {"message": "CUDA error: an illegal memory access"}})

    fake.generate = {"a": broken}
    with dispatcher(fake, names=("a",), max_attempts=4, failures_before_probe=100) as d:
        fut = d.submit(job(0))
        with pytest.raises(RetriesExhausted, match=r"after 4 attempts.*illegal memory access"):
            fut.result(timeout=20)
    assert fake.calls["a"] == 4


def test_a_400_is_never_retried() -> None:
    fake = FakeServers()
    message = "The input (9 tokens) is longer than the model's context length (8 tokens)."

    async def too_long(name: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(400, json={"error": {"message": message}})

    fake.generate = {"a": too_long, "b": too_long}
    with dispatcher(fake) as d:
        fut = d.submit(job(0))
        with pytest.raises(RequestRejected) as info:
            fut.result(timeout=20)
        assert d.stats().rejected == 1
    assert info.value.message == message
    assert sum(fake.calls.values()) == 1


def test_protocol_errors_are_retried_a_bounded_number_of_times() -> None:
    fake = FakeServers()

    async def garbage(name: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(200, content=b"<html>proxy error</html>")

    fake.generate = {"a": garbage}
    with (
        dispatcher(fake, names=("a",), max_protocol_errors=3, failures_before_probe=100) as d,
        pytest.raises(ProtocolError, match="not JSON"),
    ):
        d.submit(job(0)).result(timeout=20)
    assert fake.calls["a"] == 3


def test_refused_server_is_marked_down_work_moves_over_and_it_comes_back() -> None:
    fake = FakeServers()
    down_calls: list[str] = []

    async def refused(name: str, body: dict[str, Any]) -> httpx.Response:
        fake.healthy["a"] = False  # a dead process: /health is refused too
        raise httpx.ConnectError("connection refused")

    fake.generate = {"a": refused}
    with dispatcher(fake, on_server_down=lambda e: down_calls.append(e.name), max_attempts=1) as d:
        out = results([d.submit(job(i)) for i in range(30)])
        assert sorted(r.output_ids[0] for r in out) == list(range(30))
        assert {r.server for r in out} == {"b"}
        # max_attempts=1 and yet nothing failed: refusals are not charged to the request.
        stats = d.stats()
        assert stats.failed == 0 and stats.requeued >= 1
        assert down_calls == ["a"]
        # The probe brings it back once healthy and answering.
        fake.generate = {}
        fake.healthy["a"] = True
        for _ in range(200):
            if {s.name: s.state for s in d.stats().servers}["a"] == "up":
                break
            threading.Event().wait(0.02)
        assert {s.name: s.state for s in d.stats().servers}["a"] == "up"
        later = results([d.submit(job(i)) for i in range(40)])
    assert {r.server for r in later} == {"a", "b"}


def test_dropped_connections_requeue_in_flight_requests_exactly_once() -> None:
    fake = FakeServers()

    async def dies(name: str, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(0.1)  # requests pile up on "a" first, then the process "dies"
        fake.healthy["a"] = False
        raise httpx.RemoteProtocolError("Server disconnected without sending a response.")

    fake.generate = {"a": dies}
    with dispatcher(fake, max_attempts=1) as d:
        out = results([d.submit(job(i)) for i in range(20)])
    assert sorted(r.output_ids[0] for r in out) == list(range(20))
    assert {r.server for r in out} == {"b"}
    assert fake.calls["a"] >= 1


def test_a_connect_timeout_on_a_healthy_server_requeues_that_request_only() -> None:
    fake = FakeServers()
    slow_accepts = Counter[str]()

    async def starved(name: str, body: dict[str, Any]) -> httpx.Response:
        if slow_accepts[name] < 2:  # a loaded box: a couple of connects time out, /health still answers
            slow_accepts[name] += 1
            raise httpx.ConnectTimeout("timed out")
        await asyncio.sleep(0.05)
        return ok(body)

    fake.generate = {"a": starved}
    with dispatcher(fake, max_attempts=1) as d:
        out = results([d.submit(job(i)) for i in range(20)])
        stats = d.stats()
    assert sorted(r.output_ids[0] for r in out) == list(range(20))
    assert {s.name: s.state for s in stats.servers} == {"a": "up", "b": "up"}  # never marked down
    assert stats.requeued == 2 and stats.failed == 0
    assert {r.server for r in out} == {"a", "b"}


def test_repeated_timeouts_then_failed_health_mark_a_server_down() -> None:
    fake = FakeServers()

    async def hangs(name: str, body: dict[str, Any]) -> httpx.Response:
        fake.healthy["a"] = False
        await asyncio.sleep(30)
        return ok(body)

    fake.generate = {"a": hangs}
    with dispatcher(fake, timeout_floor_s=0.2, assumed_tokens_per_s=1e4, failures_before_probe=2) as d:
        out = results([d.submit(job(i)) for i in range(10)])
        states = {s.name: s.state for s in d.stats().servers}
    assert sorted(r.output_ids[0] for r in out) == list(range(10))
    assert states["a"] == "down"


def test_stall_fails_everything_naming_servers_and_log_tail(tmp_path: Path) -> None:
    fake = FakeServers()
    log = tmp_path / "server-a.log"
    log.write_text("loading weights\nRuntimeError: CUDA out of memory\n")

    async def hangs(name: str, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(30)
        return ok(body)

    fake.generate = {"a": hangs}
    endpoints = [ServerEndpoint(name="a", url="http://a", log_path=str(log))]
    d = Dispatcher(endpoints, client_factory=fake.factory, stall_timeout_s=0.5, load_poll_interval_s=0.05)
    try:
        futures = [d.submit(job(i)) for i in range(5)]
        for fut in futures:
            with pytest.raises(EngineStalled) as info:
                fut.result(timeout=20)
        assert "a (http://a, up, " in str(info.value)
        assert "CUDA out of memory" in str(info.value)
    finally:
        d.close()


def test_auth_failure_everywhere_is_fatal_with_a_clear_message() -> None:
    fake = FakeServers()

    async def unauthorized(name: str, body: dict[str, Any]) -> httpx.Response:
        return httpx.Response(401, json={"error": "Unauthorized"})

    fake.generate = {"a": unauthorized, "b": unauthorized}
    with dispatcher(fake) as d:
        futures = [d.submit(job(i)) for i in range(6)]
        for fut in futures:
            with pytest.raises(AuthError, match="API key"):
                fut.result(timeout=20)


def test_waiting_requests_on_a_server_shrink_its_share() -> None:
    fake = FakeServers(capacity=2)
    fake.waiting = {"a": 5}
    with dispatcher(fake, queue_depth=1) as d:
        for _ in range(200):
            targets = {s.name: s.target for s in d.stats().servers}
            if targets["a"] < 3:
                break
            threading.Event().wait(0.02)
    # capacity 2 + queue 1 = 3; four excess waiting requests would take it to -1, floored at capacity // 2.
    assert targets == {"a": 1, "b": 3}


def test_request_timeout_follows_max_new_tokens_and_observed_speed() -> None:
    fake = FakeServers()
    with dispatcher(fake, names=("a",), timeout_floor_s=10.0, timeout_factor=4.0, assumed_tokens_per_s=5.0) as d:
        server = d._servers[0]
        small = GenerateJob([1], sampling_params_for(SamplingSpec(max_new_tokens=8)))
        big = GenerateJob([1], sampling_params_for(SamplingSpec(max_new_tokens=8000)))
        assert d._request_timeout(server, small) == 10.0  # the floor
        assert d._request_timeout(server, big) == pytest.approx(4 * 8000 / 5.0)
        server.speed = 40.0
        assert d._request_timeout(server, big) == pytest.approx(4 * 8000 / 40.0)


def test_backoff_is_capped_exponential_with_jitter() -> None:
    rng = random.Random(0)
    for attempt, ceiling in [(1, 0.5), (2, 1.0), (3, 2.0), (6, 16.0), (7, 20.0), (30, 20.0)]:
        delays = [backoff_delay(attempt, 0.5, 20.0, rng) for _ in range(50)]
        assert all(ceiling * 0.5 <= x <= ceiling for x in delays)
        assert len(set(delays)) > 1


def wait_for(predicate: Callable[[], bool]) -> None:
    for _ in range(1000):
        if predicate():
            return
        threading.Event().wait(0.01)
    raise AssertionError("condition never came true")


def test_queue_limit_is_seeded_from_provisioning_then_follows_the_servers() -> None:
    fake = FakeServers()
    fake.answering.clear()
    endpoints = [ServerEndpoint(name=n, url=f"http://{n}", max_running_requests=5) for n in ("a", "b")]
    d = Dispatcher(endpoints, client_factory=fake.factory, queue_depth=1, load_poll_interval_s=0.05)
    try:
        assert d.queue_limit == 2 * (5 + 1)  # before any contact: provisioning's figures
        futures = [d.submit(job(i), timeout=5) for i in range(12)]
        with pytest.raises(SubmitTimeout):
            d.submit(job(99), timeout=0.05)  # full: nothing sent yet, nothing more taken
        stats = d.stats()
        assert (stats.queued, stats.in_flight, stats.submitted) == (12, 0, 12)
        fake.answering.set()  # first contact: the servers report 2 slots each
        assert d.wait_ready(10)
        assert d.queue_limit == 2 * (2 + 1)
        later = [d.submit(job(100 + i), timeout=10) for i in range(20)]
        assert len(results(futures + later)) == 32
    finally:
        d.close()


def test_unknown_capacity_uses_the_default_until_contact_and_then_grows() -> None:
    fake = FakeServers()
    fake.answering.clear()
    endpoints = [ServerEndpoint(name="a", url="http://a")]
    d = Dispatcher(endpoints, client_factory=fake.factory, queue_depth=1, default_capacity=0)
    try:
        assert d.queue_limit == 1  # 0 slots + a queue of 1
        fake.answering.set()
        assert d.wait_ready(10)
        assert d.queue_limit == 3  # /server_info: 2 slots
    finally:
        d.close()


def test_blocked_submitters_are_let_in_lowest_plan_position_first() -> None:
    fake = FakeServers()
    fake.answering.clear()
    orders = [(5, 0), (1, 3), (4, 2), (1, 0), (3, 1), (2, 7), (0, 9), (2, 0)]
    arrived: list[int] = []

    async def record(name: str, body: dict[str, Any]) -> httpx.Response:
        arrived.append(body["input_ids"][0])
        await asyncio.sleep(0.02)
        return ok(body)

    fake.generate = {"a": record}
    fake.capacity_reported = 1
    endpoints = [ServerEndpoint(name="a", url="http://a", max_running_requests=1)]
    d = Dispatcher(endpoints, client_factory=fake.factory, queue_depth=0)
    try:
        first = d.submit(GenerateJob([100, 1], SAMPLING, order=(9, 9)))  # takes the only place (limit 1)
        with concurrent.futures.ThreadPoolExecutor(len(orders)) as pool:
            later = [pool.submit(d.submit, GenerateJob([i, 1], SAMPLING, order=o)) for i, o in enumerate(orders)]
            wait_for(lambda: d.stats().blocked_submitters == len(orders))
            assert f"{len(orders)} shard workers waiting for room" in d.stats().line()
            fake.answering.set()
            results([first, *(f.result(timeout=20) for f in later)])
    finally:
        d.close()
    assert arrived[0] == 100
    assert [orders[i] for i in arrived[1:]] == sorted(orders)  # let in, and sent, in plan order


def test_closing_wakes_blocked_submitters() -> None:
    fake = FakeServers()
    fake.answering.clear()
    endpoints = [ServerEndpoint(name="a", url="http://a", max_running_requests=1)]
    d = Dispatcher(endpoints, client_factory=fake.factory, queue_depth=0)
    d.submit(job(0))
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        blocked = pool.submit(d.submit, job(1))
        wait_for(lambda: d.stats().blocked_submitters == 1)
        d.close()
        with pytest.raises(DispatcherClosed):
            blocked.result(timeout=10)


def test_progress_line_spells_out_every_figure_and_flags_an_underfed_server() -> None:
    servers = [
        ServerStats("gpu0", "up", 64, 68, 68, 4, 10, 9000, 12784.0, "", running=64),
        ServerStats("gpu1", "up", 64, 68, 4, 0, 10, 9000, 950.0, "", running=4),
        ServerStats("gpu2", "starting", 64, 0, 0, None, 0, 0, 0.0, ""),
    ]
    stats = DispatcherStats(
        elapsed_s=60, submitted=200, completed=1234, rejected=3, failed=0, retries=2, requeued=0, output_tokens=1,
        queued=0, in_flight=72, completions_per_s=8.5, output_tokens_per_s=13734.0, eta_s=192.0, servers=servers,
        to_submit=50, queue_limit=204, blocked_submitters=0,
    )  # fmt: skip
    line = stats.line()
    assert line.startswith("generation: 1,234 done, 3 rejected, 0 failed; 50 to submit, 0 queued (limit 204), 72 in")
    assert "13.7k tok/s, 8.50 req/s, 2 retries, ETA 3.2 min" in line
    assert "gpu0 up, 68/68 in flight (64 running, 4 queued there), 12.8k tok/s" in line
    assert "gpu1 up, 4/68 in flight (4 running, 0 queued there), 950 tok/s" in line
    assert "gpu2 starting, 0/0 in flight (server load not read yet)" in line
    assert stats.underfed == ["gpu1"] and line.endswith("UNDERFED: gpu1 below their number while requests wait")
    assert dataclasses.replace(stats, to_submit=0).underfed == []  # nothing waits: a server below target is fine


def test_plan_order_turn_goes_to_the_lowest_waiting_plan_position_not_the_first_to_come() -> None:
    turn = PlanOrderGate(1)
    order: list[int] = []
    holder_in, release = threading.Event(), threading.Event()

    def holder() -> None:
        with turn((0, 0)):
            holder_in.set()
            release.wait(30)

    def waiter(shard: int) -> None:
        with turn((shard, 0)):
            order.append(shard)

    first = threading.Thread(target=holder)
    first.start()
    assert holder_in.wait(30)
    waiters = []
    for shard in (5, 3, 9, 1):  # they arrive in this order while the turn is held
        t = threading.Thread(target=waiter, args=(shard,))
        t.start()
        waiters.append(t)
        for _ in range(3000):  # until it waits (at most 30 s)
            if turn.waiting == len(waiters):
                break
            threading.Event().wait(0.01)
        assert turn.waiting == len(waiters)
    release.set()
    for t in [first, *waiters]:
        t.join(30)
    assert order == [1, 3, 5, 9]
    # Free again: the next caller takes it at once.
    with turn((7, 0)):
        order.append(7)
    assert order[-1] == 7 and turn.held == 0


def test_queue_limit_follows_servers_going_down_and_coming_back() -> None:
    fake = FakeServers()

    async def refused(name: str, body: dict[str, Any]) -> httpx.Response:
        fake.healthy["a"] = False  # a dead process: /health is refused too
        raise httpx.ConnectError("connection refused")

    with dispatcher(fake, probe_interval_s=0.05) as d:
        assert d.queue_limit == 2 * (2 + 1)  # two servers, 2 slots + a queue of 1 each
        fake.generate = {"a": refused}
        results([d.submit(job(i)) for i in range(10)])
        wait_for(lambda: {s.name: s.state for s in d.stats().servers}["a"] == "down")
        assert d.queue_limit == 2 + 1  # only b is live: the queue holds one round of b, not of a dead server too
        fake.generate = {}
        fake.healthy["a"] = True
        wait_for(lambda: {s.name: s.state for s in d.stats().servers}["a"] == "up")
        assert d.queue_limit == 2 * (2 + 1)


def test_a_server_down_at_first_contact_leaves_the_queue_limit_at_once() -> None:
    fake = FakeServers()
    fake.healthy["a"] = False  # a answers /health with 503 from the start
    fake.frozen.update(("a", "b"))  # not contacted yet: each keeps its seeded share until it answers
    endpoints = [ServerEndpoint(name=n, url=f"http://{n}", max_running_requests=5) for n in ("a", "b")]
    d = Dispatcher(endpoints, client_factory=fake.factory, queue_depth=1, probe_interval_s=0.05)
    try:
        assert d.queue_limit == 2 * (5 + 1)  # before any contact: provisioning's figures for both
        fake.frozen.discard("a")
        wait_for(lambda: {s.name: s.state for s in d.stats().servers}["a"] == "down")
        assert d.queue_limit == 5 + 1  # before: still 12, a round of work held for a server that never came up
        fake.frozen.clear()
        assert d.wait_ready(10)
        assert d.queue_limit == 2 + 1  # b answered with 2 slots; a is still down
        fake.healthy["a"] = True
        wait_for(lambda: {s.name: s.state for s in d.stats().servers}["a"] == "up")
        assert d.queue_limit == 2 * (2 + 1)
    finally:
        d.close()


def test_a_hung_server_is_marked_down_its_requests_finish_elsewhere_and_a_late_answer_is_dropped() -> None:
    fake = FakeServers()
    sent_to_a = threading.Event()

    async def then_freeze(name: str, body: dict[str, Any]) -> httpx.Response:
        fake.frozen.add("a")  # the process stops mid-request: no answer, no /v1/loads, no /health
        sent_to_a.set()
        return ok(body)

    fake.generate = {"a": then_freeze}
    down: list[str] = []
    with dispatcher(fake, hang_timeout_s=1.5, on_server_down=lambda e: down.append(e.name)) as d:
        futures = [d.submit(job(i)) for i in range(20)]
        assert sent_to_a.wait(10)
        out = results(futures)  # would wait for the thaw (request timeout >= 600 s) without the detector
        stats = d.stats()
        assert {s.name: s.state for s in stats.servers}["a"] == "down" and down == ["a"]
        assert "no progress" in {s.name: s.last_error for s in stats.servers}["a"]
        fake.generate = {}
        fake.frozen.clear()  # thawed: what it still held was settled elsewhere
        wait_for(lambda: {s.name: s.state for s in d.stats().servers}["a"] == "up")
        stats = d.stats()
    assert sorted(r.output_ids[0] for r in out) == list(range(20))
    assert stats.completed == 20 and stats.failed == 0  # each request settled once
    assert stats.in_flight == 0


def test_when_a_hung_server_answers_first_its_answer_is_kept_once() -> None:
    fake = FakeServers()
    b_open = threading.Event()

    async def held(name: str, body: dict[str, Any]) -> httpx.Response:
        while not b_open.is_set():  # b is busy elsewhere: the copies wait there
            await asyncio.sleep(0.01)
        return ok(body)

    fake.generate = {"b": held}
    with dispatcher(fake, names=("a", "b"), hang_timeout_s=1.5) as d:
        fake.frozen.add("a")
        futures = [d.submit(job(i)) for i in range(6)]  # 3 each: a holds 3 it cannot answer
        wait_for(lambda: {s.name: s.state for s in d.stats().servers}["a"] == "down")
        fake.frozen.clear()  # a thaws before b answers anything: a's three answers come first
        wait_for(lambda: sum(f.done() for f in futures) == 3)
        assert {f.result().server for f in futures if f.done()} == {"a"}
        b_open.set()
        out = results(futures)
        wait_for(lambda: d.stats().in_flight == 0)
        stats = d.stats()
    assert sorted(r.output_ids[0] for r in out) == list(range(6))
    assert sum(r.server == "a" for r in out) == 3
    assert stats.completed == 6  # a's copies on b were dropped, not counted twice


def test_a_slow_server_that_keeps_publishing_is_never_marked_hung() -> None:
    fake = FakeServers()

    async def slow(name: str, body: dict[str, Any]) -> httpx.Response:
        await asyncio.sleep(4.5)  # three hang timeouts per request: latency alone is no hang
        return ok(body)

    fake.generate = {"a": slow, "b": slow}
    with dispatcher(fake, hang_timeout_s=1.5) as d:  # the fake's /v1/loads answers (no timestamp: answering counts)
        out = results([d.submit(job(i)) for i in range(12)])
        stats = d.stats()
    assert len(out) == 12 and {s.state for s in stats.servers} == {"up"} and stats.requeued == 0


def test_a_scheduler_whose_load_timestamp_stands_still_is_hung_though_http_answers() -> None:
    fake = FakeServers()
    release = threading.Event()

    async def stuck(name: str, body: dict[str, Any]) -> httpx.Response:
        while not release.is_set():
            await asyncio.sleep(0.01)
        return ok(body)

    fake.generate = {"a": stuck}
    fake.stamps["a"] = 1000.0  # SGLang's snapshot time: published by the scheduler loop, which is stuck
    fake.stamps["b"] = 1000.0
    with dispatcher(fake, hang_timeout_s=1.5) as d:
        # Both servers up before anything is sent: on a loaded box, b alone could otherwise take all ten before a's
        # first contact, and a (never sent anything) would rightly stay up.
        wait_for(lambda: {s.state for s in d.stats().servers} == {"up"})
        out = results([d.submit(job(i)) for i in range(10)])
        states = {s.name: s.state for s in d.stats().servers}
        release.set()
    assert {r.server for r in out} == {"b"} and states["a"] == "down"


# --- prefix affinity: a conversation's steps go back to the server whose radix cache holds its prefix ---------


class Gated:
    """/generate answers held per prompt (its first token id) until released; records where each one ran."""

    def __init__(self, fake: FakeServers) -> None:
        self.held: set[int] = set()
        self.where: dict[int, str] = {}
        self.fake = fake
        self.seen: dict[str, set[tuple[int, ...]]] = {}  # each server's prompts and outputs: its "radix cache"

    async def __call__(self, name: str, body: dict[str, Any]) -> httpx.Response:
        ids = body["input_ids"]
        self.where[ids[0]] = name
        while ids[0] in self.held:
            await asyncio.sleep(0.005)
        seen = self.seen.setdefault(name, set())
        cached = max((n for n in range(1, len(ids)) if tuple(ids[:n]) in seen), default=0)
        seen.update(tuple(ids[:n]) for n in range(1, len(ids) + 1))
        response = ok(body)
        payload = json.loads(response.content)
        payload["meta_info"]["cached_tokens"] = cached
        return httpx.Response(200, json=payload)

    def wait_running(self, ids: list[int]) -> None:
        for _ in range(1000):
            if all(i in self.where for i in ids):
                return
            threading.Event().wait(0.005)
        raise AssertionError(f"not all of {ids} reached a server: {self.where}")


def step(conversation: str, k: int, order: tuple[int, ...] = (0,)) -> GenerateJob:
    """Step k of a conversation: its prompt extends the previous step's (first token: the conversation's id)."""
    base = 1000 * (1 + ord(conversation[0]) - ord("a"))
    return GenerateJob(
        [base + k, *range(1, 4 * (k + 1))], SAMPLING, label=f"{conversation}:{k}", order=order, affinity=conversation
    )


def test_each_step_of_a_conversation_goes_to_the_server_that_ran_its_previous_step() -> None:
    fake = FakeServers()
    gated = Gated(fake)
    fake.generate = {"a": gated, "b": gated}
    conversations = ["a", "b", "c"]  # at most 3 in flight: a server's 3 slots always have room for its own

    def run(conv: str) -> list[str]:
        servers = []
        for k in range(5):
            job_k = GenerateJob([1, 2, 3, *range(10, 10 + 4 * k)], SAMPLING, label=f"{conv}:{k}", affinity=conv)
            servers.append(d.submit(job_k).result(timeout=20).server)
        return servers

    with dispatcher(fake) as d, concurrent.futures.ThreadPoolExecutor(3) as pool:
        served = dict(zip(conversations, pool.map(run, conversations), strict=True))
        stats = d.stats()
    assert all(len(set(servers)) == 1 for servers in served.values()), served
    assert stats.affine == 3 * 4 and stats.affinity_missed == 0
    # Every later step found its conversation's history in its server's cache (the fake's: prompts and outputs seen).
    assert stats.cached_tokens > 0 and stats.cache_hit_rate is not None and stats.cache_hit_rate > 0.5
    assert "prefix cache:" in stats.line() and "12 steps to their conversation's server" in stats.line()


def test_a_step_waits_for_its_full_server_while_later_work_takes_the_free_slot_elsewhere() -> None:
    fake = FakeServers()
    gated = Gated(fake)
    fake.generate = {"a": gated, "b": gated}
    with dispatcher(fake, affinity_wait_s=60.0) as d:
        home = d.submit(step("x", 0)).result(timeout=20).server
        other = "b" if home == "a" else "a"
        gated.held |= set(range(6))
        blockers = [d.submit(GenerateJob([i, 1], SAMPLING, order=(9, i))) for i in range(6)]  # 3 + 3: both full
        gated.wait_running(list(range(6)))
        x1 = d.submit(step("x", 1, order=(0,)))  # first in the queue
        gated.held.add(500)
        y = d.submit(GenerateJob([500, 1], SAMPLING, order=(5,)))  # behind it, no conversation
        assert d.stats().queued == 2
        gated.held.discard(next(i for i in range(6) if gated.where[i] == other))  # a slot frees on the other server
        gated.wait_running([500])  # the later work took it ...
        assert gated.where[500] == other and not x1.done() and d.stats().queued == 1  # ... the step waits
        gated.held.discard(next(i for i in range(6) if gated.where[i] == home))
        assert x1.result(timeout=20).server == home
        gated.held.discard(500)
        assert y.result(timeout=20).server == other
        gated.held.clear()
        results(blockers)
        stats = d.stats()
    assert stats.affine == 1 and stats.affinity_missed == 0


def test_a_waiting_step_never_idles_a_free_slot_and_never_waits_past_the_bound() -> None:
    fake = FakeServers()
    gated = Gated(fake)
    fake.generate = {"a": gated, "b": gated}
    with dispatcher(fake, affinity_wait_s=0.3) as d:
        home = d.submit(step("x", 0)).result(timeout=20).server
        other = "b" if home == "a" else "a"
        gated.held |= set(range(6))
        blockers = [d.submit(GenerateJob([i, 1], SAMPLING, order=(9, i))) for i in range(6)]
        gated.wait_running(list(range(6)))
        on_other = [i for i in range(6) if gated.where[i] == other]
        # Nothing else queued: a slot that frees elsewhere takes the step at once rather than idle.
        x1 = d.submit(step("x", 1))
        gated.held.discard(on_other[0])
        assert x1.result(timeout=20).server == other
        # Now its home is the other server, full again; later work queued behind the next step.
        gated.held.add(501)
        filler = d.submit(GenerateJob([501, 1], SAMPLING, order=(8,)))
        gated.wait_running([501])
        x2 = d.submit(step("x", 2, order=(0,)))
        gated.held |= {600, 601}
        later = [d.submit(GenerateJob([600 + i, 1], SAMPLING, order=(5, i))) for i in range(2)]
        free_home = next(i for i in range(6) if gated.where[i] == home and i in gated.held)
        gated.held.discard(free_home)  # the first server (not its home now) frees a slot: the later work takes it
        gated.wait_running([600])
        assert not x2.done() and 601 not in gated.where
        threading.Event().wait(0.5)  # past the bound: the next slot to free anywhere is the step's
        x2_first = step("x", 2).input_ids[0]
        gated.held.add(x2_first)  # (kept there until checked: its slot must not free for the later work)
        gated.held.discard(next(i for i in range(6) if gated.where[i] == home and i in gated.held))
        gated.wait_running([x2_first])
        assert gated.where[x2_first] == home
        assert 601 not in gated.where  # the step went before the later work once its wait ran out
        gated.held.clear()
        assert x2.result(timeout=20).server == home
        results([*blockers, filler, *later])
        stats = d.stats()
    assert stats.affine == 0 and stats.affinity_missed == 2


def test_a_server_that_goes_down_drops_its_affinities() -> None:
    fake = FakeServers()
    fake.throughput = {"a": 200.0}  # ties go to the faster: "a" first
    with dispatcher(fake) as d:
        threading.Event().wait(0.3)  # a load poll read the throughputs
        assert d.submit(step("x", 0)).result(timeout=20).server == "a"

        async def refused(name: str, body: dict[str, Any]) -> httpx.Response:
            fake.healthy["a"] = False
            raise httpx.ConnectError("connection refused")

        fake.generate = {"a": refused}
        assert d.submit(job(7)).result(timeout=20).server == "b"  # "a" refused it: marked down
        fake.generate, fake.healthy["a"] = {}, True
        fake.throughput = {"b": 200.0}  # now ties go to "b"
        for _ in range(400):
            if {s.name: s.state for s in d.stats().servers}["a"] == "up":
                break
            threading.Event().wait(0.01)
        threading.Event().wait(0.3)  # a load poll read the new throughputs
        # "a" is back, but restarted: its cache is empty, so the step goes where there is most room (a tie: "b").
        assert d.submit(step("x", 1)).result(timeout=20).server == "b"
        assert d.submit(step("x", 2)).result(timeout=20).server == "b"  # and stays there


class NoRadixServers(FakeServers):
    """Servers launched with --disable-radix-cache: their /server_info says so."""

    async def handle(self, request: httpx.Request) -> httpx.Response:
        if request.url.path == "/server_info":
            state = {"effective_max_running_requests_per_dp": self.capacity_reported}
            return httpx.Response(200, json={"internal_states": [state], "disable_radix_cache": True})
        return await super().handle(request)


def test_a_server_without_the_radix_cache_gets_no_affinity() -> None:
    fake = NoRadixServers()
    fake.throughput = {"a": 200.0}
    with dispatcher(fake) as d:
        threading.Event().wait(0.3)
        assert d.submit(step("x", 0)).result(timeout=20).server == "a"
        fake.throughput = {"b": 200.0}
        threading.Event().wait(0.3)
        assert d.submit(step("x", 1)).result(timeout=20).server == "b"  # nothing cached to go back for
        assert d.stats().affine == 0
