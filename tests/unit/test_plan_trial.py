"""The side-by-side trial's which candidate runs where, how the winner is judged, what the main run keeps."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest

from datagen.engine import plan_trial
from datagen.engine.headroom import HEADROOM
from datagen.engine.memory_plan import GpuMemory, MemoryPlan, ModelShape, plan_memory

CONFIG_27B = Path(__file__).parents[1] / "fixtures" / "qwen3.6-27b-config.json"
GPU_BYTES = 97_887 * 2**20
GPU = GpuMemory(GPU_BYTES, GPU_BYTES, 54_714_000_000, bandwidth_bytes_per_s=1.792e12)


@dataclass(frozen=True)
class _Reading:
    t: float
    server: str
    running: int
    gen_throughput: float


@pytest.fixture(scope="module")
def plan() -> MemoryPlan:
    model = ModelShape.from_config(json.loads(CONFIG_27B.read_text(encoding="utf-8")))
    return plan_memory(model, GPU, 4096, context_source="test")


def test_arms_put_the_plan_first_then_the_defaults_and_spread_over_every_server(plan: MemoryPlan) -> None:
    arms = plan_trial.trial_arms(plan, 8)
    assert [a.name for a in arms] == ["no-radix-balanced", "defaults", "radix-balanced", "no-radix"]
    assert [a.servers for a in arms] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert arms[0].plan_args == plan.plan_args and arms[1].plan_args == []
    assert "--disable-radix-cache" not in arms[2].plan_args and "--max-mamba-cache-size" in arms[2].plan_args
    per_server = plan_trial.server_plan_args(arms, 8)
    assert per_server[4] == plan.plan_args and per_server[5] == []
    assert [a.name for a in plan_trial.trial_arms(plan, 2)] == ["no-radix-balanced", "defaults"]


def test_auto_runs_the_trial_only_with_several_launched_servers_and_a_plan(plan: MemoryPlan) -> None:
    assert plan_trial.wanted("auto", 8, plan, attached=False)[0]
    assert plan_trial.wanted("auto", 1, plan, attached=False) == (False, "one server: nothing to compare side by side")
    assert not plan_trial.wanted("auto", 8, plan, attached=True)[0]
    assert not plan_trial.wanted("auto", 8, None, attached=False)[0]
    assert not plan_trial.wanted("off", 8, plan, attached=False)[0]


def test_judge_keeps_the_fastest_measured_arm_even_when_sizing_predicted_otherwise(plan: MemoryPlan) -> None:
    arms = plan_trial.trial_arms(plan, 2)
    names = ["gpu0", "gpu1"]
    # The dispatcher had requests waiting until t=10; afterwards (the drain) readings do not count.
    queued = [(0.0, 50), (10.0, 0)]
    readings = [
        *(_Reading(t, "gpu0", 60, 900.0) for t in (1, 2, 3)),
        *(_Reading(t, "gpu1", 15, 1000.0) for t in (1, 2, 3)),
        _Reading(11.0, "gpu0", 2, 5000.0),  # drain: ignored
    ]
    result = plan_trial.judge(arms, names, readings, queued)
    assert result["kept"] == "defaults" and result["method"] == "readings while the dispatcher had requests waiting"
    assert result["arms"]["no-radix-balanced"] == {
        "plan_args": plan.plan_args,
        "servers": ["gpu0"],
        "predicted_running": plan.planned.concurrency,
        "candidate": "no-radix-balanced",
        "mem_fraction_static": plan.fraction["value"],
        "readings": 3,
        "running": 60.0,
        "peak_running": 60,
        "tokens_per_s_per_server": 900.0,
    }
    assert "'defaults' decoded 1,000 output tok/s per server at 15 running" in result["why"]
    # The main run chooses the kept candidate at its own context, and records why.
    kept, why = plan_trial.kept_candidate({"trial": result})
    model = ModelShape.from_config(json.loads(CONFIG_27B.read_text(encoding="utf-8")))
    main = plan_memory(model, GPU, 3000, context_source="test", prefer=kept, prefer_why=why)
    assert main.chosen == "defaults" and main.plan_args == [] and main.kept_by_trial == why
    assert main.lineage()["kept_by_trial"] == why
    assert plan_trial.kept_candidate(None) == (None, "") and plan_trial.kept_candidate({"skipped": "x"}) == (None, "")
    rows = "\n".join(plan_trial.report_rows({"trial": result}))
    assert "| candidate 'defaults' **kept** on gpu1: SGLang defaults | 1,000 tok/s per server at 15 running" in rows


def test_judge_falls_back_to_every_busy_reading_and_names_no_winner_without_any() -> None:
    arm = plan_trial.Arm("defaults", [], [0], 15)
    result = plan_trial.judge([arm], ["gpu0"], [_Reading(1.0, "gpu0", 4, 100.0)], [(0.0, 0)])
    assert result["kept"] == "defaults" and result["method"].startswith("every reading with a running batch")
    empty = plan_trial.judge([arm], ["gpu0"], [], [])
    assert empty["kept"] is None and empty["why"] == "no arm reported a running batch"


def test_a_higher_fraction_arm_comes_second_and_an_arm_that_did_not_hold_is_never_kept(plan: MemoryPlan) -> None:
    model = ModelShape.from_config(json.loads(CONFIG_27B.read_text(encoding="utf-8")))
    tried = plan_trial.trial_headroom("0.5.23", None)
    assert tried is not None and tried.engine == "0.5.23" and "tried on SGLang 0.5.23" in tried.source
    higher = plan_memory(model, GPU, 4096, context_source="test", headroom=tried)
    assert higher.fraction["value"] > plan.fraction["value"]
    arms = plan_trial.trial_arms(plan, 3, higher)
    up = f"no-radix-balanced@{higher.fraction['value']:g}"
    assert [a.name for a in arms] == ["no-radix-balanced", up, "defaults"]
    assert arms[1].plan_args == higher.plan_args and arms[1].headroom == tried and arms[1].candidate == plan.chosen
    names = ["gpu0", "gpu1", "gpu2"]
    readings = [_Reading(1.0, "gpu0", 60, 900.0), _Reading(1.0, "gpu1", 80, 1200.0), _Reading(1.0, "gpu2", 15, 500.0)]
    fig = {"server": "gpu1", "requests": 80, "answered": 79, "retracted": 0, "healthy_after": False, "errors": ["x"]}
    held = {
        up: {"held": False, "servers": [fig], "prompt_tokens": 8000, "why": "did not hold a burst"},
        "no-radix-balanced": {"held": True, "servers": [], "prompt_tokens": 8000, "why": "held a burst"},
    }
    # The fastest reading comes from the arm that did not hold (its server was relaunched): it is not kept.
    result = plan_trial.judge(arms, names, readings, [(0.0, 9)], held)
    assert result["kept"] == "no-radix-balanced" and f"did not hold the worst-case burst: '{up}'" in result["why"]
    assert "readings" in result["arms"][up] and "tokens_per_s_per_server" not in result["arms"][up]
    assert plan_trial.kept_plan({"trial": result}) == {
        "prefer": "no-radix-balanced",
        "prefer_why": plan_trial.kept_candidate({"trial": result})[1],
    }
    # Held and fastest: the main run plans with that headroom, the pilot's evidence in the fraction's reasons.
    held[up]["held"] = True
    result = plan_trial.judge(arms, names, readings, [(0.0, 9)], held)
    kept = plan_trial.kept_plan({"trial": result})
    assert result["kept"] == up and kept["prefer"] == "no-radix-balanced" and kept["headroom"] == tried
    main = plan_memory(model, GPU, 3000, context_source="test", **kept)
    assert main.fraction["source"] == "measured-headroom" and "kept by the pilot's trial" in main.fraction["why"]
    assert main.lineage()["mem_fraction_static"]["value"] == main.fraction["value"] > plan.fraction["value"]


def test_no_higher_arm_when_the_higher_plan_is_not_higher(plan: MemoryPlan) -> None:
    assert [a.name for a in plan_trial.trial_arms(plan, 3, plan)] == ["no-radix-balanced", "defaults", "radix-balanced"]
    assert plan_trial.trial_headroom("0.5.17", replace(HEADROOM["0.5.17"], margin_bytes=0)) is None
    own = plan_trial.trial_headroom("0.5.17", HEADROOM["0.5.17"])
    assert own is not None and own.margin_bytes == 0 and "margin left out" in own.source
