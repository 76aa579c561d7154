"""Candidate memory plans side by side: the pilot runs each on its own GPUs and keeps the fastest that held.

The memory plan (`memory_plan.plan_memory`) predicts from SGLang's sizing code; on a box with several GPUs the
pilot can check the prediction. Each candidate ("arm": the plan's choice; the same choice at a higher
`--mem-fraction-static` (`trial_headroom`: the engine's measured headroom without its margin, or, for an engine
never measured, the newest measured engine's); SGLang's defaults, the radix cache on with balanced pools, the
radix cache off with the 0.9 split, in that order, as many as there are servers) runs on its own servers.

First every server takes a worst-case burst (`burst`): as many requests as its arm runs at once, each with the
run's longest prompt, so prefill runs full chunks and the batch fills. An arm survives when every request was
answered, the server is still healthy and it retracted at most one request in ten; a server of an arm that did
not survive is relaunched with the plan's choice before the sample starts (`ServerFleet.relaunch`), and the arm
is out of the race. Then the pilot's stratified sample is fed from the one dispatcher's queue, so every arm draws
from the same sample at the same time. Each server's running requests and decode rate are read from the server
itself (`gen_throughput`, `num_running_reqs`: `/metrics` or `/v1/loads`, as `tasks.pilot.ThroughputProbe`
polls them) while the dispatcher still had requests waiting (every arm could fill its batch). The surviving arm
with the most output tokens/s per server is kept; the main run's plan then chooses that candidate at its own
measured context (`plan_memory(prefer=..., headroom=...)`), recorded in its lineage and card.

    arms = trial_arms(plan, servers, higher)          # which candidate runs on which server
    server_plan_args(arms, servers)                   # one flag list per server for the fleet
    held = burst(arms, endpoints, ...)                # per arm: survived the worst case, and the evidence
    result = judge(arms, names, readings, queued, held)   # per arm: running requests, tokens/s; kept and why
"""

from __future__ import annotations

import asyncio
import bisect
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, Protocol

from datagen.engine.client import GenerateResult, SGLangClient
from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.headroom import HEADROOM, Headroom
from datagen.engine.memory_plan import MemoryPlan

__all__ = [
    "TRIAL_ORDER",
    "Arm",
    "TrialChoice",
    "burst",
    "burst_and_relaunch",
    "judge",
    "kept_candidate",
    "kept_headroom",
    "kept_plan",
    "report_rows",
    "server_plan_args",
    "trial_arms",
    "trial_headroom",
    "wanted",
]

logger = logging.getLogger(__name__)

# Candidates in the order they get servers: the plan's choice first (then its higher fraction), then the defaults
# it claims to beat.
TRIAL_ORDER = ("defaults", "radix-balanced", "no-radix", "no-radix-balanced")
TrialChoice = Literal["auto", "on", "off"]
# A burst "held" when at most this share of its requests was retracted (SGLang frees KV cache by retracting
# requests when decode outgrows it; a few are the scheduler's normal bookkeeping, a storm is not).
MAX_RETRACTED_SHARE = 0.1
# Tokens each burst request generates at most: enough for the batch to decode together, short enough to be cheap.
BURST_OUTPUT_TOKENS = 128


class Reading(Protocol):
    """One poll of a server (`tasks.pilot.ServerReading`)."""

    @property
    def t(self) -> float: ...
    @property
    def server(self) -> str: ...
    @property
    def running(self) -> int: ...
    @property
    def gen_throughput(self) -> float: ...


@dataclass(frozen=True)
class Arm:
    """One candidate plan and the servers (by index) that run it."""

    name: str  # the candidate's name, with "@<fraction>" for the plan's choice at a higher fraction
    plan_args: list[str]
    servers: list[int]
    predicted_running: int  # SGLang's sizing at the pilot's expected context
    candidate: str = ""  # the plan candidate it runs (name without the fraction)
    fraction: float | None = None  # its --mem-fraction-static
    headroom: Headroom | None = None  # the measured headroom its fraction leaves (a higher-fraction arm)


def wanted(choice: TrialChoice, servers: int, plan: MemoryPlan | None, attached: bool) -> tuple[bool, str]:
    """Whether the pilot runs the trial, and why (auto: on with two or more launched servers and a plan)."""
    if choice == "off":
        return False, "trial off (PilotSpec.plan_trial)"
    if plan is None:
        return False, "no memory plan to try"
    if attached:
        return False, "attach mode: the servers' flags are set elsewhere"
    if servers < 2:
        return False, "one server: nothing to compare side by side"
    return True, f"{servers} servers: candidate plans side by side"


