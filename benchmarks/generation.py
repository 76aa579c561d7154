"""Generation benchmark: 8 stand-in servers, long-tailed outputs, many shards through one dispatcher.

    python -m benchmarks.generation --out generation.json

Measures how close the dispatcher keeps the servers to their ideal capacity (the stand-in's timing model at a
full batch), the client's CPU per request and its memory; then runs 1x and 10x prompts with short outputs to
show that memory stays flat (prompts are streamed, not loaded).

Beside utilization it reports the bound: what a perfect, always-full client would reach on the same requests in
the same order (`tasks.chains.simulate_chains`, one-step chains in FIFO order, over the prompts' true output
lengths, the servers' slots and the stand-in's own timing model), and `ratio_to_bound` (measured / bound) for the
steady state and the whole run.
A whole run below the bound is the client's doing, tail included: the bound has the unavoidable tail already.

The same prompts run twice: in file order (FIFO) and long outputs first (the order the pipeline plans after a
pilot). Every server uses the same seed, so a prompt's output length depends on the prompt alone (the stand-in
draws it from a hash of the prompt's token ids). Each prompt carries a category, the band its length falls in
(short / medium / long, with the lognormal's own shares, so the length distribution is unchanged), as real data
carries a topic that correlates with output length. Long-first fits `tasks.ordering.LengthModel` on a 10% sample
of (category, prompt length, output tokens), i.e. what a pilot observes, and never sees the other lengths.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import itertools
import json
import os
import random
import re
import resource
import signal
import sys
import tempfile
import threading
import time
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from datagen.chat import ChatTokenizer
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.stats import DispatcherStats
from datagen.identity import prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import sha256_file
from datagen.records import Prompt
from datagen.runspec import RunSpec, SamplingSpec
from datagen.sources.preparation import Preparer, preparer_for, write_rendered
from datagen.standin.knobs import Knobs
from datagen.standin.synthetic import SyntheticModel
from datagen.standin.testing import run_standin
from tasks.chains import Chain, DecodeModel, simulate_chains
from tasks.generation import ShardResult, StepTokens, generate_shard
from tasks.ordering import LengthModel, LengthSample, prompt_chars

__all__ = ["TimedShards", "main", "run_once", "run_shards"]


def _rss_mb() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return 0.0


class _RssSampler:
    """Peak resident memory of this process over a window (ru_maxrss never goes down between runs)."""

    def __init__(self) -> None:
        self.peak = _rss_mb()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.2):
            self.peak = max(self.peak, _rss_mb())

    def __enter__(self) -> _RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


_METRIC = re.compile(r"^sglang:(\w+)\{[^}]*\} (\S+)$", re.MULTILINE)
_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / _CLK_TCK


def _standin_pid(port: int) -> int:
    """The stand-in process serving `port` (found by its command line)."""
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError):
                argv = (entry / "cmdline").read_bytes().split(b"\0")
                if b"datagen.standin" in argv and b"--port" in argv and argv[argv.index(b"--port") + 1] == b"%d" % port:
                    return int(entry.name)
    raise LookupError(f"no stand-in process on port {port}")


@dataclass
class _Sample:
    t: float
    running: list[float]
    queued_at_servers: list[float]
    server_tokens: float
    dispatcher_queue: int
    submitted: int


@dataclass
class _Monitor:
    """Samples every server's /metrics and the dispatcher's queue: occupancy and token counters over time."""

    endpoints: list[ServerEndpoint]
    dispatcher: Dispatcher
    interval_s: float = 0.25
    samples: list[_Sample] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self, http: httpx.Client) -> _Sample:
        running, queued, tokens = [], [], 0.0
        for ep in self.endpoints:
            values = {m[0]: float(m[1]) for m in _METRIC.findall(http.get(f"{ep.url}/metrics").text)}
            running.append(values["num_running_reqs"])
            queued.append(values["num_queue_reqs"])
            tokens += values["generation_tokens_total"]
        stats = self.dispatcher.stats()
        return _Sample(time.monotonic(), running, queued, tokens, stats.queued, stats.submitted)

    def _run(self) -> None:
        with httpx.Client(timeout=30) as http:
            while not self._stop.wait(self.interval_s):
                self.samples.append(self.sample(http))

    def __enter__(self) -> _Monitor:
        with httpx.Client(timeout=30) as http:
            self.samples.append(self.sample(http))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with httpx.Client(timeout=30) as http:
            self.samples.append(self.sample(http))


@dataclass
class TimedShards:
    """What `run_shards` measured: the shards' results, wall and CPU seconds (client and each server), memory."""

    results: list[ShardResult]
    wall_s: float
    cpu_s: float
    server_cpu_s: list[float]
    stats: DispatcherStats
    peak_rss_mb: float
    monitor: _Monitor | None


