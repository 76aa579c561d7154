"""The memory plan's multi-turn trade (`prefix_reuse_for_turns`, `choose_prefix_reuse`) against a real H100 run.

The run (benchmarks/README.md, "Real engine" item 4, call 5; SGLang 0.5.17, the fixture model): 24 conversations x
4 turns, each turn 2,048 new user tokens and 64 output tokens, at most running + 4 requests at the server. The plan
kept the radix cache (5 running, `--max-mamba-cache-size 25`) against 10 running without, predicting 2.82x; both
ran 65.5 s. Its per-turn prompts averaged 5,216 tokens (2,048 new + 3,168 history), and the cache held 66% of the
history (the state pool evicts a conversation's state before its next turn when too few slots are spare).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from datagen.engine.memory_plan import (
    Candidate,
    GpuMemory,
    MemoryPlan,
    ModelShape,
    PrefixReuse,
    choose_prefix_reuse,
    plan_memory,
    prefix_reuse_for_turns,
)

CONFIG_27B = Path(__file__).resolve().parents[1] / "fixtures" / "qwen3.6-27b-config.json"
# The H100 80GB HBM3 as multiturn.py planned for it: probed, with 0.5.17's reservations, calibrated from the
# defaults server's log (benchmarks/results/real-engine-h100-80gb-hbm3/defaults.json, "calibrated_gpu").
H100 = GpuMemory(
    total_bytes=85_017_493_504,
    free_bytes=84_465_090_560,
    weights_bytes=55_070_922_548,
    bandwidth_bytes_per_s=3.35e12,
    engine_reserved_bytes=1 << 30,
    vlm_cache_in_pools=False,
    measured_pre_model_load_bytes=82_119_774_700,
)
TURNS, USER, OUTPUT = 4, 2048, 64
LAST_TURN = TURNS * (USER + OUTPUT)  # 8,448: what multiturn.py and the pipeline pass as the context


@pytest.fixture(scope="module")
def model() -> ModelShape:
    return ModelShape.from_config(json.loads(CONFIG_27B.read_text(encoding="utf-8")))


def _h100_plan(model: ModelShape, conversations_open: int | None = None) -> MemoryPlan:
    # The run's own call (multiturn.py with --max-inflight auto) names no conversations_open: the default.
    rotation = {} if conversations_open is None else {"conversations_open": conversations_open}
    return plan_memory(
        model,
        H100,
        LAST_TURN,
        context_source="test",
        turns="every",
        turns_per_conversation=TURNS,
        output_tokens=OUTPUT,
        **rotation,
    )


def _ms(plan: MemoryPlan) -> tuple[float, float]:
    """(with the radix cache, without) ms of GPU time per request, as the plan's reason gives them."""
    why = next(r for r in plan.reasons if r.startswith("turns extend a prefix"))
    with_ms, without_ms = (float(m) for m in re.findall(r"([\d.]+) ms", why))
    return with_ms, without_ms


def test_the_h100_run_s_shape_is_planned_as_it_was(model: ModelShape) -> None:
    """The same candidates as the run's multiturn.json: the inputs below are the run's, only the trade changed."""
    plan = _h100_plan(model)
    radix, no_radix = plan.candidate("radix-balanced"), plan.candidate("no-radix-balanced")
    assert (radix.concurrency, radix.sizing.max_mamba_cache_size, no_radix.concurrency) == (5, 25, 10)
    assert plan.candidate_args["radix-balanced"][-1] == "0.766"


def test_the_h100_run_is_no_longer_predicted_2_8x_faster_with_the_radix_cache(model: ModelShape) -> None:
    """Measured: 65.7 s with the cache, 65.5 s without (1.002x). The old trade said 243 vs 686 ms (2.82x)."""
    with_ms, without_ms = _ms(_h100_plan(model))
    assert 0.8 <= max(with_ms, without_ms) / min(with_ms, without_ms) <= 1.4


