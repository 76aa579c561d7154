"""Every-turn benchmark: conversations through the real shard driver (`turns: every`) against stand-in servers.

    python -m benchmarks.conversations --out conversations.json [--workloads plain tools mixed]

Each workload's conversations go through `tasks.generation.generate_shard` with `turns: every`, many shards
through one dispatcher, as `benchmarks.generation` does for single requests (its monitor, CPU and memory
readings are reused). Workloads:

    plain   conversations of 1-5 user turns, no tools
    tools   tools declared, 1-3 user turns, 0-2 recorded tool rounds per turn (the stand-in calls a declared
            function with its DATAGEN_STANDIN_TOOL_CALL_RATE; a call where the recording answered in words, or
            none where it called, ends the conversation, as in a real run)
    mixed   half single-turn prompts, half plain conversations, shuffled

The bound (`tasks.chains.simulate_chains`) replays the run's own steps, read back from the shards' checkpoints
(every server uses the same seed, so a step's output depends on its prompt alone), on the stand-in's timing
model with the same servers and slots, once per scheduling policy. `expected_work_left` knows what a run knows
before generating: each conversation's recorded steps times the mean step length of a pilot-sized sample (10%
of the conversations); the shard driver ranks by the same (the stand-in's lengths do not depend on the
category or the turn, so the mean is one figure). Occupancy (utilization) = output tokens / (wall x the servers'
full-batch rate); `ratio_to_bound` = bound wall / measured wall, whole run, and steady-state rates.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import signal
import sys
import tempfile
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Literal

from benchmarks.generation import _phases, run_shards
from datagen.chat import ChatTokenizer
from datagen.checkpoint import read_rows
from datagen.checks.repetition import word_tokens
from datagen.conversation.regeneration import Script, split_step_key
from datagen.conversation.turn_stats import Step, conversations
from datagen.engine.endpoints import ServerEndpoint
from datagen.identity import RequestKeys, prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Message, Prompt
from datagen.runspec import RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from tasks.chains import POLICIES, Chain, ChainRun, DecodeModel, simulate_chains
from tasks.ordering import (
    LengthModel,
    LengthSample,
    StepKind,
    StepLengths,
    StepModel,
    prompt_chars,
    step_kind,
    step_lengths,
)

__all__ = ["main", "run_pilot", "workload"]

PILOT_SHARE = 0.10
# How the driver ranks conversations in a measured run, and the policy of the bound it is measured against.
Ranking = Literal["count", "pilot", "pilot_band"]
RANKINGS: dict[Ranking, str] = {
    "count": "each step counts 1 (a run whose pilot is not on its box)",
    "pilot": "the pilot's per-kind step lengths (tasks.ordering.step_lengths), what a run with a pilot has",
    "pilot_band": "the pilot's step lengths by category and kind, each conversation labelled with the band its "
    "true mean step length falls in (standing in for topic labels, as benchmarks.generation's categories)",
}
POLICY_OF: dict[Ranking, str] = {
    "count": "recorded_steps_left",
    "pilot": "expected_work_left",
    "pilot_band": "expected_work_left",
}
# The bands of `pilot_band` as shares of the length mean: benchmarks.generation's short < 800 / medium < 2,500 /
# long of its mean 1,500, here of a conversation's mean step.
BANDS = (("short", 800 / 1500), ("medium", 2500 / 1500))
# Named configurations: their settings are the defaults (flags given still override them).
PRESETS: dict[str, dict[str, Any]] = {
    # Issue 36's own measurement: 800 plain conversations of 1-5 user turns on one server of 64 slots.
    "issue36": {"workloads": ["plain"], "conversations": 800, "servers": 1, "slots": 64},
}
WORDS = ("why", "how", "list", "prove", "compare", "sketch", "derive", "outline", "city", "river", "weather")


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": f"{name}.", "parameters": schema}}


TOOLS = [_tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}})]


def _text(rng: random.Random, n: int, k: int) -> str:
    return f"Request {n}.{k}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30))) + "."


def _plain(rng: random.Random, n: int, turns: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for k in range(turns):
        if k:
            messages.append({"role": "assistant", "content": "A recorded answer, not kept."})
        messages.append({"role": "user", "content": _text(rng, n, k)})
    return messages


def _with_tools(rng: random.Random, n: int) -> list[dict[str, Any]]:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": f"City {n}", "days": 2}}}
    messages: list[dict[str, Any]] = [{"role": "system", "content": "You are a travel assistant."}]
    turns = rng.randint(1, 3)
    for k in range(turns):
        messages.append({"role": "user", "content": _text(rng, n, k)})
        for _ in range(rng.randint(0, 2)):
            messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
            messages.append({"role": "tool", "content": '{"sky": "rain"}'})
        if k + 1 < turns:
            messages.append({"role": "assistant", "content": "A recorded answer, not kept."})
    return messages


def workload(name: str, n: int, seed: int) -> list[Prompt]:
    """`n` prompts of one workload, in plan (file) order."""
    rng = random.Random(seed)
    prompts = []
    for i in range(n):
        tools = None
        if name == "plain":
            messages = _plain(rng, i, rng.randint(1, 5))
        elif name == "tools":
            messages, tools = _with_tools(rng, i), TOOLS
        elif name == "mixed":
            messages = _plain(rng, i, 1 if rng.random() < 0.5 else rng.randint(2, 5))
        else:
            raise ValueError(f"unknown workload {name!r}")
        pid = prompt_id_from_messages(name, messages, tools)
        prompts.append(Prompt(pid, name, i, [Message.from_dict(m) for m in messages], tools=tools))
    return prompts


def _chains(
    layout: RunLayout, shards: int, prompts_by_shard: list[list[Prompt]], spec: RunSpec, chat: ChatTokenizer
) -> tuple[list[list[int]], list[Prompt]]:
    """Each conversation's step lengths, from the checkpoints, in plan order (a rejected step has none)."""
    key_of = RequestKeys(spec.sampling, chat)
    chains, prompts = [], []
    for s in range(shards):
        steps: dict[str, dict[int, int]] = defaultdict(dict)
        for row in read_rows(layout.shard_completions(s)):
            split = split_step_key(str(row["request_key"]))
            assert split is not None
            steps[split[0]][split[1]] = int(row["completion_tokens"])
        for p in prompts_by_shard[s]:
            got = steps.get(key_of(p.prompt_id), {})
            chains.append([got[k] for k in sorted(got)])
            prompts.append(p)
    return chains, prompts


