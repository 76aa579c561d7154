"""Pilot benchmark: does the pilot's projection match the full run, and does long-first beat FIFO dispatch?

    python -m benchmarks.pilot --out pilot.json [--turns every]

On stand-in servers: a pilot (seeded sample, stratified by source) projects output tokens and wall time for the
full set; then the full set runs three times on the same servers and prompts: FIFO (file order), long-first
(ordered by the pilot's length model), and the main run as the pipeline does it (long-first, reusing the pilot's
completions). Reports projected vs actual wall time and tokens with relative errors, and utilization (output
tokens/s over the stand-in's ideal full-batch rate) of FIFO vs long-first.

How output length depends on the prompt without changing the stand-in: the stand-in draws each output length
from a hash of the prompt's token ids (same knobs, same seed on every server). The benchmark computes that length
with the stand-in's own `SyntheticModel` for candidate prompts and keeps, per category, only candidates whose
length falls in that category's band (short / medium / long). The prompt set thus has a per-category length
structure, as real data does (math proofs run long, greetings short), with spread inside each category; the
predictor sees only source, category and prompt length, never the hash.

`--turns every`: the prompts are `benchmarks.conversations`' plain conversations (1-5 user turns) and every run
uses `turns: every`; the main runs name the pilot, so the shard driver ranks conversations by the pilot's lengths
(as the projection's chain simulation assumes), and FIFO means plan order in the file's order.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.conversations import workload
from datagen.chat import ChatTokenizer
from datagen.checks.repetition import word_tokens
from datagen.conversation.turn_mode import turn_mode
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.endpoints import ServerEndpoint
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from datagen.standin.knobs import Knobs
from datagen.standin.synthetic import SyntheticModel
from datagen.standin.testing import run_standin
from tasks.generation import ShardResult, generate_shard
from tasks.ordering import LengthModel, long_first_filter
from tasks.pilot import PilotSpec, ThroughputProbe, import_pilot, plan_pilot, project, write_projection
from tasks.planning import ShardPlan, plan_shards
from tasks.validation import validate_shards

__all__ = ["main"]

# Category -> output-length band (tokens) and its share of each source.
BANDS = {"short": (40, 500), "medium": (500, 1500), "long": (1500, 8000)}
SOURCES = {"forum": {"short": 0.6, "medium": 0.3, "long": 0.1}, "tasks": {"short": 0.2, "medium": 0.4, "long": 0.4}}


def _write_prompts(chat: ChatTokenizer, knobs: Knobs, out_dir: Path, n: int, seed: int) -> list[PromptSource]:
    """Prompt files whose stand-in output lengths fall in their category's band (see the module docstring)."""
    synthetic = SyntheticModel(chat, knobs)
    rng = random.Random(seed)
    sources = []
    counter = 0
    for source, mix in SOURCES.items():
        rows: list[dict[str, Any]] = []
        for category, share in mix.items():
            lo, hi = BANDS[category]
            want = round(n / len(SOURCES) * share)
            got = 0
            while got < want:
                counter += 1
                words = " ".join(rng.choice(("why", "how", "list", "prove", "compare", "sketch")) for _ in range(6))
                content = f"[{source}/{category}] Request {counter}: {words} item {counter}."
                ids = chat.prompt_ids([{"role": "user", "content": content}], True)
                length = len(synthetic.plan(ids, max_new_tokens=1 << 20).ids)
                if lo <= length < hi:
                    rows.append({"messages": [{"role": "user", "content": content}], "category": category})
                    got += 1
        rng.shuffle(rows)  # file order (FIFO) mixes the categories
        path = out_dir / f"{source}.jsonl"
        path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
        sources.append(PromptSource(path=str(path), category_field="category"))
    return sources


def _write_conversations(out_dir: Path, n: int, seed: int) -> list[PromptSource]:
    """One source of plain multi-turn conversations (`benchmarks.conversations.workload`), recorded as files hold
    them."""
    path = out_dir / "plain.jsonl"
    rows = [{"messages": [m.to_dict() for m in p.messages]} for p in workload("plain", n, seed)]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return [PromptSource(path=str(path))]


