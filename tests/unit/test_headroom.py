"""The memory plan's --mem-fraction-static: from the engine's measured headroom, or SGLang's own (issue 45).

Pure logic against the sizing model (`sglang_sizing`, itself judged by SGLang 0.5.23's code in the conformance
tier). The card is the lent H100 of issue 45 as SGLang 0.5.17 saw it (76.99 GiB free before the weights, 51.25 GiB
of weights: `shared/reference/h100-plan-vs-expert`): today's plan runs 40 at 0.766 there (the issue's 38 were planned
from a server that saw 76.48 GiB).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from datagen.engine.headroom import HEADROOM, MAX_FRACTION, Headroom, LoggedGraphs, headroom_for
from datagen.engine.memory_plan import (
    GpuMemory,
    LoggedPools,
    ModelShape,
    UnstartableError,
    decode_graph_max_bs,
    for_engine,
    plan_memory,
    sglang_sizing,
)

_GIB = 1 << 30
CONFIG_27B = Path(__file__).parents[1] / "fixtures" / "qwen3.6-27b-config.json"
H100_TOTAL = 85_017_493_504  # torch's total of the lent H100 80GB HBM3
PRE = round(76.99 * _GIB)  # "Load weight begin. avail mem=76.99 GB" (SGLang 0.5.17, its 1 GiB IPC pool taken)
WEIGHTS = round(51.25 * _GIB)
H100 = replace(
    for_engine(GpuMemory(H100_TOTAL, H100_TOTAL, WEIGHTS, 3.35e12), "0.5.17"),
    measured_pre_model_load_bytes=PRE,
)
# A profile with round numbers: 2 GiB of prefill graphs and 2 GiB of activations at an 8,192-token chunk.
PROFILE = Headroom("0.5.17", 2 * _GIB / 8192, 2 * 2**20, 2 * _GIB / 8192, _GIB, "test")


@pytest.fixture(scope="module")
def model() -> ModelShape:
    return ModelShape.from_config(json.loads(CONFIG_27B.read_text(encoding="utf-8")))


def test_without_a_measured_headroom_the_plan_keeps_sglangs_fraction(model: ModelShape) -> None:
    plan = plan_memory(model, H100, 712, context_source="test")
    assert plan.plan_args == ["--disable-radix-cache", "--max-running-requests", "40", "--mem-fraction-static", "0.766"]
    assert plan.fraction["source"] == "sglang-default" and plan.fraction["value"] == 0.766
    assert plan.lineage()["mem_fraction_static"] == plan.fraction
    assert any(r.startswith("--mem-fraction-static 0.766 (sglang-default)") for r in plan.reasons)


def test_the_fraction_leaves_the_measured_need_and_not_a_thousandth_more(model: ModelShape) -> None:
    plan = plan_memory(model, H100, 712, context_source="test", headroom=PROFILE)
    f = plan.fraction["value"]
    launched = plan.launched
    assert launched is not None and launched.mem_fraction_static == f
    batch = decode_graph_max_bs(
        replace(plan.planned.flags, max_running_requests=launched.max_running_requests), H100_TOTAL
    )
    need = PROFILE.need_bytes(8192, batch)
    assert (
        plan.fraction["need_bytes"] == need
        and plan.fraction["decode_graph_batch"] == batch == launched.max_running_requests
    )
    assert PRE * (1 - f) >= need > PRE * (1 - f - 0.001)
    assert plan.fraction["terms"] == {
        "prefill_graphs": 2 * _GIB,
        "decode_graphs": batch * 2 * 2**20,
        "activations": 2 * _GIB,
        "margin": _GIB,
    }
    assert f"--mem-fraction-static {f:g}" in " ".join(plan.plan_args)
    assert (
        plan.fraction["source"] == "measured-headroom"
        and "SGLang's own fraction would be 0.766" in plan.fraction["why"]
    )


def test_with_the_headroom_the_card_holds_more_than_twice_todays_requests(model: ModelShape) -> None:
    """The issue's workload (712-token requests): today 40 at 0.766; the plan's own balancing at 0.88 ran 84."""
    today = plan_memory(model, H100, 712, context_source="test")
    new = plan_memory(model, H100, 712, context_source="test", headroom=PROFILE)
    at_088 = sglang_sizing(model, H100, replace(new.planned.flags, mem_fraction_static=0.88, max_running_requests=84))
    assert new.fraction["value"] > 0.88
    assert new.planned.concurrency > at_088.concurrency(712) >= 84 > 2 * today.planned.concurrency
    assert new.roofline_tokens_per_s and today.roofline_tokens_per_s
    assert new.roofline_tokens_per_s > today.roofline_tokens_per_s


def test_each_candidate_gets_its_own_fraction_and_a_bigger_need_a_lower_one(model: ModelShape) -> None:
    plan = plan_memory(model, H100, 712, context_source="test", headroom=PROFILE)
    fractions = {c.name: c.sizing.mem_fraction_static for c in plan.candidates}
    # The 0.9-split candidate captures SGLang's default 256 decode graphs: more need, a lower fraction.
    assert fractions["no-radix"] < fractions["no-radix-balanced"]
    assert fractions["defaults"] == pytest.approx(0.7666, abs=1e-3)  # SGLang's own, never the plan's
    hungrier = plan_memory(
        model, H100, 712, context_source="test", headroom=replace(PROFILE, activation_bytes_per_token=4 * _GIB / 8192)
    )
    assert hungrier.fraction["value"] < plan.fraction["value"]
    assert hungrier.planned.concurrency < plan.planned.concurrency


def test_the_fraction_is_capped_and_the_spec_wins(model: ModelShape) -> None:
    tiny = Headroom("x", 0.0, 0.0, 0.0, 0, "nothing measured")
    assert tiny.fraction(PRE, 8192, 256) == MAX_FRACTION
    plan = plan_memory(
        model, H100, 712, context_source="test", headroom=PROFILE, server_args=["--mem-fraction-static", "0.8"]
    )
    assert plan.fraction["source"] == "server_args" and plan.launched and plan.launched.mem_fraction_static == 0.8
    assert "--mem-fraction-static" not in plan.plan_args


def test_recalibration_keeps_the_headroom(model: ModelShape) -> None:
    plan = plan_memory(model, H100, 712, context_source="test", headroom=PROFILE)
    logged = LoggedPools(PRE + _GIB, PRE + _GIB - WEIGHTS, 0.9, 80_000, 90, 90)
    again = plan.recalibrated(
        logged, ["--disable-radix-cache", "--max-running-requests", "90", "--mem-fraction-static", "0.9"]
    )
    assert again.fraction["source"] == "measured-headroom"
    assert again.fraction["value"] >= plan.fraction["value"]  # more memory before the weights: a larger share fits


def test_only_measured_engines_have_a_profile() -> None:
    assert headroom_for("0.5.17") is HEADROOM["0.5.17"]
    assert headroom_for("0.5.23") is None and headroom_for(None) is None


# The start-up lines of SGLang 0.5.17's P088 server on the lent H100 (shared/reference/h100-plan-vs-expert),
# the long bs lists cut to their ends.
P088_LOG = "\n".join(
    [
        "[2026-12-07 12:26:05] Load weight begin. avail mem=76.99 GB",
        "[2026-12-07 12:26:19] Memory pool end. avail mem=9.21 GB",
        "[2026-12-07 12:26:52] Capture target prefill CUDA graph end. elapsed=32.03 s, mem usage=2.89 GB, "
        "avail mem=6.22 GB.",
        "[2026-12-07 12:26:52] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
        "bs=[1, 2, 4, 8, 12, 16, 24, 32, 40, 48, 56, 64, 72, 80, 84], avail mem=6.22 GB",
        "[2026-12-07 12:26:58] Capture target decode CUDA graph end. elapsed=6.18 s, mem usage=0.18 GB, "
        "avail mem=6.04 GB.",
        "[2026-12-07 12:26:58] max_total_num_tokens=70201, chunked_prefill_size=8192, max_prefill_tokens=16384, "
        "max_running_requests=84, context_len=32768, available_gpu_mem=6.04 GB",
        "",
    ]
)


def test_the_graphs_are_read_from_the_servers_log_and_scale_a_measured_profile() -> None:
    graphs = LoggedGraphs.parse(P088_LOG)
    assert graphs == LoggedGraphs(
        pool_end_free_bytes=round(9.21 * _GIB),
        prefill_graph_bytes=round(2.89 * _GIB),
        decode_graph_bytes=round(0.18 * _GIB),
        ready_free_bytes=round(6.04 * _GIB),
        chunk_tokens=8192,
        decode_graph_batch=84,
    )
    assert LoggedGraphs.parse(P088_LOG.rsplit("\n", 2)[0]) is None  # no summary line yet
    measured = Headroom.measured("0.5.17", graphs, 3 * _GIB, margin_bytes=_GIB, source="test")
    # The same server's own figures come back; a 4,096-token chunk halves the chunk-bound terms.
    assert measured.need_bytes(8192, 84) == pytest.approx(round((2.89 + 0.18 + 3) * _GIB) + _GIB, abs=2)
    assert measured.terms(4096, 84)["activations"] == round(1.5 * _GIB)


def test_flags_that_cannot_start_are_refused_with_the_state_pool_named(model: ModelShape) -> None:
    """An expert's first try on 80 GB: SGLang sizes the state pool to 256 slots and asks for a *lower* fraction."""
    args = ["--disable-radix-cache", "--max-running-requests", "256", "--mem-fraction-static", "0.88"]
    with pytest.raises(UnstartableError) as raised:
        plan_memory(model, H100, 712, context_source="test", server_args=args)
    why = str(raised.value)
    assert "--max-running-requests 256 with --disable-radix-cache" in why and "256 slots (36.8 GiB)" in why
    assert "no KV cache is left" in why and "Raise --mem-fraction-static above 0.666" in why
    fits = int(why.split("to at most ")[1].split(";")[0])
    assert "no --mem-fraction-static below 1 holds 256 slots" in why
    # The advice is exact: that many requests start at 0.88, two more do not.
    base = plan_memory(model, H100, 712, context_source="test").planned.flags
    at = replace(base, mem_fraction_static=0.88, max_running_requests=fits)
    assert sglang_sizing(model, H100, at).max_total_num_tokens > 0
    with pytest.raises(UnstartableError):
        sglang_sizing(model, H100, replace(at, max_running_requests=fits + 2))