def test_the_history_is_the_mean_over_turns_of_the_last_turn_s_context(model: ModelShape) -> None:
    """8,448 tokens at the last turn, 4 turns: 2,112 a turn, history (0 + 1 + 2 + 3) x 2,112 / 4 = 3,168 (not 5,069)."""
    plan = _h100_plan(model)
    why = next(r for r in plan.reasons if r.startswith("turns extend a prefix"))
    assert "3168 history tokens" in why and "2048 new tokens" in why
    reuse = prefix_reuse_for_turns(model, H100, LAST_TURN, TURNS, OUTPUT, 10, plan.candidate("radix-balanced"))
    assert isinstance(reuse, PrefixReuse)
    # The run's mean prompt: 2,048 new + 3,168 history = 5,216 tokens.
    assert (reuse.new_tokens, reuse.history_tokens) == (USER, 3168)


def test_new_tokens_are_prefilled_with_the_radix_cache_and_without(model: ModelShape) -> None:
    # The run's plan: the radix side is at least its decode (64 / (5 x 52.6 steps/s) = 243 ms) plus the 2,048 new
    # tokens' prefill at the plan's 8,979 tok/s (228 ms); the old trade charged it the decode alone.
    with_ms, _ = _ms(_h100_plan(model))
    assert with_ms >= 243.3 + 228.0
    plan = _h100_plan(model, conversations_open=5)  # every state stays cached
    reuse = prefix_reuse_for_turns(model, H100, LAST_TURN, TURNS, OUTPUT, 10, plan.candidate("radix-balanced"), 5)
    assert isinstance(reuse, PrefixReuse) and reuse.cached_share == 1.0
    decode_with = reuse.output_tokens / (5 * reuse.decode_steps_per_s)
    prefill_new = reuse.new_tokens / reuse.prefill_tokens_per_s
    with_ms, without_ms = _ms(plan)
    assert with_ms == pytest.approx((decode_with + prefill_new) * 1e3, abs=0.1)
    assert without_ms == pytest.approx(reuse.gpu_seconds(10, radix=False) * 1e3, abs=0.1)
    assert reuse.gpu_seconds(10, radix=False) > (reuse.new_tokens + reuse.history_tokens) / reuse.prefill_tokens_per_s
    # More new tokens cost both sides the same: the difference stays, the ratio shrinks.
    more = PrefixReuse(**{**vars(reuse), "new_tokens": reuse.new_tokens + 8000})
    extra = 8000 / reuse.prefill_tokens_per_s
    assert more.gpu_seconds(5, radix=True) == pytest.approx(reuse.gpu_seconds(5, radix=True) + extra)
    assert more.gpu_seconds(10, radix=False) == pytest.approx(reuse.gpu_seconds(10, radix=False) + extra)


def test_the_cached_share_falls_when_more_conversations_rotate_than_state_slots_are_spare(model: ModelShape) -> None:
    """25 slots, 5 running holding 4 each: 5 spare. 5 conversations in rotation keep all; 9 (5 + 4 queued, the
    default) 5/9; 24 (a client that holds every conversation open) 5/24, and then re-prefill costs the cache."""
    radix: Candidate = _h100_plan(model).candidate("radix-balanced")
    shares = {}
    for open_ in (3, 5, None, 24):
        reuse = prefix_reuse_for_turns(model, H100, LAST_TURN, TURNS, OUTPUT, 10, radix, open_)
        assert isinstance(reuse, PrefixReuse)
        shares[open_] = reuse.cached_share
    assert shares == {3: 1.0, 5: 1.0, None: pytest.approx(5 / 9), 24: pytest.approx(5 / 24)}
    assert _h100_plan(model).chosen == "radix-balanced"
    flooded = _h100_plan(model, conversations_open=24)
    assert flooded.chosen == "no-radix-balanced" and "21% of 3168 history tokens cached" in " ".join(flooded.reasons)
    # A lost state costs its history's re-prefill: the radix side grows, the other stays.
    kept, lost = (_ms(_h100_plan(model, n)) for n in (5, 24))
    assert lost[0] > kept[0] and lost[1] == kept[1]


def test_choose_prefix_reuse_charges_the_evicted_history() -> None:
    base = dict(history_tokens=8000, new_tokens=1000, output_tokens=100, prefill_tokens_per_s=8000.0)
    every = PrefixReuse(**base, decode_steps_per_s=50.0, cached_share=1.0)
    none = PrefixReuse(**base, decode_steps_per_s=50.0, cached_share=0.0)
    assert choose_prefix_reuse(every, with_radix=5, without_radix=10)[0]
    keep, why = choose_prefix_reuse(none, with_radix=5, without_radix=10)
    assert not keep and "0% of 8000 history tokens cached" in why