def _write_shards(layout: RunLayout, prompts: list[Prompt], shards: int) -> list[list[Prompt]]:
    per_shard = -(-len(prompts) // shards)
    by_shard = [prompts[s * per_shard : (s + 1) * per_shard] for s in range(shards)]
    for s, chunk in enumerate(by_shard):
        path = layout.shard_prompts(s)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(p.to_json() + "\n" for p in chunk))
    return by_shard


def label_pass(
    name: str,
    prompts: list[Prompt],
    endpoints: list[ServerEndpoint],
    chat: ChatTokenizer,
    spec: RunSpec,
    work_dir: Path,
    shards: int,
    workers: int,
) -> list[list[int]]:
    """Every conversation's true step lengths, in plan order, from an untimed run (for `band_labels`)."""
    layout = RunLayout(work_dir / f"{name}-labels")
    by_shard = _write_shards(layout, prompts, shards)
    run_shards(endpoints, layout, chat, spec, shards, workers, monitor=False)
    return _chains(layout, shards, by_shard, spec, chat)[0]


def run_pilot(
    name: str,
    prompts: list[Prompt],
    endpoints: list[ServerEndpoint],
    chat: ChatTokenizer,
    spec: RunSpec,
    work_dir: Path,
    seed: int,
) -> tuple[StepLengths, dict[str, Any]]:
    """What a run's pilot gives the driver: a seeded sample of the workload (`PILOT_SHARE` of its conversations,
    in plan order, one shard) generated first, its steps' lengths by kind (`tasks.ordering.StepModel`) and its
    conversations' totals (`LengthModel`), made into each conversation's expected step lengths by
    `tasks.ordering.step_lengths`, the call a run's driver makes (`tasks.generation.pilot_step_tokens`)."""
    sample = sorted(random.Random(seed).sample(range(len(prompts)), max(1, round(PILOT_SHARE * len(prompts)))))
    picked = [prompts[i] for i in sample]
    layout = RunLayout(work_dir / f"{name}-pilot-sample")
    path = layout.shard_prompts(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in picked))
    timed = run_shards(endpoints, layout, chat, spec, 1, 1, monitor=False)
    completions = list(read_rows(layout.shard_completions(0)))
    rejects = list(read_rows(layout.shard_rejects(0)))
    steps: list[tuple[str | None, StepKind, int]] = []
    for row in completions:
        step = Step.of(row)
        steps.append((row.get("category"), step_kind(step.turn_index, step.first_of_turn), step.completion_tokens))
    by_id = {p.prompt_id: p for p in picked}
    samples = [
        LengthSample(
            source=c.source,
            category=c.category,
            prompt_chars=prompt_chars(by_id[pid]),
            output_tokens=c.output_tokens,
        )
        for pid, c in conversations(completions, rejects).items()
        if c.steps
    ]
    step_model = StepModel.fit(steps)
    summary = {
        "conversations": len(picked),
        "steps": len(steps),
        "output_tokens": sum(n for _, _, n in steps),
        "wall_s": timed.wall_s,
        "mean_step_tokens": step_model.global_mean,
        "mean_step_tokens_by_kind": {k: round(v.mean, 1) for k, v in step_model.by_kind.items()},
        "steps_by_kind": {k: v.n for k, v in step_model.by_kind.items()},
        "mean_step_tokens_by_category": {
            c: {k: round(v.mean, 1) for k, v in kinds.items()} for c, kinds in step_model.by_category.items()
        },
    }
    return step_lengths(LengthModel.fit(samples), step_model), summary


