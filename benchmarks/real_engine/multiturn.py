"""multiturn.py: the memory plan's radix-cache choice for every-turn runs, against a real SGLang (issue 36).

Runs on the device (device.sh sets PYTHONPATH: the carried SGLang site, datagen's wheels and source). A multi-turn
workload (C conversations of T turns: each turn sends the previous turn's prompt + the model's output ids + U new
"user" tokens, and asks for O tokens with ignore_eos) runs against one server per candidate of the plan
`plan_memory(turns="every", turns_per_conversation=T)` picks between: `radix-balanced` (the radix cache kept, the
state pool sized for its extra slots per request) and `no-radix-balanced` (every turn re-prefills its history, one
state slot per request, more requests at once). Per phase: the plan's predicted running requests and per-request
GPU time (`choose_prefix_reuse`: the new tokens prefilled on both sides, the history re-prefilled without the cache
or where the state pool evicted it), SGLang's logged pools, then the measured wall, output tokens/s, prompt tokens and
`meta_info.cached_tokens` (the prefix the server reused) per turn. OUT/multiturn-NAME.json per phase and
OUT/multiturn.json with the plan and the verdict (did the plan's choice run faster?).

  python3 multiturn.py --model /tmp/sgl/model --out $OUT --calibrate-log defaults.log \
      --conversations 48 --turns 4 --user-tokens 512 --output 256
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (beside this file)
import engine_trial  # noqa: E402

from datagen.engine.memory_plan import (  # noqa: E402
    EngineFlags,
    GpuMemory,
    LoggedPools,
    ModelShape,
    calibrated_gpu,
    card_bandwidth,
    choose_prefix_reuse,
    for_engine,
    plan_memory,
    prefix_reuse_for_turns,
)

PHASES = ("radix-balanced", "no-radix-balanced")


_GATE: threading.BoundedSemaphore | None = None  # --max-inflight: requests at the server at once, as a client holds


def conversation(
    base: str, idx: int, turns: int, user: int, output: int, vocab: int, deadline: float
) -> list[dict[str, Any]]:
    """One conversation's turns in order; each turn's prompt extends the last one's prompt and output ids."""
    rng = random.Random(1000 + idx)
    ids: list[int] = []
    out: list[dict[str, Any]] = []
    for k in range(turns):
        if time.time() > deadline:
            break
        ids = ids + [rng.randrange(1000, vocab - 1000) for _ in range(user)]
        body = {"input_ids": ids, "sampling_params": {"max_new_tokens": output, "ignore_eos": True}}
        sent = time.monotonic()
        if _GATE is not None:
            _GATE.acquire()
        try:
            seconds, answer, error = bench._post(base + "/generate", body, max(5.0, deadline - time.time()))
        finally:
            if _GATE is not None:
                _GATE.release()
        if answer is None:
            out.append({"turn": k, "error": error, "seconds": round(seconds, 3)})
            break
        meta = answer.get("meta_info", {})
        output_ids = answer.get("output_ids") or []
        out.append(
            {
                "turn": k,
                "sent_at": sent,
                "seconds": round(seconds, 3),
                "prompt_tokens": int(meta.get("prompt_tokens", len(ids))),
                "cached_tokens": meta.get("cached_tokens"),
                "completion_tokens": int(meta.get("completion_tokens", len(output_ids))),
                "history_tokens": len(ids) - user,  # what an earlier turn of this conversation already held
                "meta_keys": sorted(meta) if k == 0 and idx == 0 else None,
            }
        )
        ids = ids + [int(t) for t in output_ids]
    return out


def _inflight(option: str | None, concurrency: int) -> int | None:
    """Requests at the server at once: none held back, a number, or 'auto' (the dispatcher's capacity + 4)."""
    if not option:
        return None
    return concurrency + 4 if option == "auto" else int(option)