def run_shards(
    endpoints: list[ServerEndpoint],
    layout: RunLayout,
    chat: ChatTokenizer,
    spec: RunSpec,
    shards: int,
    workers: int,
    *,
    monitor: bool,
    queue_depth: int | None = None,
    step_tokens: StepTokens | None = None,
) -> TimedShards:
    """Generate shards 0..`shards`-1 of `layout` through one dispatcher, `workers` at once, timed from the first.

    `monitor`: sample the servers' /metrics and the dispatcher's queue meanwhile (`_Monitor`, for `_phases`).
    `step_tokens` (every turn): each conversation's expected step lengths, as a run's pilot gives them
    (`generate_shard`'s; None: the driver's own default, each step 1 when no pilot is on the box).
    """
    pids = [_standin_pid(int(ep.url.rsplit(":", 1)[1])) for ep in endpoints]
    with contextlib.ExitStack() as stack:
        depth = {} if queue_depth is None else {"queue_depth": queue_depth}  # None: the pipeline's default
        dispatcher = stack.enter_context(Dispatcher(endpoints, log_interval_s=15.0, stall_timeout_s=300.0, **depth))
        rss = stack.enter_context(_RssSampler())
        dispatcher.wait_ready(60)
        sampler = stack.enter_context(_Monitor(endpoints, dispatcher)) if monitor else None
        server_cpu0 = [_cpu_s(p) for p in pids]
        cpu0, t0 = time.process_time(), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(
                pool.map(
                    lambda s: generate_shard(
                        s, layout, dispatcher, chat, spec, flush_interval_s=2.0, step_tokens=step_tokens
                    ),
                    range(shards),
                )
            )
        wall = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        server_cpu = [_cpu_s(p) - c for p, c in zip(pids, server_cpu0, strict=True)]
        stats = dispatcher.stats()
    return TimedShards(results, wall, cpu, server_cpu, stats, rss.peak, sampler)


def _phases(
    samples: list[_Sample], n_requests: int, slots: int, ideal: float, model: DecodeModel | None = None
) -> dict[str, Any]:
    """Split the run into ramp-up (until every slot is busy), steady state and tail.

    The steady state ends when the dispatcher hands out its last request: from then on a slot that frees up
    has nothing to take (the unavoidable tail of the last, longest generations).

    Steady-state utilization is the servers' decode rate at the sampled batch sizes (`model`: the stand-in's own
    timing model) over the ideal, averaged over the steady samples. `generation_tokens_total` grows only when a
    request finishes (as in SGLang), so its delta over a window counts the tokens of requests that happen to
    finish inside it; it is kept as `steady_utilization_counter`, a cross-check that converges on long windows.
    """
    capacity = slots * len(samples[0].running)
    first, last = samples[0], samples[-1]
    end = next((s for s in samples if s.submitted >= n_requests and s.dispatcher_queue == 0), last)
    start = next((s for s in samples if sum(s.running) >= capacity or s is end), end)
    steady = [s for s in samples if start.t <= s.t <= end.t]
    ramp_s, steady_s, tail_s = start.t - first.t, end.t - start.t, last.t - end.t

    def rate(a: _Sample, b: _Sample) -> float:
        return (b.server_tokens - a.server_tokens) / max(b.t - a.t, 1e-9)

    if model is not None and steady:
        decode = sum(sum(model.tokens_per_s(round(b)) for b in s.running) for s in steady) / len(steady)
        steady_utilization = decode / ideal
    else:
        steady_utilization = rate(start, end) / ideal
    return {
        "ramp_s": ramp_s,
        "steady_s": steady_s,
        "steady_utilization": steady_utilization,
        "steady_utilization_counter": rate(start, end) / ideal,
        "steady_slot_occupancy": sum(sum(s.running) for s in steady) / max(1, len(steady)) / capacity,
        "steady_mean_waiting_at_servers": sum(sum(s.queued_at_servers) for s in steady) / max(1, len(steady)),
        "tail_s": tail_s,
        "tail_share_of_wall": tail_s / max(last.t - first.t, 1e-9),
        "tail_utilization": rate(end, last) / ideal,
        "tail_tokens_share": (last.server_tokens - end.server_tokens)
        / max(last.server_tokens - first.server_tokens, 1),
    }


