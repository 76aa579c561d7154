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
import resource
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

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
) -> dict[str, Any]:
    """Generate `shards` x `per_shard` prompts through one dispatcher; return throughput and memory numbers."""
    layout = RunLayout(work_dir / tag)
    _write_shards(layout, shards, per_shard, tag)
    spec = RunSpec(model_path=str(chat.model_dir), sampling=SamplingSpec(max_new_tokens=max_new_tokens))
    with Dispatcher(endpoints, log_interval_s=15.0, stall_timeout_s=300.0) as dispatcher, _RssSampler() as rss:
        dispatcher.wait_ready(60)
        cpu0, t0 = time.process_time(), time.monotonic()
        with concurrent.futures.ThreadPoolExecutor(workers) as pool:
            results = list(
                pool.map(
                    lambda s: generate_shard(s, layout, dispatcher, chat, spec, flush_interval_s=2.0), range(shards)
                )
            )
        wall = time.monotonic() - t0
        cpu = time.process_time() - cpu0
        stats = dispatcher.stats()
    n = sum(r.n_prompts for r in results)
    assert n == sum(r.n_completed + r.n_rejected for r in results) == shards * per_shard
    tokens = sum(r.output_tokens for r in results)
    return {
        "prompts": n,
        "completed": sum(r.n_completed for r in results),
        "rejected": sum(r.n_rejected for r in results),
        "output_tokens": tokens,
        "mean_output_tokens": tokens / max(1, sum(r.n_completed for r in results)),
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "client_cpu_ms_per_request": 1000 * cpu / max(1, n),
        "peak_rss_mb": rss.peak,
        "retries": stats.retries,
        "requeued": stats.requeued,
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON report."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.generation")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--servers", type=int, default=8)
    ap.add_argument("--slots", type=int, default=64)
    ap.add_argument("--shards", type=int, default=20)
    ap.add_argument("--per-shard", type=int, default=150)
    ap.add_argument("--workers", type=int, default=4, help="shard tasks running at once")
    ap.add_argument("--length-mean", type=float, default=1500)
    ap.add_argument("--length-max", type=int, default=8000)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--step-base-ms", type=float, default=20.0)
    ap.add_argument("--step-per-req-ms", type=float, default=0.2)
    ap.add_argument("--tokens-per-step", type=int, default=64)
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
                    args=("--max-running-requests", str(args.slots)),
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
        )
        small = dict(shards=args.shards, max_new_tokens=16, workers=args.workers)
        mem_1x = run_once(endpoints, chat, work, per_shard=args.memory_per_shard, tag="mem1x", **small)
        mem_10x = run_once(endpoints, chat, work, per_shard=10 * args.memory_per_shard, tag="mem10x", **small)

    report = {
        "config": vars(args) | {"out": str(args.out)},
        "ideal_tokens_per_s": ideal,
        "output_tokens_per_s": main_run["output_tokens_per_s"],
        "utilization": main_run["output_tokens_per_s"] / ideal,
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
    print(f"ideal {ideal:.0f} tok/s; utilization {report['utilization']:.1%} (end-of-run drain included)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