def trial_headroom(version: str | None, own: Headroom | None) -> Headroom | None:
    """The headroom a higher-fraction arm tries: the engine's measured one without its margin, else the newest
    measured engine's taken for this one (None when nothing was ever measured)."""
    if own is not None:
        if own.margin_bytes <= 0:
            return None
        return replace(own, margin_bytes=0, source=f"{own.source}; its margin left out by the pilot's trial")
    if not HEADROOM:
        return None
    newest = HEADROOM[max(HEADROOM, key=lambda v: tuple(int(x) for x in v.split(".") if x.isdigit()))]
    return replace(
        newest,
        engine=version or newest.engine,
        source=f"{newest.source}; SGLang {newest.engine}'s profile, tried on SGLang {version or '?'} by the pilot",
    )


def trial_arms(plan: MemoryPlan, servers: int, higher: MemoryPlan | None = None) -> list[Arm]:
    """The plan's choice, its higher-fraction version (`higher`, when its fraction is higher), then the other
    candidates in TRIAL_ORDER, one per server round-robin (at most `servers` arms)."""
    chosen = plan.candidate(plan.chosen)
    arms = [Arm(plan.chosen, list(plan.plan_args), [], chosen.concurrency, plan.chosen, plan.fraction.get("value"))]
    up = higher.fraction.get("value") if higher is not None else None
    if higher is not None and up is not None and up > (plan.fraction.get("value") or 1.0):
        cand = higher.candidate(higher.chosen)
        headroom = higher.inputs.get("headroom")
        arms.append(
            Arm(f"{higher.chosen}@{up:g}", list(higher.plan_args), [], cand.concurrency, higher.chosen, up, headroom)
        )
    for name in TRIAL_ORDER:
        if name != plan.chosen and any(c.name == name for c in plan.candidates):
            cand = plan.candidate(name)
            arms.append(Arm(name, plan.args_for(cand), [], cand.concurrency, name))
    arms = arms[: max(1, servers)]
    for i in range(servers):
        arms[i % len(arms)].servers.append(i)
    return arms


def server_plan_args(arms: Sequence[Arm], servers: int) -> list[list[str]]:
    """One flag list per server index, as `ServerFleet(server_plan_args=...)` takes them."""
    out: list[list[str]] = [[] for _ in range(servers)]
    for arm in arms:
        for i in arm.servers:
            out[i] = list(arm.plan_args)
    return out


def _burst_ids(n: int, length: int, low: int, high: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(low, high) for _ in range(length)] for _ in range(n)]


async def _burst_server(
    endpoint: ServerEndpoint, prompts: list[list[int]], sampling: dict[str, Any], timeout_s: float
) -> dict[str, Any]:
    async with SGLangClient(endpoint, max_connections=max(8, len(prompts) + 4)) as client:
        results = await asyncio.gather(
            *(client.generate(ids, sampling, timeout_s=timeout_s) for ids in prompts), return_exceptions=True
        )
        alive = await client.health()
    done = [r for r in results if isinstance(r, GenerateResult)]
    errors = [f"{type(r).__name__}: {r}" for r in results if isinstance(r, BaseException)]
    return {
        "server": endpoint.name,
        "requests": len(prompts),
        "answered": len(done),
        "retracted": sum(r.num_retractions for r in done),
        "healthy_after": alive,
        "errors": errors[:3],
    }