def _against_bound(
    run: dict[str, Any], lengths: list[int], model: DecodeModel, servers: int, slots: int
) -> dict[str, Any]:
    """The perfect client's figures on the same requests in the same order, and the measured run's ratio to them."""
    best = simulate_chains([Chain((n,)) for n in lengths], servers, slots, model)  # FIFO, one step each
    steady_rate = best.tokens_at_last_start / max(best.last_start_s, 1e-9)  # every slot busy: the full-batch rate
    measured_steady = run["steady_utilization"] * servers * model.tokens_per_s(slots)
    return {
        "bound": {
            "output_tokens": sum(lengths),
            "wall_s": best.wall_s,
            "steady_s": best.last_start_s,
            "steady_tokens_per_s": steady_rate,
            "tail_s": best.wall_s - best.last_start_s,
            "tail_share_of_wall": (best.wall_s - best.last_start_s) / max(best.wall_s, 1e-9),
            "output_tokens_per_s": sum(lengths) / max(best.wall_s, 1e-9),
        },
        "ratio_to_bound": {
            "steady": measured_steady / steady_rate if steady_rate > 0 else None,  # None: no slot ever full
            "whole_run": best.wall_s / run["wall_s"],  # same tokens: the ratio of throughputs
        },
        # Where the whole run's extra seconds went, against the bound (which has no ramp).
        "excess_s": {
            "total": run["wall_s"] - best.wall_s,
            "ramp": run["ramp_s"],
            "steady": run["steady_s"] - best.last_start_s,
            "tail": run["tail_s"] - (best.wall_s - best.last_start_s),
        },
    }


# Output-length bands (tokens) that name a prompt's category.
BANDS = (("short", 0, 800), ("medium", 800, 2500), ("long", 2500, 1 << 30))
PILOT_SHARE = 0.10


def _simple_prompts(n_prompts: int, tag: str) -> Iterator[Prompt]:
    """Short prompts, generated as they are written (the memory runs must not hold them)."""
    for n in range(n_prompts):
        messages = [{"role": "user", "content": f"[{tag}] Problem {n}: explain step by step why {n} * 3 = {n * 3}."}]
        yield Prompt(prompt_id_from_messages(tag, messages), tag, n, messages)


def _categorized_prompts(
    chat: ChatTokenizer, knobs: Knobs, n_prompts: int, max_new_tokens: int, seed: int
) -> tuple[list[Prompt], dict[str, int]]:
    """Prompts of varied length, each labelled with its output-length band; also every prompt's true length."""
    synthetic = SyntheticModel(chat, knobs)
    rng = random.Random(seed)
    verbs = ("why", "how", "list", "prove", "compare", "sketch", "derive", "outline")
    prompts, lengths = [], {}
    for n in range(n_prompts):
        words = " ".join(rng.choice(verbs) for _ in range(rng.randint(3, 40)))
        messages = [{"role": "user", "content": f"Request {n}: {words}."}]
        ids = chat.prompt_ids(messages, True)
        length = len(synthetic.plan(ids, max_new_tokens=max_new_tokens).ids)
        category = next(name for name, lo, hi in BANDS if lo <= length < hi)
        prompt = Prompt(prompt_id_from_messages("bench", messages), "bench", n, messages, category=category)
        prompts.append(prompt)
        lengths[prompt.prompt_id] = length
    return prompts, lengths


def _long_first(prompts: list[Prompt], lengths: dict[str, int], seed: int) -> tuple[list[Prompt], dict[str, Any]]:
    """The prompts by predicted length, longest first, from a length model fitted on a pilot-sized sample."""
    sample = random.Random(seed).sample(prompts, max(1, round(PILOT_SHARE * len(prompts))))
    model = LengthModel.fit(
        LengthSample(
            source=p.source, category=p.category, prompt_chars=prompt_chars(p), output_tokens=lengths[p.prompt_id]
        )
        for p in sample
    )
    ordered = sorted(prompts, key=model.predict, reverse=True)  # stable: ties keep file order
    return ordered, {"pilot_samples": len(sample), "length_model": model.model_dump()}


