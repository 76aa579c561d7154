"""Candidate memory plans side by side: the pilot runs each on its own GPUs and keeps the fastest, measured.

The memory plan (`memory_plan.plan_memory`) predicts from SGLang's sizing code; on a box with several GPUs the
pilot can check the prediction. Each candidate ("arm": the plan's choice, SGLang's defaults, the radix cache on
with balanced pools, the radix cache off with the 0.9 split, in that order, as many as there are servers) runs
on its own servers, fed from the one dispatcher's queue of the pilot's stratified sample, so every arm draws
from the same sample at the same time. Each server's running requests and decode rate are read from the server
itself (`gen_throughput`, `num_running_reqs`: `/metrics` or `/v1/loads`, as `tasks.pilot.ThroughputProbe`
polls them) while the dispatcher still had requests waiting (every arm could fill its batch). The arm with the
most output tokens/s per server is kept; the main run's plan then chooses that candidate at its own measured
context (`plan_memory(prefer=...)`), recorded in its lineage and card.

    arms = trial_arms(plan, servers)                  # which candidate runs on which server
    server_plan_args(arms, servers)                   # one flag list per server for the fleet
    result = judge(arms, names, readings, queued)     # per arm: running requests, tokens/s; kept and why
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

from datagen.engine.memory_plan import MemoryPlan

__all__ = [
    "TRIAL_ORDER",
    "Arm",
    "TrialChoice",
    "judge",
    "kept_candidate",
    "report_rows",
    "server_plan_args",
    "trial_arms",
    "wanted",
]

# Candidates in the order they get servers: the plan's choice first, then the defaults it claims to beat.
TRIAL_ORDER = ("defaults", "radix-balanced", "no-radix", "no-radix-balanced")
TrialChoice = Literal["auto", "on", "off"]


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

    name: str
    plan_args: list[str]
    servers: list[int]
    predicted_running: int  # SGLang's sizing at the pilot's expected context


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


def trial_arms(plan: MemoryPlan, servers: int) -> list[Arm]:
    """The plan's choice, then the other candidates in TRIAL_ORDER, one per server round-robin (at most `servers`)."""
    names = [plan.chosen, *(n for n in TRIAL_ORDER if n != plan.chosen and any(c.name == n for c in plan.candidates))]
    names = names[: max(1, servers)]
    assigned: dict[str, list[int]] = {n: [] for n in names}
    for i in range(servers):
        assigned[names[i % len(names)]].append(i)
    arms = []
    for name in names:
        cand = plan.candidate(name)
        args = plan.plan_args if name == plan.chosen else plan.args_for(cand)
        arms.append(Arm(name, list(args), assigned[name], cand.concurrency))
    return arms


def server_plan_args(arms: Sequence[Arm], servers: int) -> list[list[str]]:
    """One flag list per server index, as `ServerFleet(server_plan_args=...)` takes them."""
    out: list[list[str]] = [[] for _ in range(servers)]
    for arm in arms:
        for i in arm.servers:
            out[i] = list(arm.plan_args)
    return out


def judge(
    arms: Sequence[Arm],
    server_names: Sequence[str],
    readings: Sequence[Reading],
    queued: Sequence[tuple[float, int]],
) -> dict[str, Any]:
    """Each arm's measured running requests and output tokens/s per server; the fastest is kept.

    `server_names`: the fleet's server names by index; `queued`: (time, requests waiting in the dispatcher) as the
    probe sampled it. Only readings taken while requests waited count (every arm could fill its batch); when
    there were none (a tiny pilot) every reading with a running batch counts and the method says so.
    """
    times = [t for t, _ in queued]

    def loaded(t: float) -> bool:
        i = bisect.bisect_right(times, t) - 1
        return i >= 0 and queued[i][1] > 0

    arm_of = {server_names[i]: arm.name for arm in arms for i in arm.servers if i < len(server_names)}
    busy = [r for r in readings if r.server in arm_of and r.running > 0]
    window = [r for r in busy if loaded(r.t)]
    method = "readings while the dispatcher had requests waiting"
    if not any(r.gen_throughput > 0 for r in window):
        window, method = busy, "every reading with a running batch (the queue never stayed full)"
    measured: dict[str, dict[str, Any]] = {}
    for arm in arms:
        own = [r for r in window if arm_of[r.server] == arm.name and r.gen_throughput > 0]
        entry: dict[str, Any] = {
            "plan_args": arm.plan_args,
            "servers": [server_names[i] for i in arm.servers if i < len(server_names)],
            "predicted_running": arm.predicted_running,
            "readings": len(own),
        }
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
    return {"arms": measured, "method": method, "kept": kept, "why": why}


def kept_candidate(engine: dict[str, Any] | None) -> tuple[str | None, str]:
    """The candidate a pilot's trial kept and why, from its report's engine section; (None, "") without a trial."""
    trial = (engine or {}).get("trial") or {}
    kept = trial.get("kept")
    return (kept, f"{trial.get('why', '')} ({trial.get('method', '')})") if isinstance(kept, str) else (None, "")


def report_rows(engine: dict[str, Any]) -> list[str]:
    """Pilot report rows: each arm's flags, measured running requests and tokens/s, and which was kept."""
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
        flags = " ".join(arm["plan_args"]) or "SGLang defaults"
        rows.append(f"| candidate '{name}'{mark} on {', '.join(arm['servers'])}: {flags} | {measured} |")
    rows.append(f"| plan kept for the main run ({trial['method']}) | {trial['why']} |")
    return rows
