"""The memory plan judged by SGLang 0.5.23's own pool sizing, on an emulated 96 GB RTX PRO 6000 (SM120).

For each candidate launch of `datagen/engine/memory_plan.py`, the real code resolves the argv (`prepare_server_args`,
`publish` -> `resolve_once`: mem_fraction_static, mamba strategy, CUDA-graph sizes), builds the real `ModelConfig`
from config.json and runs `KVCacheConfigurator._resolve_memory_pool_config` (`_profile_available_bytes`,
`_handle_max_mamba_cache`, `_calculate_mamba_ratio`, `DefaultPoolConfigurator.calculate_pool_sizes`,
`resolve_max_num_reqs`). Only what needs a GPU is supplied: the free memory torch would measure after the weights
load (`get_available_gpu_memory`), a WORLD group for a tp-1 server, and torch dtypes' sizes (torch is a stub).
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from datagen.engine.headroom import HEADROOM
from datagen.engine.memory_plan import (
    EngineFlags,
    GpuMemory,
    MemoryPlan,
    ModelShape,
    PrefixReuse,
    UnstartableError,
    plan_memory,
    sglang_sizing,
)
from datagen.local.model_fixture import ensure_model_dir
from tests.conformance.conftest import REPO_ROOT, RealSglang

# What the conformance shim's torch.cuda reports for one RTX PRO 6000 Blackwell: total, and free = total - 512 MiB.
GPU_TOTAL_BYTES = 97_887 * 2**20
# Qwen3.6-27B in BF16 as loaded without speculative decoding (the MTP head stays on disk): 27.36e9 parameters
# counted from tests/fixtures/qwen3.6-27b-config.json (embeddings and untied lm_head 2.54e9, 48 GDN layers
# 12.83e9 with their MLPs, 16 attention layers 5.96e9, norms, vision tower 0.46e9) x 2 bytes. An estimate
# (background: "~52-54 GB"); on the box the plan reads the checkpoint's own size.
QWEN36_27B_WEIGHTS_BYTES = 54_714_000_000
CONFIG_27B = REPO_ROOT / "tests" / "fixtures" / "qwen3.6-27b-config.json"
DOC = REPO_ROOT / "docs" / "real-engine.md"
CONTEXTS = (2048, 4096, 8192)
# (mean context, turns per conversation, output tokens per turn) of multi-turn runs that generate every turn.
MULTI_TURN = ((4096, 2, 1500), (8192, 4, 3000), (16384, 8, 300), (32768, 8, 200))

_SIZING = r"""
import types
import torch

class _DType:
    def __init__(self, name, itemsize):
        self.name, self.itemsize = name, itemsize

    def __repr__(self):
        return f"torch.{self.name}"

# The stubbed torch has no dtypes; pool sizing reads only their sizes.
for _name, _size in (("float32", 4), ("bfloat16", 2), ("float16", 2)):
    setattr(torch, _name, _DType(_name, _size))
torch._utils._element_size = lambda dtype: dtype.itemsize

import sglang.srt.mem_cache.kv_cache_configurator as kcfg
from sglang.srt.configs.hybrid_arch import hybrid_gdn_config, mambaish_config
from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.mem_cache.kv_cache_configurator import KVCacheConfigurator
from sglang.srt.runtime_context import get_parallel, get_schedule, publish
from sglang.srt.server_args import prepare_server_args
from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