def _bounds(
    chains: list[list[int]], prompts: list[Prompt], servers: int, slots: int, model: DecodeModel, lengths: StepLengths
) -> dict[str, ChainRun]:
    """The perfect client's run under every policy; `expected_work_left` with the pilot's expected step lengths, and
    `recorded_steps_left` with each recorded step counting 1 (what the driver ranks by without a pilot)."""
    built, counted = [], []
    for steps, p in zip(chains, prompts, strict=True):
        expected = lengths(p)
        built.append(Chain(tuple(steps), turns=len(Script.of(p).turns), expected=expected))
        counted.append(Chain(tuple(steps), turns=len(Script.of(p).turns), expected=(1.0,) * len(expected)))
    runs: dict[str, ChainRun] = {policy: simulate_chains(built, servers, slots, model, policy) for policy in POLICIES}
    runs["recorded_steps_left"] = simulate_chains(counted, servers, slots, model, "expected_work_left")
    return runs


def _against(run: dict[str, Any], bound: ChainRun, model: DecodeModel, servers: int, slots: int) -> dict[str, Any]:
    steady_rate = bound.tokens_at_last_start / max(bound.last_start_s, 1e-9)
    measured_steady = run["steady_utilization"] * servers * model.tokens_per_s(slots)
    return {
        "wall_s": bound.wall_s,
        "utilization": bound.utilization,
        "tail_s": bound.wall_s - bound.last_start_s,
        "ratio_whole_run": bound.wall_s / run["wall_s"],
        "ratio_steady": measured_steady / steady_rate if bound.last_start_s > 0 else None,
    }


def band_labels(prompts: list[Prompt], chains: list[list[int]], length_mean: float) -> list[Prompt]:
    """The prompts, each labelled with the band of its conversation's true mean step length (`BANDS`; a
    conversation without a step keeps no category). The label is not sent: outputs and keys do not change."""
    out = []
    for p, steps in zip(prompts, chains, strict=True):
        band = None
        if steps:
            mean = sum(steps) / len(steps)
            band = next((b for b, share in BANDS if mean < share * length_mean), "long")
        out.append(dataclasses.replace(p, category=band))
    return out