def probe(base: str, vocab: int) -> dict[str, Any]:
    """Does the server reuse a prefix at all? The same prompt twice; then a prompt, its output, and an extension."""
    rng = random.Random(7)
    same = [rng.randrange(1000, vocab - 1000) for _ in range(600)]
    out: dict[str, Any] = {}
    for label, ids, new in (("same_first", same, 8), ("same_again", same, 8)):
        _, answer, error = bench._post(
            base + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": new, "ignore_eos": True}}, 60
        )
        out[label] = error or (answer or {}).get("meta_info", {}).get("cached_tokens")
    first = [rng.randrange(1000, vocab - 1000) for _ in range(1000)]
    _, answer, error = bench._post(
        base + "/generate", {"input_ids": first, "sampling_params": {"max_new_tokens": 300, "ignore_eos": True}}, 120
    )
    if answer is None:
        out["turn_error"] = error
        return out
    out["turn_first"] = answer.get("meta_info", {}).get("cached_tokens")
    nxt = (
        first
        + [int(t) for t in answer.get("output_ids") or []]
        + [rng.randrange(1000, vocab - 1000) for _ in range(200)]
    )
    _, answer, error = bench._post(
        base + "/generate", {"input_ids": nxt, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}, 120
    )
    out["turn_next"] = error or (answer or {}).get("meta_info", {}).get("cached_tokens")
    out["turn_next_history"] = len(nxt) - 200
    # The plan's prefill term: one fresh 8,192-token prompt, one output token, on an idle server (the first of the
    # two warms up the kernels for that length; the second is timed).
    for label in ("prefill_warmup", "prefill"):
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(8192)]
        seconds, answer, error = bench._post(
            base + "/generate", {"input_ids": ids, "sampling_params": {"max_new_tokens": 1}}, 120
        )
        out[f"{label}_8192_s"] = error or round(seconds, 3)
    if isinstance(out["prefill_8192_s"], float) and out["prefill_8192_s"] > 0:
        out["prefill_tokens_per_s"] = round(8192 / out["prefill_8192_s"], 1)
    return out