def burst(
    arms: Sequence[Arm],
    endpoints: Sequence[ServerEndpoint],
    *,
    prompt_tokens: int,
    sampling: dict[str, Any],
    token_range: tuple[int, int],
    timeout_s: float = 900.0,
    seed: int = 0,
) -> dict[str, dict[str, Any]]:
    """The worst case on every server at once: its arm's running requests, each `prompt_tokens` long.

    The prompts are token ids drawn from `token_range` (no special tokens), so nothing is shared between them;
    their answers are thrown away. Returns per arm whether it held (every request answered, the server healthy
    after, at most MAX_RETRACTED_SHARE retracted) and each server's figures.
    """
    if prompt_tokens < 1:
        raise ValueError(f"prompt_tokens must be positive, got {prompt_tokens}")
    capped = dict(sampling, max_new_tokens=min(int(sampling.get("max_new_tokens") or 1), BURST_OUTPUT_TOKENS))
    jobs = [
        (arm.name, endpoints[i], _burst_ids(max(1, arm.predicted_running), prompt_tokens, *token_range, seed + i))
        for arm in arms
        for i in arm.servers
        if i < len(endpoints)
    ]

    async def run_all() -> list[dict[str, Any]]:
        return list(await asyncio.gather(*(_burst_server(e, p, capped, timeout_s) for _, e, p in jobs)))

    figures = asyncio.run(run_all())
    out: dict[str, dict[str, Any]] = {}
    for (name, _, _), fig in zip(jobs, figures, strict=True):
        entry = out.setdefault(name, {"held": True, "servers": [], "prompt_tokens": prompt_tokens})
        held = (
            fig["answered"] == fig["requests"]
            and fig["healthy_after"]
            and fig["retracted"] <= MAX_RETRACTED_SHARE * fig["requests"]
        )
        entry["held"] = entry["held"] and held
        entry["servers"].append(fig)
    for entry in out.values():
        entry["why"] = _held_why(entry)
    return out


def burst_and_relaunch(fleet: Fleet, arms: Sequence[Arm], **burst_args: Any) -> dict[str, dict[str, Any]]:
    """`burst` on the fleet's servers; the servers of an arm that did not hold are relaunched with the flags of the
    first arm that did (SGLang's defaults when none did), so the sample never runs on flags that fell over."""
    held = burst(arms, fleet.endpoints, **burst_args)
    safe = next((a.plan_args for a in arms if held.get(a.name, {}).get("held")), [])
    for arm in arms:
        outcome = held.get(arm.name, {})
        logger.info("worst-case burst, arm '%s': %s", arm.name, outcome.get("why", "not run"))
        if not outcome.get("held", True):
            for i in arm.servers:
                fleet.relaunch(i, safe)
    return held


class Fleet(Protocol):
    """What the trial needs of a fleet (`datagen.engine.launcher.ServerFleet`)."""

    @property
    def endpoints(self) -> list[ServerEndpoint]: ...
    def relaunch(self, index: int, plan_args: Sequence[str]) -> None: ...


def _held_why(entry: dict[str, Any]) -> str:
    parts = []
    for f in entry["servers"]:
        state = "healthy" if f["healthy_after"] else "down"
        part = f"{f['server']}: {f['answered']}/{f['requests']} answered, {f['retracted']} retracted, {state}"
        parts.append(part + (f" ({f['errors'][0]})" if f["errors"] else ""))
    verdict = "held" if entry["held"] else "did not hold"
    return f"{verdict} a burst of prompts of {entry['prompt_tokens']:,} tokens: " + "; ".join(parts)