def run_workload(
    name: str,
    ranking: Ranking,
    prompts: list[Prompt],
    endpoints: list[ServerEndpoint],
    chat: ChatTokenizer,
    spec: RunSpec,
    work_dir: Path,
    *,
    pilot_lengths: StepLengths,
    shards: int,
    workers: int,
    ideal: float,
    model: DecodeModel,
    slots: int,
) -> dict[str, Any]:
    """One workload through the real shard driver, ranking conversations by `ranking`; its measured figures
    against the bound of every policy (`policy_bound`: the bound of the policy the driver follows)."""
    layout = RunLayout(work_dir / f"{name}-run-{ranking}")
    by_shard = _write_shards(layout, prompts, shards)
    step_tokens = pilot_lengths if ranking != "count" else None
    timed = run_shards(endpoints, layout, chat, spec, shards, workers, monitor=True, step_tokens=step_tokens)
    results, wall, monitor = timed.results, timed.wall_s, timed.monitor
    assert monitor is not None
    sent = sum(r.n_sent for r in results)
    tokens = sum(r.output_tokens for r in results)
    out: dict[str, Any] = {
        "ranking": RANKINGS[ranking],
        "policy_bound": POLICY_OF[ranking],
        "conversations": sum(r.n_prompts for r in results),
        "steps": sum(r.n_completed for r in results),
        "step_rejects": sum(r.n_rejected for r in results),
        "requests_sent": sent,
        "output_tokens": tokens,
        "wall_s": wall,
        "output_tokens_per_s": tokens / wall,
        "utilization": tokens / wall / ideal,
        "client_cpu_ms_per_step": 1000 * timed.cpu_s / max(1, sent),
        "client_cpu_share_of_one_core": timed.cpu_s / wall,
        "server_cpu_share_of_one_core": [c / wall for c in timed.server_cpu_s],
        "peak_rss_mb": timed.peak_rss_mb,
        "retries": timed.stats.retries,
        "requeued": timed.stats.requeued,
    }
    out |= _phases(monitor.samples, sent, slots, ideal, model)
    chains, ordered = _chains(layout, shards, by_shard, spec, chat)
    assert sum(map(sum, chains)) == tokens, "the checkpoints' steps are the run's tokens"
    out["steps_per_conversation"] = {str(k): sum(len(c) == k for c in chains) for k in range(max(map(len, chains)) + 1)}
    bounds = _bounds(chains, ordered, len(endpoints), slots, model, pilot_lengths)
    out["bound"] = {policy: _against(out, b, model, len(endpoints), slots) for policy, b in bounds.items()}
    # Each conversation's step lengths and recorded steps, in plan order: to replay the bounds under other policies.
    out["chains"] = [[steps, len(pilot_lengths(p))] for steps, p in zip(chains, ordered, strict=True)]
    oracle = bounds["oracle_longest_first"].utilization
    out["categories"] = dict(sorted(Counter(str(p.category) for p in ordered).items()))
    out["bound_share_of_oracle"] = {policy: b.utilization / oracle for policy, b in bounds.items()}
    t_first = monitor.samples[0].t
    out["timeline"] = [
        [round(x.t - t_first, 2), sum(x.running), sum(x.queued_at_servers), x.dispatcher_queue, round(x.server_tokens)]
        for x in monitor.samples[:: max(1, len(monitor.samples) // 200)]
    ]
    return out


def compact_json(report: dict[str, Any]) -> str:
    """The report as indented JSON, each list of numbers on one line (the chains and the timeline stay small)."""
    text = json.dumps(report, indent=2)
    return re.sub(r"\[\s*([-\d.eE,\s]*?)\s*\]", lambda m: "[" + " ".join(m.group(1).split()) + "]", text)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and write its JSON report."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks.conversations")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        help="a named configuration (its settings are the defaults; flags given override them): "
        + "; ".join(f"{k}: {v}" for k, v in PRESETS.items()),
    )
    ap.add_argument("--workloads", nargs="+", default=["plain", "tools", "mixed"])
    ap.add_argument(
        "--rankings",
        nargs="+",
        choices=list(RANKINGS),
        default=list(RANKINGS),
        help="how the driver ranks conversations, one measured run each: pilot (the pilot's per-kind step "
        "lengths, what a run with a pilot has) and count (each step counts 1, a run without one)",
    )
    ap.add_argument("--servers", type=int, default=2)
    ap.add_argument("--slots", type=int, default=16)
    ap.add_argument("--conversations", type=int, default=240)
    ap.add_argument("--shards", type=int, default=8)
    ap.add_argument("--workers", type=int, default=8, help="shard tasks running at once")
    ap.add_argument("--length-mean", type=float, default=300)
    ap.add_argument("--length-max", type=int, default=2000)
    ap.add_argument("--time-scale", type=float, default=0.2)
    ap.add_argument("--step-base-ms", type=float, default=20.0)
    ap.add_argument("--step-per-req-ms", type=float, default=0.2)
    ap.add_argument("--tokens-per-step", type=int, default=64)
    ap.add_argument("--tool-call-rate", type=float, default=0.7)
    ap.add_argument("--seed", type=int, default=7)
    preset = ap.parse_known_args(argv)[0].preset
    if preset is not None:
        ap.set_defaults(**PRESETS[preset])
    args = ap.parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    load_before = os.getloadavg()
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
        "DATAGEN_STANDIN_TOOL_CALL_RATE": str(args.tool_call_rate),
        "DATAGEN_STANDIN_SEED": "0",
    }
    per_server = args.slots * 1000.0 / ((args.step_base_ms + args.step_per_req_ms * args.slots) * args.time_scale)
    ideal = per_server * args.servers
    model = DecodeModel(args.step_base_ms * args.time_scale / 1000, args.step_per_req_ms * args.time_scale / 1000)
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    word_tokens(chat)  # the per-step checks' word table, built once per process: not part of the first run's ramp
    spec = RunSpec(
        model_path=str(chat.model_dir),
        sampling=SamplingSpec(max_new_tokens=args.length_max),
        context_length=32768,
        turns="every",
    )
    runs: dict[str, dict[str, Any]] = {}
    with contextlib.ExitStack() as stack:
        work = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="bench-conv-")))
        endpoints = [
            stack.enter_context(
                run_standin(
                    chat.model_dir, args=("--max-running-requests", str(args.slots), "--enable-metrics"), env=env
                )
            )
            for _ in range(args.servers)
        ]
        for name in args.workloads:
            prompts = workload(name, args.conversations, args.seed)
            lengths, pilot = run_pilot(name, prompts, endpoints, chat, spec, work, args.seed)
            runs[name] = {"pilot_sample": pilot}
            chains: list[list[int]] | None = None  # every conversation's true steps, from the first run
            for ranking in sorted(args.rankings, key=lambda r: r == "pilot_band"):  # the band's labels need them
                run_prompts, run_lengths = prompts, lengths
                if ranking == "pilot_band":
                    if chains is None:  # no other run measured them: an untimed run that only labels
                        chains = label_pass(name, prompts, endpoints, chat, spec, work, args.shards, args.workers)
                    run_prompts = band_labels(prompts, chains, args.length_mean)
                    run_lengths, runs[name]["pilot_sample_band"] = run_pilot(
                        f"{name}-band", run_prompts, endpoints, chat, spec, work, args.seed
                    )
                runs[name][ranking] = run_workload(
                    name,
                    ranking,
                    run_prompts,
                    endpoints,
                    chat,
                    spec,
                    work,
                    pilot_lengths=run_lengths,
                    shards=args.shards,
                    workers=args.workers,
                    ideal=ideal,
                    model=model,
                    slots=args.slots,
                )
                chains = [c for c, _ in runs[name][ranking]["chains"]]
    report = {
        "config": vars(args) | {"out": str(args.out)},
        "ideal_tokens_per_s": ideal,
        "runs": runs,
        "cpu_count": os.cpu_count(),
        "load_average_1_5_15_min": {"before": load_before, "after": os.getloadavg()},
    }
    args.out.write_text(compact_json(report))
    for name, by_ranking in runs.items():
        for key in ("pilot_sample", "pilot_sample_band"):
            if key in by_ranking:
                p = by_ranking[key]
                print(
                    f"{name}: {key} {p['conversations']} conversations, {p['steps']} steps, mean step "
                    f"{p['mean_step_tokens']:.0f} tokens {p['mean_step_tokens_by_kind']}"
                    f" {p['mean_step_tokens_by_category'] or ''}"
                )
        for ranking in args.rankings:
            r = by_ranking[ranking]
            print(
                f"  ranking {ranking} ({r['ranking']}): {r['conversations']} conversations, {r['steps']} steps, "
                f"{r['output_tokens']} tokens, {r['wall_s']:.1f} s, occupancy {r['utilization']:.3f} "
                f"(steady {r['steady_utilization']:.3f}, ramp {r['ramp_s']:.1f} s, tail {r['tail_s']:.1f} s), "
                f"client {r['client_cpu_ms_per_step']:.1f} ms/step"
            )
            for policy, b in r["bound"].items():
                steady = f"{b['ratio_steady']:.3f}" if b["ratio_steady"] is not None else "n/a"
                mark = "*" if policy == r["policy_bound"] else " "
                print(
                    f"   {mark}{policy:28} bound {b['wall_s']:6.1f} s occupancy {b['utilization']:.3f} "
                    f"({r['bound_share_of_oracle'][policy]:.3f} of oracle); measured/bound whole run "
                    f"{b['ratio_whole_run']:.3f}, steady {steady}"
                )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
