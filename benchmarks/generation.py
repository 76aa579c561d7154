"""Generation benchmark: 8 stand-in servers, long-tailed outputs, many shards through one dispatcher.

    python -m benchmarks.generation --out generation.json

Measures how close the dispatcher keeps the servers to their ideal capacity (the stand-in's timing model at a
full batch), the client's CPU per request and its memory; then runs 1x and 10x prompts with short outputs to
show that memory stays flat (prompts are streamed, not loaded).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import re
import resource
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from datagen.chat import ChatTokenizer
from datagen.endpoints import ServerEndpoint
from datagen.engine.dispatcher import Dispatcher
from datagen.layout import RunLayout
from datagen.model_fixture import ensure_model_dir
from datagen.records import Prompt, prompt_id_for
from datagen.runspec import RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from tasks.generation import generate_shard

__all__ = ["main", "run_once"]


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


def _phases(samples: list[_Sample], n_requests: int, slots: int, ideal: float) -> dict[str, Any]:
    """Split the run into ramp-up (until every slot is busy), steady state and tail.

    The steady state ends when the dispatcher hands out its last request: from then on a slot that frees up
    has nothing to take (the unavoidable tail of the last, longest generations).
    """
    capacity = slots * len(samples[0].running)
    first, last = samples[0], samples[-1]
    end = next((s for s in samples if s.submitted >= n_requests and s.dispatcher_queue == 0), last)
    start = next((s for s in samples if sum(s.running) >= capacity or s is end), end)
    steady = [s for s in samples if start.t <= s.t <= end.t]
    ramp_s, steady_s, tail_s = start.t - first.t, end.t - start.t, last.t - end.t

    def rate(a: _Sample, b: _Sample) -> float:
        return (b.server_tokens - a.server_tokens) / max(b.t - a.t, 1e-9)

    return {
        "ramp_s": ramp_s,
        "steady_s": steady_s,
        "steady_utilization": rate(start, end) / ideal,
        "steady_slot_occupancy": sum(sum(s.running) for s in steady) / max(1, len(steady)) / capacity,
        "steady_mean_waiting_at_servers": sum(sum(s.queued_at_servers) for s in steady) / max(1, len(steady)),
        "tail_s": tail_s,
        "tail_share_of_wall": tail_s / max(last.t - first.t, 1e-9),
        "tail_utilization": rate(end, last) / ideal,
        "tail_tokens_share": (last.server_tokens - end.server_tokens)
        / max(last.server_tokens - first.server_tokens, 1),
    }


def _write_shards(layout: RunLayout, shards: int, per_shard: int, tag: str) -> None:
    for s in range(shards):
        path = layout.shard_prompts(s)
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(path, "w") as f:
            for i in range(per_shard):
                n = s * per_shard + i
                messages = [
                    {"role": "user", "content": f"[{tag}] Problem {n}: explain step by step why {n} * 3 = {n * 3}."}
                ]
                f.write(Prompt(prompt_id_for(tag, messages), tag, n, messages).to_json() + "\n")


def run_once(
    endpoints: list[ServerEndpoint],
    chat: ChatTokenizer,
    work_dir: Path,
    *,
    shards: int,
    per_shard: int,
    max_new_tokens: int,
    workers: int,
    tag: str,
    ideal: float | None = None,
) -> dict[str, Any]:
    """Generate `shards` x `per_shard` prompts through one dispatcher; return throughput and memory numbers.

    With `ideal` (tok/s), also sample the servers and split utilization into steady state and end-of-run tail.
    """
    layout = RunLayout(work_dir / tag)
    _write_shards(layout, shards, per_shard, tag)
    spec = RunSpec(model_path=str(chat.model_dir), sampling=SamplingSpec(max_new_tokens=max_new_tokens))
    pids = [_standin_pid(int(ep.url.rsplit(":", 1)[1])) for ep in endpoints]
    with contextlib.ExitStack() as stack:
        dispatcher = stack.enter_context(Dispatcher(endpoints, log_interval_s=15.0, stall_timeout_s=300.0))
        rss = stack.enter_context(_RssSampler())
        dispatcher.wait_ready(60)
        monitor = stack.enter_context(_Monitor(endpoints, dispatcher)) if ideal else None
        server_cpu0 = [_cpu_s(p) for p in pids]
        cpu0, t0 = time.process_time(), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(
                pool.map(
                    lambda s: generate_shard(s, layout, dispatcher, chat, spec, flush_interval_s=2.0), range(shards)
                )
            )
        wall = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        server_cpu = [_cpu_s(p) - c for p, c in zip(pids, server_cpu0, strict=True)]
        stats = dispatcher.stats()
    n = sum(r.n_prompts for r in results)
    assert n == sum(r.n_completed + r.n_rejected for r in results) == shards * per_shard
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
        "peak_rss_mb": rss.peak,
        "retries": stats.retries,
        "requeued": stats.requeued,
        "servers_down_at_end": [s.name for s in stats.servers if s.state != "up"],
    }
    if monitor is not None and ideal is not None:
        out |= _phases(monitor.samples, n, endpoints[0].max_running_requests or 0, ideal)
        t0 = monitor.samples[0].t
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
    ap.add_argument("--memory-per-shard", type=int, default=50, help="1x prompts per shard of the memory runs")
    args = ap.parse_args(argv)

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
    }
    # The stand-in's step costs tokens_per_step x (base + per_req x batch) x time_scale ms for
    # tokens_per_step tokens per running request, so a full batch decodes this many tokens/s:
    per_server = args.slots * 1000.0 / ((args.step_base_ms + args.step_per_req_ms * args.slots) * args.time_scale)
    ideal = per_server * args.servers
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-gen-")))
        endpoints = [
            stack.enter_context(
                run_standin(
                    chat.model_dir,
                    args=("--max-running-requests", str(args.slots), "--enable-metrics"),
                    env={**env, "DATAGEN_STANDIN_SEED": str(i)},
                )
            )
            for i in range(args.servers)
        ]
        main_run = run_once(
            endpoints,
            chat,
            work,
            shards=args.shards,
            per_shard=args.per_shard,
            max_new_tokens=args.length_max,
            workers=args.workers,
            tag="main",
            ideal=ideal,
        )
        small = dict(shards=args.shards, max_new_tokens=16, workers=args.workers)
        mem_1x = run_once(endpoints, chat, work, per_shard=args.memory_per_shard, tag="mem1x", **small)
        mem_10x = run_once(endpoints, chat, work, per_shard=10 * args.memory_per_shard, tag="mem10x", **small)

    report = {
        "config": vars(args) | {"out": str(args.out)},
        "ideal_tokens_per_s": ideal,
        "output_tokens_per_s": main_run["output_tokens_per_s"],
        "utilization": main_run["output_tokens_per_s"] / ideal,
        "steady_utilization": main_run["steady_utilization"],
        "tail_share_of_wall": main_run["tail_share_of_wall"],
        "client_cpu_ms_per_request": main_run["client_cpu_ms_per_request"],
        "peak_rss_mb": main_run["peak_rss_mb"],
        "main": main_run,
        "memory_1x": mem_1x,
        "memory_10x": mem_10x,
        "memory_growth_10x_mb": mem_10x["peak_rss_mb"] - mem_1x["peak_rss_mb"],
        "max_rss_mb_process": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "cpu_count": os.cpu_count(),
    }
    args.out.write_text(json.dumps(report, indent=2))
    print(f"{'run':8} {'prompts':>8} {'tokens':>10} {'wall s':>7} {'tok/s':>9} {'cpu ms/req':>10} {'peak MB':>8}")
    for name, r in (("main", main_run), ("mem 1x", mem_1x), ("mem 10x", mem_10x)):
        print(
            f"{name:8} {r['prompts']:>8} {r['output_tokens']:>10} {r['wall_s']:>7.1f} {r['output_tokens_per_s']:>9.0f} "
            f"{r['client_cpu_ms_per_request']:>10.2f} {r['peak_rss_mb']:>8.0f}"
        )
    print(
        f"ideal {ideal:.0f} tok/s; utilization {report['utilization']:.1%} over the whole run, "
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