get_parallel().override_permanently(world_group=types.SimpleNamespace(cpu_group=None))  # one GPU, tp 1
out = []
for case in CASES:
    server_args = prepare_server_args(case["argv"])
    publish(server_args, role="scheduler")
    mc = ModelConfig.from_server_args(server_args)
    n = mc.num_hidden_layers
    layers = types.SimpleNamespace(start_layer=0, end_layer=n, num_effective_layers=n)
    kvc = types.SimpleNamespace(
        model_config=mc, server_args=server_args, mambaish_config=mambaish_config(mc),
        hybrid_gdn_config=hybrid_gdn_config(mc), hybrid_kda_config=None, pp_size=1, attn_dp_size=1,
        spec_algorithm=SpeculativeAlgorithm.from_string(None), extra_mamba_cache_bytes_per_req=0,
        is_draft_worker=False, kv_cache_dtype=torch.bfloat16, kv_cache_dtype_str="auto", use_mla_backend=False,
        layer_info=layers, device="cuda", gpu_id=0, post_capture_kv_active=False, is_hybrid_swa=False,
        fused_entry_bytes=lambda name: None,
    )
    for name in ("_calculate_mamba_ratio", "_profile_available_bytes", "_handle_max_mamba_cache",
                 "config_from_budget", "_apply_token_constraints", "resolve_max_num_reqs"):
        setattr(kvc, name, types.MethodType(getattr(KVCacheConfigurator, name), kvc))
    after_weights_gib = (case["pre_load"] - case["weights"]) / (1 << 30)
    kcfg.get_available_gpu_memory = lambda *a, **k: after_weights_gib  # what torch measures after loading
    try:
        config = KVCacheConfigurator._resolve_memory_pool_config(kvc, case["pre_load"] / (1 << 30))
    except (ValueError, RuntimeError) as exc:  # flags this card cannot start: SGLang's own refusal
        out.append({"error": f"{type(exc).__name__}: {exc}"})
        continue
    out.append({
        "mem_fraction_static": get_schedule().mem_fraction_static,
        "max_mamba_cache_size": get_schedule().max_mamba_cache_size,
        "slots_per_request": kvc._calculate_mamba_ratio(),
        "max_total_num_tokens": config.max_total_num_tokens,
        "max_running_requests": config.max_running_requests,
        "state_bytes_per_slot": kvc.mambaish_config.mamba2_cache_params.mamba_cache_per_req,
    })
RESULT = out
"""


def _model_dirs(tmp_path: Path) -> dict[str, Path]:
    """The fixture model directory, and a copy of it carrying Qwen3.6-27B's config.json."""
    fixture = ensure_model_dir()
    real = tmp_path / "qwen3.6-27b"
    shutil.copytree(fixture, real)
    shutil.copy(CONFIG_27B, real / "config.json")
    return {"fixture": fixture, "qwen3.6-27b": real}


def _gpu() -> GpuMemory:
    return GpuMemory(GPU_TOTAL_BYTES, GPU_TOTAL_BYTES, QWEN36_27B_WEIGHTS_BYTES, bandwidth_bytes_per_s=1.792e12)


def _argv(model_dir: Path, flags: EngineFlags) -> list[str]:
    # The sizing-relevant part of the launcher's argv (tp 1, flashinfer on SM120) plus the candidate's flags.
    base = ["--model-path", str(model_dir), "--tp-size", "1", "--attention-backend", "flashinfer"]
    return [*base, *flags.to_args()]


def _real_sizing(real_sglang: RealSglang, argvs: list[list[str]]) -> list[dict[str, Any]]:
    gpu = _gpu()
    cases = [{"argv": a, "pre_load": gpu.pre_model_load_bytes, "weights": gpu.weights_bytes} for a in argvs]
    result: list[dict[str, Any]] = real_sglang.run(
        f"CASES = {json.dumps(cases)}\n{_SIZING}", gpu="sm120", timeout_s=600
    )
    return result


def _plans(model_dir: Path) -> list[tuple[str, MemoryPlan]]:
    model = ModelShape.from_model_dir(model_dir)
    plans = [(f"{c}", plan_memory(model, _gpu(), c, context_source="test")) for c in CONTEXTS]
    # A multi-turn run whose turns extend a prefix: the radix-on balanced candidate is judged too.
    reuse = PrefixReuse(
        history_tokens=3000,
        new_tokens=500,
        output_tokens=1000,
        prefill_tokens_per_s=8000,
        decode_steps_per_s=20,
        cached_share=1.0,
    )
    plans.append(("4096 multi-turn", plan_memory(model, _gpu(), 4096, context_source="test", prefix_reuse=reuse)))
    # turns: every, the trade estimated from the card (prefix_reuse_for_turns): short histories drop the radix
    # cache, long ones keep it (the caps both sides are judged below by the real code).
    for context, turns, output in MULTI_TURN:
        plan = plan_memory(
            model,
            _gpu(),
            context,
            context_source="test",
            turns="every",
            turns_per_conversation=turns,
            output_tokens=output,
        )
        plans.append((f"{context} every x{turns}", plan))
    # The fraction from a measured headroom (issue 45): higher fractions, each candidate's own, judged the same way.
    for context in CONTEXTS:
        plan = plan_memory(model, _gpu(), context, context_source="test", headroom=HEADROOM["0.5.17"])
        plans.append((f"{context} measured headroom", plan))
    return plans