def workload(
    base: str, conversations: int, turns: int, user: int, output: int, vocab: int, deadline: float
) -> dict[str, Any]:
    samples: list[dict[str, Any]] = []
    stop = threading.Event()

    def poll() -> None:
        while not stop.is_set():
            m = bench._metrics(base)
            if m:
                samples.append(m)
            stop.wait(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=conversations) as ex:
        convs = list(
            ex.map(lambda i: conversation(base, i, turns, user, output, vocab, deadline), range(conversations))
        )
    wall = time.monotonic() - t0
    stop.set()
    poller.join(timeout=5)
    done = [t for c in convs for t in c if "error" not in t]
    errors = [t["error"] for c in convs for t in c if "error" in t]
    completion = sum(t["completion_tokens"] for t in done)
    per_turn: dict[int, dict[str, Any]] = {}
    for k in range(turns):
        ts = [t for t in done if t["turn"] == k]
        if not ts:
            continue
        cached = [t["cached_tokens"] for t in ts if isinstance(t["cached_tokens"], int)]
        history = sum(t["history_tokens"] for t in ts)
        per_turn[k] = {
            "requests": len(ts),
            "prompt_tokens_mean": round(statistics.mean(t["prompt_tokens"] for t in ts), 1),
            "history_tokens_mean": round(history / len(ts), 1),
            "cached_tokens_mean": round(statistics.mean(cached), 1) if cached else None,
            "cached_of_history": round(sum(cached) / history, 4) if cached and history else None,
            "latency_s_median": round(statistics.median(t["seconds"] for t in ts), 3),
        }
    return {
        "conversations": conversations,
        "turns": turns,
        "finished_conversations": sum(1 for c in convs if len(c) == turns and all("error" not in t for t in c)),
        "requests_ok": len(done),
        "errors": errors[:5],
        "wall_seconds": round(wall, 3),
        "completion_tokens": completion,
        "prompt_tokens": sum(t["prompt_tokens"] for t in done),
        "cached_tokens": sum(t["cached_tokens"] for t in done if isinstance(t["cached_tokens"], int)),
        "output_tokens_per_s": round(completion / wall, 1) if wall > 0 else None,
        "per_turn": per_turn,
        "meta_keys": next((t["meta_keys"] for t in done if t.get("meta_keys")), None),
        "metrics_max_running_reqs": max((s.get("num_running_reqs", 0) for s in samples), default=None),
        "metrics_max_queue_reqs": max((s.get("num_queue_reqs", 0) for s in samples), default=None),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calibrate-log", type=Path, help="a defaults server's log (engine_trial.py) to calibrate from")
    p.add_argument("--calibrate-card", default="H100", help="use --calibrate-log only on a card whose name has this")
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--conversations", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--user-tokens", type=int, default=512)
    p.add_argument("--output", type=int, default=256)
    p.add_argument("--phase", action="append", choices=PHASES, help="default: both, the plan's choice first")
    p.add_argument("--workload-s", type=float, default=150.0, help="each phase's workload stops sending after this")
    p.add_argument("--port", type=int, default=30300)
    p.add_argument(
        "--max-inflight",
        help="at most this many requests at the server at once; 'auto': each phase's planned running requests + 4, "
        "what datagen's dispatcher keeps at a server (capacity + queue depth)",
    )
    p.add_argument("--probe", action="store_true", help="before each workload: does the server reuse a prefix at all?")
    p.add_argument("--extra", action="append", default=[], help="NAME=FLAGS: a phase of the radix candidate plus FLAGS")
    p.add_argument("--server-module", default="sglang.launch_server", help="datagen.standin for a rehearsal")
    p.add_argument("--fake-gpu", help="NAME:TOTAL:FREE bytes, for a rehearsal without a GPU")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    global _GATE
    config = json.loads((a.model / "config.json").read_text())
    vocab = int(config.get("text_config", config).get("vocab_size", 248320))
    model = ModelShape.from_config(config)
    seen = engine_trial.probe_gpu(a.fake_gpu)
    probed = GpuMemory(
        seen["total_bytes"], seen["free_bytes"], engine_trial.WEIGHTS_ESTIMATE, card_bandwidth(seen["name"])
    )
    gpu = for_engine(probed, "0.5.17")
    calibrated_note = "the probe with 0.5.17's reservations"
    if a.calibrate_log is not None and a.calibrate_log.exists() and a.calibrate_card in seen["name"]:
        logged = LoggedPools.parse(a.calibrate_log.read_text(errors="replace"))
        if logged is not None:
            gpu = calibrated_gpu(model, gpu, EngineFlags(), logged)
            calibrated_note = f"calibrated from {a.calibrate_log.name} (an earlier machine's defaults server)"
    t, u, o = a.turns, a.user_tokens, a.output
    context = t * (u + o)  # the last turn: every user turn and every output of the conversation
    # In rotation at a server: what the gate lets in ('auto': the plan's default, running + 4), else every one.
    if a.max_inflight:
        conversations_open = None if a.max_inflight == "auto" else int(a.max_inflight)
    else:
        conversations_open = a.conversations
    plan = plan_memory(
        model,
        gpu,
        context,
        context_source=f"{t} turns x ({u} user + {o} output) tokens",
        turns="every",
        turns_per_conversation=t,
        output_tokens=o,
        conversations_open=conversations_open,
    )
    cands = {c.name: c for c in plan.candidates}
    radix, no_radix = cands["radix-balanced"], cands["no-radix-balanced"]
    reuse = prefix_reuse_for_turns(model, gpu, context, t, o, no_radix.concurrency, radix, conversations_open)
    predicted: dict[str, Any] = {}
    if not isinstance(reuse, str):
        keep, why = choose_prefix_reuse(reuse, radix.concurrency, no_radix.concurrency)
        ms_with = reuse.gpu_seconds(radix.concurrency, radix=True) * 1e3
        ms_without = reuse.gpu_seconds(no_radix.concurrency, radix=False) * 1e3
        predicted = {
            "keep_radix": keep,
            "why": why,
            "ms_per_request_with_radix": round(ms_with, 2),
            "ms_per_request_without": round(ms_without, 2),
            "predicted_speedup_of_choice": round(max(ms_with, ms_without) / min(ms_with, ms_without), 3),
            "prefix_reuse": asdict(reuse),
        }
    summary: dict[str, Any] = {
        "gpu": seen,
        "gpu_used_for_plan": calibrated_note,
        "workload": {
            "conversations": a.conversations,
            "turns": t,
            "user_tokens": u,
            "output_tokens": o,
            "max_inflight": a.max_inflight,
        },
        "plan": {
            "chosen": plan.chosen,
            "plan_args": plan.plan_args,
            "reasons": plan.reasons,
            "candidates": {
                n: {
                    "args": plan.candidate_args[n],
                    "concurrency": cands[n].concurrency,
                    "sizing": asdict(cands[n].sizing),
                }
                for n in PHASES
            },
        },
        "predicted": predicted,
        "phases": {},
    }
    order = a.phase or sorted(PHASES, key=lambda n: n != plan.chosen)
    extras = dict(e.split("=", 1) for e in a.extra)
    for name, more in extras.items():
        plan.candidate_args[name] = [*plan.candidate_args["radix-balanced"], *more.split()]
    order = [*order, *extras]
    for i, name in enumerate(order):
        if engine_trial.until() - time.time() < engine_trial.START_S + 40:
            summary["phases"][name] = {"skipped": f"{engine_trial.until() - time.time():.0f} s left"}
            continue
        flags = list(plan.candidate_args[name])
        proc, log, t0 = engine_trial.start(
            f"multiturn-{name}", a.model, a.out, a.context_length, flags, a.port + i, a.server_module
        )
        record: dict[str, Any] = {"phase": name, "args": flags}
        try:
            ready = engine_trial.wait_ready(proc, log, t0, min(engine_trial.until() - 30, time.time() + 400))
            record["ready"] = ready
            record["startup_seconds"] = round(time.monotonic() - t0, 1)
            if ready:
                logged = LoggedPools.parse(log.read_text(errors="replace"))
                record["logged"] = asdict(logged) if logged is not None else None
                deadline = min(engine_trial.until() - 25, time.time() + a.workload_s)
                base = f"http://127.0.0.1:{a.port + i}"
                inflight = _inflight(a.max_inflight, cands.get(name, cands["radix-balanced"]).concurrency)
                _GATE = threading.BoundedSemaphore(inflight) if inflight else None
                record["max_inflight"] = inflight
                if a.probe:
                    record["probe"] = probe(base, vocab)
                    print(f"[{name}] probe: {record['probe']}", flush=True)
                record["workload"] = workload(base, a.conversations, t, u, o, vocab, deadline)
                w = record["workload"]
                print(
                    f"[{name}] {w['requests_ok']} turns, {w['finished_conversations']} conversations finished, "
                    f"{w['output_tokens_per_s']} tok/s, cached {w['cached_tokens']} of {w['prompt_tokens']} prompt "
                    f"tokens, most running {w['metrics_max_running_reqs']}",
                    flush=True,
                )
        finally:
            record["exit_code"] = engine_trial.stop(proc)
            (a.out / f"multiturn-{name}.json").write_text(json.dumps(record, indent=1, default=str))
            summary["phases"][name] = {
                k: record.get(k)
                for k in ("ready", "startup_seconds", "logged", "max_inflight", "probe", "workload", "exit_code")
            }
            (a.out / "multiturn.json").write_text(json.dumps(summary, indent=1, default=str))
            if not record.get("ready"):
                print("".join(log.read_text(errors="replace").splitlines(True)[-40:]), flush=True)
    runs = {n: summary["phases"][n].get("workload") for n in PHASES if (summary["phases"].get(n) or {}).get("workload")}
    if all(r and r.get("finished_conversations") == a.conversations for r in runs.values()) and len(runs) == 2:
        rates = {n: r["output_tokens_per_s"] for n, r in runs.items()}
        faster = max(rates, key=lambda n: rates[n])
        summary["verdict"] = {
            "output_tokens_per_s": rates,
            "faster": faster,
            "plan_chose": plan.chosen,
            "plan_right": faster == plan.chosen,
            "measured_speedup": round(max(rates.values()) / max(1e-9, min(rates.values())), 3),
        }
        (a.out / "multiturn.json").write_text(json.dumps(summary, indent=1, default=str))
    print(
        json.dumps(
            {k: summary[k] for k in ("plan", "predicted")} | {"verdict": summary.get("verdict")}, indent=1, default=str
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