def _write_shards(
    layout: RunLayout, prompts: Iterable[Prompt], shards: int, per_shard: int, prepare: Preparer | None
) -> int:
    """Cut `prompts`, in their order, into shards of `per_shard`; return how many were written.

    With `prepare`, each shard also gets planning's render cache (datagen.sources.preparation), as
    `tasks.planning` writes it, so generation sends the ids rendered at planning
    instead of rendering every prompt again.
    """
    it = iter(prompts)
    written = 0
    for s in range(shards):
        path = layout.shard_prompts(s)
        path.parent.mkdir(parents=True, exist_ok=True)
        ids: list[array[int] | None] = []
        with open(path, "w") as f:
            for prompt in itertools.islice(it, per_shard):
                f.write(prompt.to_json() + "\n")
                if prepare is not None:
                    ids.append(array("i", prepare(prompt.messages, prompt.tools)))
                written += 1
        if prepare is not None:
            write_rendered(path, sha256_file(path), prepare.render_key, ids)
    return written


def run_once(
    endpoints: list[ServerEndpoint],
    chat: ChatTokenizer,
    work_dir: Path,
    *,
    prompts: Iterable[Prompt],
    shards: int,
    per_shard: int,
    max_new_tokens: int,
    workers: int,
    tag: str,
    ideal: float | None = None,
    bound: tuple[list[int], DecodeModel] | None = None,
    planned_render: bool = True,
    queue_depth: int | None = None,
) -> dict[str, Any]:
    """Generate `prompts` (in this order, cut into `shards`) through one dispatcher; return throughput and memory.

    With `ideal` (tok/s), also sample the servers and split utilization into steady state and end-of-run tail.
    With `bound` (every prompt's true output length in this order, and the servers' timing model), also compare
    with a perfect always-full client on the same requests (`ratio_to_bound`). `planned_render`: the shards carry
    planning's render cache, as the pipeline's do (False: generation renders every prompt itself).
    """
    layout = RunLayout(work_dir / tag)
    # One request per prompt, as the figures in benchmarks/README.md were measured.
    spec = RunSpec(model_path=str(chat.model_dir), sampling=SamplingSpec(max_new_tokens=max_new_tokens), turns="last")
    n_written = _write_shards(layout, prompts, shards, per_shard, preparer_for(spec, chat) if planned_render else None)
    timed = run_shards(endpoints, layout, chat, spec, shards, workers, monitor=bool(ideal), queue_depth=queue_depth)
    results, wall, cpu, server_cpu, stats, monitor = (
        timed.results,
        timed.wall_s,
        timed.cpu_s,
        timed.server_cpu_s,
        timed.stats,
        timed.monitor,
    )
    n = sum(r.n_prompts for r in results)
    assert n == sum(r.n_completed + r.n_rejected for r in results) == n_written
    tokens = sum(r.output_tokens for r in results)
    out: dict[str, Any] = {
        "prompts": n,
        "completed": sum(r.n_completed for r in results),
        "rejected": sum(r.n_rejected for r in results),
        "output_tokens": tokens,
        "mean_output_tokens": tokens / max(1, sum(r.n_completed for r in results)),
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "client_cpu_ms_per_request": 1000 * cpu / max(1, n),
        "client_cpu_share_of_one_core": cpu / wall,
        "server_cpu_share_of_one_core": [c / wall for c in server_cpu],
        "box_cpu_busy_share": (cpu + sum(server_cpu)) / (wall * (os.cpu_count() or 1)),
        "peak_rss_mb": timed.peak_rss_mb,
        "retries": stats.retries,
        "requeued": stats.requeued,
        "servers_down_at_end": [s.name for s in stats.servers if s.state != "up"],
    }
    if monitor is not None and ideal is not None:
        out |= _phases(monitor.samples, n, endpoints[0].max_running_requests or 0, ideal, bound[1] if bound else None)
        t0 = monitor.samples[0].t
        if bound is not None:
            out |= _against_bound(out, *bound, len(endpoints), endpoints[0].max_running_requests or 0)
        out["timeline"] = [
            [round(x.t - t0, 2), sum(x.running), sum(x.queued_at_servers), x.dispatcher_queue, round(x.server_tokens)]
            for x in monitor.samples[:: max(1, len(monitor.samples) // 200)]
        ]
    return out


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON report."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generation")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--shards", type=int, default=20)
    ap.add_argument("--per-shard", type=int, default=150)
    ap.add_argument("--workers", type=int, default=20, help="shard tasks running at once")
    ap.add_argument("--length-mean", type=float, default=1500)
    ap.add_argument("--length-max", type=int, default=8000)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--step-base-ms", type=float, default=20.0)
    ap.add_argument("--step-per-req-ms", type=float, default=0.2)
    ap.add_argument("--tokens-per-step", type=int, default=256)
    ap.add_argument(
        "--memory-per-shard", type=int, default=50, help="1x prompts per shard of the memory runs (0: no memory runs)"
    )
    ap.add_argument(
        "--order",
        choices=("both", "fifo", "long-first"),
        default="both",
        help="dispatch order(s) of the main run; `utilization` reports long-first when it runs (the pipeline's order "
        "after a pilot), FIFO otherwise",
    )
    ap.add_argument("--seed", type=int, default=7, help="prompt texts and the pilot sample")
    ap.add_argument(
        "--queue-depth", type=int, default=None, help="requests kept waiting at each server (default: the pipeline's)"
    )
    ap.add_argument(
        "--render-at-generation",
        action="store_true",
        help="shards without planning's render cache: every prompt is rendered by its shard worker (the path of a "
        "box that fetched only the prompts file; the benchmark's path before 2026-12-04)",
    )
    args = ap.parse_args(argv)
    # Killed with SIGTERM (timeout, another engineer's cleanup): unwind, so the stand-in servers are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()  # the box is shared: say how busy it was

    env = {
        "DATAGEN_STANDIN_LOAD_S": "0.1",
        "DATAGEN_STANDIN_WARMUP_S": "0.1",
        "DATAGEN_STANDIN_LENGTH_MEAN": str(args.length_mean),
        "DATAGEN_STANDIN_LENGTH_SIGMA": "0.8",
        "DATAGEN_STANDIN_LENGTH_MAX": str(args.length_max),
        "DATAGEN_STANDIN_STEP_BASE_MS": str(args.step_base_ms),
        "DATAGEN_STANDIN_STEP_PER_REQ_MS": str(args.step_per_req_ms),
        "DATAGEN_STANDIN_TIME_SCALE": str(args.time_scale),
        "DATAGEN_STANDIN_TOKENS_PER_STEP": str(args.tokens_per_step),
        "DATAGEN_STANDIN_SEED": "0",  # every server draws the same output for a prompt: the orders are comparable
    }
    # The stand-in's step costs tokens_per_step x (base + per_req x batch) x time_scale ms for
    # tokens_per_step tokens per running request, so a full batch decodes this many tokens/s:
    per_server = args.slots * 1000.0 / ((args.step_base_ms + args.step_per_req_ms * args.slots) * args.time_scale)
    ideal = per_server * args.servers
    timing = DecodeModel(args.step_base_ms * args.time_scale / 1000, args.step_per_req_ms * args.time_scale / 1000)
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gen-")))
        endpoints = [
            stack.enter_context(
                run_standin(
                    chat.model_dir,
                    args=("--max-running-requests", str(args.slots), "--enable-metrics"),
                    env=env,
                )
            )
            for _ in range(args.servers)
        ]
        prompts, lengths = _categorized_prompts(
            chat, Knobs.from_env(env), args.shards * args.per_shard, args.length_max, args.seed
        )
        ordered, pilot = _long_first(prompts, lengths, args.seed)
        orders = {"fifo": prompts, "long-first": ordered}
        runs: dict[str, dict[str, Any]] = {}
        for name in ("fifo", "long-first") if args.order == "both" else (args.order,):
            runs[name] = run_once(
                endpoints,
                chat,
                work,
                prompts=orders[name],
                shards=args.shards,
                per_shard=args.per_shard,
                max_new_tokens=args.length_max,
                workers=args.workers,
                tag=name,
                ideal=ideal,
                bound=([lengths[p.prompt_id] for p in orders[name]], timing),
                planned_render=not args.render_at_generation,
                queue_depth=args.queue_depth,
            )
        main_name = "long-first" if "long-first" in runs else "fifo"
        main_run = runs[main_name]
        small = dict(shards=args.shards, max_new_tokens=16, workers=args.workers)
        memory: dict[str, dict[str, Any]] = {}
        if args.memory_per_shard:  # 0 skips the memory runs (a shorter benchmark)
            memory["mem 1x"] = run_once(
                endpoints,
                chat,
                work,
                prompts=_simple_prompts(args.shards * args.memory_per_shard, "mem1x"),
                per_shard=args.memory_per_shard,
                tag="mem1x",
                **small,
            )
            memory["mem 10x"] = run_once(
                endpoints,
                chat,
                work,
                prompts=_simple_prompts(args.shards * 10 * args.memory_per_shard, "mem10x"),
                per_shard=10 * args.memory_per_shard,
                tag="mem10x",
                **small,
            )

    report = {
        "config": vars(args) | {"out": str(args.out)},
        "ideal_tokens_per_s": ideal,
        "output_tokens_per_s": main_run["output_tokens_per_s"],
        "order": main_name,
        "utilization": main_run["output_tokens_per_s"] / ideal,
        "utilization_by_order": {k: r["output_tokens_per_s"] / ideal for k, r in runs.items()},
        "steady_utilization": main_run["steady_utilization"],
        "ratio_to_bound": main_run["ratio_to_bound"],
        "ratio_to_bound_by_order": {k: r["ratio_to_bound"] for k, r in runs.items()},
        "bound": main_run["bound"],
        "tail_share_of_wall": main_run["tail_share_of_wall"],
        "client_cpu_ms_per_request": main_run["client_cpu_ms_per_request"],
        "peak_rss_mb": main_run["peak_rss_mb"],
        "main": main_run,
        "runs": runs,
        "true_mean_output_tokens": sum(lengths.values()) / len(lengths),
        "category_counts": {c: sum(p.category == c for p in prompts) for c, _, _ in BANDS},
        "pilot": pilot,
        "memory_1x": memory.get("mem 1x"),
        "memory_10x": memory.get("mem 10x"),
        "memory_growth_10x_mb": memory["mem 10x"]["peak_rss_mb"] - memory["mem 1x"]["peak_rss_mb"] if memory else None,
        "max_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cpu_count": os.cpu_count(),
    }
    report["load_average_1_5_15_min"] = {"before": load_before, "after": os.getloadavg()}
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'run':10} {'prompts':>8} {'tokens':>10} {'wall s':>7} {'tok/s':>9} {'cpu ms/req':>10} {'peak MB':>8}")
    for name, r in (*runs.items(), *memory.items()):
        print(
            f"{name:10} {r['prompts']:>8} {r['output_tokens']:>10} {r['wall_s']:>7.1f} "
            f"{r['output_tokens_per_s']:>9.0f} "
            f"{r['client_cpu_ms_per_request']:>10.2f} {r['peak_rss_mb']:>8.0f}"
        )
    for name, r in runs.items():
        b, ratio = r["bound"], r["ratio_to_bound"]
        print(
            f"utilization {name}: {r['output_tokens_per_s'] / ideal:.1%}; bound (perfect client, same order) "
            f"{b['wall_s']:.1f} s, tail {b['tail_s']:.1f} s; ratio to bound: steady "
            + (f"{ratio['steady']:.3f}" if ratio["steady"] is not None else "n/a (no slot ever full)")
            + f", whole run {ratio['whole_run']:.3f} (excess s: "
            + ", ".join(f"{k} {v:.1f}" for k, v in r["excess_s"].items())
            + ")"
        )
    print(
        f"[{main_name}] ideal {ideal:.0f} tok/s; utilization {report['utilization']:.1%} over the whole run, "
        f"{main_run['steady_utilization']:.1%} in steady state ({main_run['steady_s']:.1f} s after a "
        f"{main_run['ramp_s']:.1f} s ramp, slot occupancy "
        f"{main_run['steady_slot_occupancy']:.1%}); tail {main_run['tail_s']:.1f} s = "
        f"{main_run['tail_share_of_wall']:.1%} of the wall time at {main_run['tail_utilization']:.1%}"
    )
    print(
        f"CPU (share of one core): client {main_run['client_cpu_share_of_one_core']:.2f}, servers "
        + " ".join(f"{c:.2f}" for c in main_run["server_cpu_share_of_one_core"])
        + f"; box busy {main_run['box_cpu_busy_share']:.0%} of {os.cpu_count()} cores"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