def judge(
    arms: Sequence[Arm],
    server_names: Sequence[str],
    readings: Sequence[Reading],
    queued: Sequence[tuple[float, int]],
    held: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """Each arm's measured running requests and output tokens/s per server; the fastest that held is kept.

    `server_names`: the fleet's server names by index; `queued`: (time, requests waiting in the dispatcher) as the
    probe sampled it. Only readings taken while requests waited count (every arm could fill its batch); when
    there were none (a tiny pilot) every reading with a running batch counts and the method says so. `held`:
    the burst's verdicts (`burst`); an arm that did not hold is never kept (its servers ran the plan's choice).
    """
    times = [t for t, _ in queued]
    held = held or {}

    def loaded(t: float) -> bool:
        i = bisect.bisect_right(times, t) - 1
        return i >= 0 and queued[i][1] > 0

    failed = {name for name, h in held.items() if not h["held"]}
    arm_of = {
        server_names[i]: arm.name
        for arm in arms
        for i in arm.servers
        if i < len(server_names) and arm.name not in failed
    }
    busy = [r for r in readings if r.server in arm_of and r.running > 0]
    window = [r for r in busy if loaded(r.t)]
    method = "readings while the dispatcher had requests waiting"
    if not any(r.gen_throughput > 0 for r in window):
        window, method = busy, "every reading with a running batch (the queue never stayed full)"
    measured: dict[str, dict[str, Any]] = {}
    for arm in arms:
        own = [r for r in window if arm_of.get(r.server) == arm.name and r.gen_throughput > 0]
        entry: dict[str, Any] = {
            "plan_args": arm.plan_args,
            "servers": [server_names[i] for i in arm.servers if i < len(server_names)],
            "predicted_running": arm.predicted_running,
            "candidate": arm.candidate or arm.name,
            "mem_fraction_static": arm.fraction,
            "readings": len(own),
        }
        if arm.name in held:
            entry["burst"] = held[arm.name]
        if arm.headroom is not None:
            entry["headroom"] = arm.headroom.as_dict()
        if own:
            entry["running"] = round(sum(r.running for r in own) / len(own), 1)
            entry["peak_running"] = max(r.running for r in own)
            entry["tokens_per_s_per_server"] = round(sum(r.gen_throughput for r in own) / len(own), 1)
        measured[arm.name] = entry
    rated = {n: m["tokens_per_s_per_server"] for n, m in measured.items() if "tokens_per_s_per_server" in m}
    if not rated:
        return {"arms": measured, "method": method, "kept": None, "why": "no arm reported a running batch"}
    kept = max(rated, key=lambda n: rated[n])
    others = ", ".join(f"'{n}' {v:,.0f}" for n, v in sorted(rated.items(), key=lambda kv: -kv[1]) if n != kept)
    k = measured[kept]
    why = (
        f"'{kept}' decoded {rated[kept]:,.0f} output tok/s per server at {k['running']:g} running requests "
        f"(peak {k['peak_running']}), the fastest measured" + (f"; {others}" if others else "")
    )
    if failed:
        why += "; did not hold the worst-case burst: " + ", ".join(f"'{n}'" for n in sorted(failed))
    if kept in held:
        why += f"; {held[kept]['why']}"
    return {"arms": measured, "method": method, "kept": kept, "why": why}


def kept_candidate(engine: dict[str, Any] | None) -> tuple[str | None, str]:
    """The candidate a pilot's trial kept and why, from its report's engine section; (None, "") without a trial."""
    trial = (engine or {}).get("trial") or {}
    kept = trial.get("kept")
    if not isinstance(kept, str):
        return None, ""
    arm = (trial.get("arms") or {}).get(kept) or {}
    return str(arm.get("candidate") or kept), f"{trial.get('why', '')} ({trial.get('method', '')})"


def kept_headroom(engine: dict[str, Any] | None) -> Headroom | None:
    """The measured headroom whose higher fraction the trial kept (it held the burst and was fastest), or None."""
    trial = (engine or {}).get("trial") or {}
    arm = (trial.get("arms") or {}).get(trial.get("kept")) or {}
    raw = arm.get("headroom")
    return Headroom(**raw) if isinstance(raw, dict) else None


def kept_plan(engine: dict[str, Any] | None) -> dict[str, Any]:
    """What a pilot's trial kept, as `memory_plan_for` keywords: the candidate, and the headroom whose higher
    fraction held the worst-case burst and was fastest (empty without a trial)."""
    kept, why = kept_candidate(engine)
    if kept is None:
        return {}
    out: dict[str, Any] = {"prefer": kept, "prefer_why": why}
    headroom = kept_headroom(engine)
    if headroom is not None:
        out |= {"headroom": headroom, "headroom_why": f"kept by the pilot's trial: {why}"}
    return out


def report_rows(engine: dict[str, Any]) -> list[str]:
    """Pilot report rows: each arm's flags, its burst, measured running requests and tokens/s, and which was kept."""
    trial = engine.get("trial")
    if not trial:
        return [f"| candidate plans side by side | {engine['trial_skipped']} |"] if engine.get("trial_skipped") else []
    rows = []
    for name, arm in trial["arms"].items():
        mark = " **kept**" if name == trial["kept"] else ""
        measured = (
            f"{arm['tokens_per_s_per_server']:,.0f} tok/s per server at {arm['running']:g} running "
            f"(peak {arm['peak_running']}; sizing: {arm['predicted_running']})"
            if "tokens_per_s_per_server" in arm
            else f"no running batch measured (sizing: {arm['predicted_running']})"
        )
        if "burst" in arm:
            measured += f"; {arm['burst']['why']}"
        flags = " ".join(arm["plan_args"]) or "SGLang defaults"
        rows.append(f"| candidate '{name}'{mark} on {', '.join(arm['servers'])}: {flags} | {measured} |")
    rows.append(f"| plan kept for the main run ({trial['method']}) | {trial['why']} |")
    return rows