def _doc_table() -> dict[int, tuple[int, int, str]]:
    """docs/real-engine.md's caps table: context -> (defaults, plan, plan flags)."""
    rows = re.findall(r"^\| (\d)K \| (\d+) \| (\d+) \| `([^`]*)` \|", DOC.read_text(encoding="utf-8"), re.M)
    return {int(k) * 1024: (int(d), int(p), flags) for k, d, p, flags in rows}


@pytest.fixture(scope="module")
def judged(real_sglang: RealSglang, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """Every candidate of every plan, with our sizing and the real code's, for both configs."""
    out: dict[str, Any] = {}
    for name, model_dir in _model_dirs(tmp_path_factory.mktemp("models")).items():
        plans = _plans(model_dir)
        argvs = [_argv(model_dir, c.flags) for _, plan in plans for c in plan.candidates]
        argvs += [_argv(model_dir, EngineFlags.from_args(plan.plan_args)) for _, plan in plans]
        out[name] = (plans, _real_sizing(real_sglang, argvs), ModelShape.from_model_dir(model_dir).state_bytes_per_slot)
    return out


@pytest.mark.parametrize("config", ["fixture", "qwen3.6-27b"])
def test_plan_sizing_is_sglang_s_own_and_runs_the_most_requests(judged: dict[str, Any], config: str) -> None:
    """Our sizing equals 0.5.23's for every candidate; the plan's count is >= the defaults' and the highest."""
    plans, real, state_bytes = judged[config]
    real_iter = iter(real)
    for label, plan in plans:
        context = plan.context_tokens
        running: dict[str, int] = {}
        for cand in plan.candidates:
            got = next(real_iter)
            ours = cand.sizing
            assert got["state_bytes_per_slot"] == state_bytes, "config.json read differently from SGLang"
            assert got["mem_fraction_static"] == pytest.approx(ours.mem_fraction_static, abs=1e-9), (label, cand.name)
            assert got["max_mamba_cache_size"] == ours.max_mamba_cache_size, (label, cand.name)
            assert got["slots_per_request"] == ours.slots_per_request, (label, cand.name)
            assert got["max_total_num_tokens"] == ours.max_total_num_tokens, (label, cand.name)
            assert got["max_running_requests"] == ours.max_running_requests, (label, cand.name)
            running[cand.name] = min(got["max_running_requests"], got["max_total_num_tokens"] // context)
        assert running[plan.chosen] >= running["defaults"], (label, running)
        if plan.chosen != "radix-balanced":
            assert running[plan.chosen] == max(running.values()), (label, running)
        else:  # kept the radix cache on purpose: the best of the radix-on candidates
            assert running[plan.chosen] == max(v for k, v in running.items() if "no-radix" not in k), (label, running)
    for label, plan in plans:  # what the launcher passes, resolved and sized by the real code
        got = next(real_iter)
        assert plan.launched is not None
        fit = min(got["max_running_requests"], got["max_total_num_tokens"] // plan.context_tokens)
        assert fit == plan.launched.concurrency(plan.context_tokens) == plan.planned.concurrency, label
    assert next(real_iter, None) is None


def test_docs_caps_table_is_what_sglang_s_code_gives(judged: dict[str, Any]) -> None:
    """docs/real-engine.md's table (Qwen3.6-27B BF16, 96 GB) holds the real code's caps and the plan's flags."""
    plans, _, _ = judged["qwen3.6-27b"]
    table = _doc_table()
    assert sorted(table) == list(CONTEXTS), f"{DOC} lost its caps table rows: {table}"
    for label, plan in plans:
        if "multi-turn" in label or " every x" in label or "measured headroom" in label:
            continue
        assert table[plan.context_tokens] == (
            plan.default.concurrency,
            plan.planned.concurrency,
            " ".join(plan.plan_args),
        )


def test_multi_turn_choice_weighs_the_real_state_slots_per_request(judged: dict[str, Any]) -> None:
    """turns: every: the radix cache costs the real `_calculate_mamba_ratio` (3 + 2 slots per request) and is kept
    only where re-prefilling the history costs more than the requests it displaces; the reason gives both sides."""
    plans, real, _ = judged["qwen3.6-27b"]
    real_iter = iter(real)
    by_label: dict[str, dict[str, dict[str, Any]]] = {}
    for label, plan in plans:
        by_label[label] = {c.name: next(real_iter) for c in plan.candidates}
    chosen = {}
    for label, plan in plans:
        if " every x" not in label:
            continue
        real_caps = by_label[label]
        assert real_caps["radix-balanced"]["slots_per_request"] == 5, "radix cache on: 3 + 2 tracking slots"
        assert real_caps["no-radix-balanced"]["slots_per_request"] == 1
        radix_running = min(
            real_caps["radix-balanced"]["max_running_requests"],
            real_caps["radix-balanced"]["max_total_num_tokens"] // plan.context_tokens,
        )
        no_radix_running = min(
            real_caps["no-radix-balanced"]["max_running_requests"],
            real_caps["no-radix-balanced"]["max_total_num_tokens"] // plan.context_tokens,
        )
        assert radix_running < no_radix_running  # the radix cache always runs fewer at once
        why = next(r for r in plan.reasons if r.startswith("turns extend a prefix"))
        assert f"({radix_running} running," in why and f"({no_radix_running} running," in why
        chosen[label] = plan.chosen
    # docs/real-engine.md's multi-turn table holds these caps and choices.
    rows = re.findall(
        r"^\| (\d+)K \| (\d+) \| ([\d,]+) \| (\d+) \| (\d+) \| (on|off):", DOC.read_text(encoding="utf-8"), re.M
    )
    documented = {f"{int(k) * 1024} every x{t}": (int(on), int(off), c) for k, t, _, on, off, c in rows}
    for label, plan in plans:
        if label in chosen:
            radix = plan.candidate("radix-balanced").concurrency
            off = plan.candidate("no-radix-balanced").concurrency
            assert documented[label] == (radix, off, "on" if plan.chosen == "radix-balanced" else "off"), label
    assert len(documented) == len(MULTI_TURN), f"{DOC} lost its multi-turn rows: {documented}"
    assert chosen == {
        "4096 every x2": "no-radix-balanced",
        "8192 every x4": "no-radix-balanced",
        "16384 every x8": "radix-balanced",
        "32768 every x8": "radix-balanced",
    }


def test_flags_the_card_cannot_start_are_refused_as_sglang_refuses_them(
    real_sglang: RealSglang, tmp_path: Path
) -> None:
    """An expert's first try (issue 45): the state pool of 256 slots leaves no KV cache at 0.88. SGLang's own code
    refuses it; the plan refuses it before launch, names the state pool, and quotes SGLang's suggestion exactly."""
    model_dir = _model_dirs(tmp_path)["qwen3.6-27b"]
    model = ModelShape.from_model_dir(model_dir)
    args = ["--disable-radix-cache", "--max-running-requests", "256", "--mem-fraction-static", "0.88"]
    with pytest.raises(UnstartableError) as refused:
        sglang_sizing(model, _gpu(), EngineFlags.from_args(args))
    fits = int(str(refused.value).split("to at most ")[1].split(";")[0].split(" ")[0])
    under = [*args[:2], str(fits), *args[3:]]
    over = [*args[:2], str(fits + 2), *args[3:]]
    real = _real_sizing(real_sglang, [[*_argv(model_dir, EngineFlags()), *a] for a in (args, under, over)])
    assert "error" in real[0] and "Loaded weights leave no GPU memory for the KV cache" in real[0]["error"], real[0]
    quoted = str(refused.value).split("'")[1]  # what the refusal says SGLang would say
    assert quoted in real[0]["error"], (quoted, real[0]["error"])
    assert "error" not in real[1] and real[1]["max_running_requests"] == fits  # the advice starts
    assert "error" in real[2]