def _generate(
    endpoints: list[ServerEndpoint],
    chat: ChatTokenizer,
    spec: RunSpec,
    layout: RunLayout,
    plan: ShardPlan,
    workers: int,
) -> tuple[list[ShardResult], dict[str, Any]]:
    with Dispatcher(endpoints, log_interval_s=30.0, stall_timeout_s=300.0) as dispatcher:
        dispatcher.wait_ready(60)
        with ThroughputProbe(dispatcher, endpoints) as probe, concurrent.futures.ThreadPoolExecutor(workers) as pool:
            t0 = time.monotonic()
            results = list(pool.map(lambda s: generate_shard(s, layout, dispatcher, chat, spec), plan.shard_ids))
            wall = time.monotonic() - t0
        measured = probe.measure()
    tokens = sum(r.output_tokens for r in results)
    sent = sum(r.n_sent for r in results)
    return results, {"wall_s": wall, "output_tokens": tokens, "requests_sent": sent, "throughput": measured}


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON report."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.pilot")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=1200)
    ap.add_argument("--pilot-size", type=int, default=240)
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=32)
    ap.add_argument("--shard-size", type=int, default=50)
    ap.add_argument("--workers", type=int, default=32, help="shards in flight (the flow's SHARDS_IN_FLIGHT is 32)")
    ap.add_argument("--time-scale", type=float, default=0.1)
    ap.add_argument("--step-base-ms", type=float, default=20.0)
    ap.add_argument("--step-per-req-ms", type=float, default=0.5)
    ap.add_argument("--tokens-per-step", type=int, default=64)
    ap.add_argument(
        "--no-metrics", action="store_true", help="servers without --enable-metrics (the pilot reads /v1/loads)"
    )
    ap.add_argument("--turns", choices=("last", "every"), default="last", help="every: plain conversations")
    args = ap.parse_args(argv)
    # Killed with SIGTERM (timeout, another engineer's cleanup): unwind, so the stand-in servers are stopped too.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()  # the box is shared: say how busy it was

    env = {
        "DATAGEN_STANDIN_LOAD_S": "0.1",
        "DATAGEN_STANDIN_WARMUP_S": "0.1",
        "DATAGEN_STANDIN_LENGTH_MEAN": "900",
        "DATAGEN_STANDIN_LENGTH_SIGMA": "1.0",
        "DATAGEN_STANDIN_LENGTH_MAX": "8000",
        "DATAGEN_STANDIN_STEP_BASE_MS": str(args.step_base_ms),
        "DATAGEN_STANDIN_STEP_PER_REQ_MS": str(args.step_per_req_ms),
        "DATAGEN_STANDIN_TIME_SCALE": str(args.time_scale),
        "DATAGEN_STANDIN_TOKENS_PER_STEP": str(args.tokens_per_step),
        "DATAGEN_STANDIN_SEED": "0",  # every server draws the same length for a prompt
    }
    per_server = args.slots * 1000.0 / ((args.step_base_ms + args.step_per_req_ms * args.slots) * args.time_scale)
    ideal = per_server * args.servers
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    word_tokens(chat)  # validation's word table, built once per process: not part of the pilot's ramp
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-pilot-")))
        if args.turns == "every":
            sources = _write_conversations(work, args.prompts, seed=1)
        else:
            sources = _write_prompts(chat, Knobs.from_env(env), work, args.prompts, seed=1)
        spec = RunSpec(
            sources=sources,
            model_path=str(chat.model_dir),
            shard_size=args.shard_size,
            sampling=SamplingSpec(max_new_tokens=8192),
            context_length=65536,
            turns=args.turns,
        )
        endpoints = [
            stack.enter_context(
                run_standin(
                    chat.model_dir,
                    args=(
                        "--max-running-requests",
                        str(args.slots),
                        *(() if args.no_metrics else ("--enable-metrics",)),
                    ),
                    env=env,
                )
            )
            for _ in range(args.servers)
        ]

        pilot_spec = PilotSpec(name="pilot", sample_size=args.pilot_size, seed=3)
        pilot_layout = RunLayout(work / "pilot")
        pilot_plan, population = plan_pilot(spec, pilot_spec, pilot_layout, set())
        pilot_results, pilot_run = _generate(endpoints, chat, spec, pilot_layout, pilot_plan, args.workers)
        summary = validate_shards(
            [Path(r.completions_path) for r in pilot_results],
            pilot_layout.validated_dir,
            spec.validation,
            True,
            turns=turn_mode(spec),
        )
        projection = project(
            pilot_layout,
            pilot_plan,
            population,
            summary,
            pilot_run["throughput"],
            args.servers,
            pilot_spec,
            turns=turn_mode(spec),
        )
        model: LengthModel = projection.length_model
        if args.turns == "every":  # the driver ranks conversations by the pilot's lengths (`pilot_step_tokens`)
            write_projection(pilot_layout, projection)
            spec = spec.model_copy(update={"pilot": "pilot"})

        fifo_layout = RunLayout(work / "fifo")
        _, fifo = _generate(endpoints, chat, spec, fifo_layout, plan_shards(spec, fifo_layout), args.workers)
        lf_layout = RunLayout(work / "long_first")
        lf_plan = plan_shards(spec, lf_layout, select=long_first_filter(model, work / "spill"))
        _, long_first = _generate(endpoints, chat, spec, lf_layout, lf_plan, args.workers)

        main_layout = RunLayout(work / "main")
        main_plan = plan_shards(spec, main_layout, select=long_first_filter(model, work / "spill"))
        reused = import_pilot(pilot_layout, main_layout, main_plan, spec, chat)
        main_results, main_run = _generate(endpoints, chat, spec, main_layout, main_plan, args.workers)

    actual_tokens = sum(r.output_tokens for r in main_results)  # imported pilot completions included
    projected_tokens = projection.output_tokens["projected_total"]
    projected_wall = projection.projection["wall_s_reusing_pilot"]
    report = {
        "config": vars(args) | {"out": str(args.out)},
        "machine": {"cpu_count": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "ideal_tokens_per_s": ideal,
        "projected_tokens": projected_tokens,
        "actual_tokens": actual_tokens,
        "tokens_rel_error": (projected_tokens - actual_tokens) / actual_tokens,
        "projected_wall_s": projected_wall,
        "actual_wall_s": main_run["wall_s"],
        "wall_rel_error": (projected_wall - main_run["wall_s"]) / main_run["wall_s"],
        "projected_wall_s_full_set": projection.projection["wall_s"],
        "long_first_wall_s": long_first["wall_s"],
        "full_set_wall_rel_error": (projection.projection["wall_s"] - long_first["wall_s"]) / long_first["wall_s"],
        "projected_wall_s_fifo": projection.projection["wall_s_source"],
        "fifo_wall_s": fifo["wall_s"],
        "fifo_wall_rel_error": (projection.projection["wall_s_source"] - fifo["wall_s"]) / fifo["wall_s"],
        "utilization_fifo": fifo["output_tokens"] / fifo["wall_s"] / ideal,
        "utilization_long_first": long_first["output_tokens"] / long_first["wall_s"] / ideal,
        "reused_from_pilot": reused.model_dump(),
        "main_requests_sent": main_run["requests_sent"],
        "pilot": {"run": pilot_run, "projection": projection.model_dump(mode="json", exclude={"length_model"})},
        "length_model": model.model_dump(mode="json"),
        "fifo": fifo,
        "long_first": long_first,
        "main": main_run,
    }
    report["load_average_1_5_15_min"] = {"before": load_before, "after": os.getloadavg()}
    args.out.write_text(json.dumps(report, indent=2))
    print(
        f"tokens: projected {projected_tokens:,} actual {actual_tokens:,} ({report['tokens_rel_error']:+.1%})\n"
        f"wall (main run, reusing pilot): projected {projected_wall:.1f}s actual {main_run['wall_s']:.1f}s "
        f"({report['wall_rel_error']:+.1%})\n"
        f"wall (full set, long-first): projected {projection.projection['wall_s']:.1f}s "
        f"actual {long_first['wall_s']:.1f}s ({report['full_set_wall_rel_error']:+.1%})\n"
        f"wall (full set, FIFO): projected {projection.projection['wall_s_source']:.1f}s actual {fifo['wall_s']:.1f}s "
        f"({report['fifo_wall_rel_error']:+.1%})\n"
        f"utilization: FIFO {report['utilization_fifo']:.1%} ({fifo['wall_s']:.1f}s), "
        f"long-first {report['utilization_long_first']:.1%} ({long_first['wall_s']:.1f}s); ideal {ideal:.0f} tok/s"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
