"""The engine's memory plan: how many requests each SGLang 0.5.23 server can run at once, and the flags for it.

A hybrid model (Qwen3.6: Gated-DeltaNet layers with a fixed-size recurrent state per request, plus full-attention
layers with a KV cache) splits the memory left after the weights into a state pool and a KV pool. SGLang caps
the running requests at `state slots // slots per request`, and the KV pool caps how many requests of the run's
context length fit at once; decode is memory-bound, so output tokens/s grow with that number. SGLang's defaults
are made for online serving with prefix reuse (radix cache on: 5 state slots per request, pools split 0.9:1).
The plan picks, from the run's expected context, the candidate with the most requests that fit at once.

`sglang_sizing` is SGLang 0.5.23's own pool sizing for a hybrid GDN model on one GPU (tp 1, page size 1, no
speculative decoding), written out from `mem_cache/kv_cache_configurator.py` (`_profile_available_bytes`,
`_handle_max_mamba_cache`, `_calculate_mamba_ratio`, `resolve_max_num_reqs`), `model_executor/pool_configurator.py`
(`DefaultPoolConfigurator`) and `arg_groups/memory_hook.py` (`handle_gpu_memory_settings`). The conformance tier
(`tests/conformance/test_memory_plan_conformance.py`) runs those real functions on the same inputs and requires
the same numbers, so this file cannot drift from the code that decides on the box.

The plan never changes numerics: `--mamba-ssm-dtype`, fp8 KV cache, quantized weights and speculative decoding
are only ever the run spec's explicit choice, which the plan sizes with and records.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, ClassVar, Literal, NoReturn

from datagen.engine.headroom import Headroom

__all__ = [
    "CUDA_CONTEXT_BYTES",
    "ENGINE_MEMORY",
    "NUMERICS_FLAGS",
    "PLAN_FLAGS",
    "QUEUED_PER_SERVER",
    "Candidate",
    "EngineFlags",
    "GpuMemory",
    "LoggedPools",
    "MemoryPlan",
    "ModelShape",
    "PrefixReuse",
    "PromptTokens",
    "Sizing",
    "Turns",
    "UnstartableError",
    "calibrated_gpu",
    "card_bandwidth",
    "card_prefill_flops",
    "choose_prefix_reuse",
    "decode_roofline",
    "expected_context",
    "for_engine",
    "is_hybrid_gdn",
    "numerics_flags",
    "plan_memory",
    "pool_shortfall",
    "prefix_reuse_for_turns",
    "sglang_mem_fraction_static",
    "sglang_sizing",
    "weights_bytes",
]

_GIB = 1 << 30
_MIB = 1 << 20
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}

# What a server's CUDA context and torch take before SGLang measures free memory (`pre_model_load_memory`);
# an estimate (0.5 GiB), the same the conformance tier's emulated GPU reports.
CUDA_CONTEXT_BYTES = 512 * _MIB
# SGLANG_VLM_CACHE_SIZE_MB (100): reserved out of the pools for multimodal models (`mm_runtime_reservation_gb`).
_VLM_CACHE_BYTES = 100 * _MIB
# MAMBA_CACHE_SIZE_MAX_RUNNING_REQUESTS_RATIO, and the extra_buffer tracking slots with/without overlap.
_MAMBA_BASE_SLOTS = 3
_DEFAULT_MAMBA_FULL_MEMORY_RATIO = 0.9
# Requests a client holds queued at a server beyond its running ones (datagen's `Dispatcher(queue_depth=...)`):
# in an every-turn run, about the conversations in rotation there besides the running ones.
QUEUED_PER_SERVER = 4

# Flags the plan may choose (tuning only: they change how memory is split, never what the model computes).
PLAN_FLAGS = (
    "--disable-radix-cache",
    "--max-running-requests",
    "--mamba-full-memory-ratio",
    "--max-mamba-cache-size",
    "--mem-fraction-static",
    "--cuda-graph-max-bs-decode",
)
# Flags that change or may change the outputs: never chosen by the plan, recorded when the spec sets them.
NUMERICS_FLAGS = (
    "--mamba-ssm-dtype",
    "--kv-cache-dtype",
    "--quantization",
    "--dtype",
    "--speculative-algorithm",
)


@dataclass(frozen=True)
class ModelShape:
    """What sizing reads from config.json: layers, KV heads and head size, GDN state shapes and dtypes."""

    context_length: int
    full_attention_layers: int
    linear_layers: int
    kv_heads: int
    head_dim: int
    kv_dtype_bytes: int
    conv_dim: int
    conv_window: int
    conv_dtype_bytes: int
    ssm_heads: int
    ssm_head_dim: int
    ssm_state_size: int
    ssm_dtype_bytes: int
    vision_hidden_size: int | None

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of every full-attention layer for one token (`DefaultPoolConfigurator` cell size)."""
        return self.full_attention_layers * self.kv_heads * self.head_dim * 2 * self.kv_dtype_bytes

    @property
    def state_bytes_per_slot(self) -> int:
        """One request's recurrent state over every GDN layer (`mamba_cache_per_req`)."""
        conv = self.conv_dim * self.conv_window * self.conv_dtype_bytes
        ssm = self.ssm_heads * self.ssm_head_dim * self.ssm_state_size * self.ssm_dtype_bytes
        return (conv + ssm) * self.linear_layers

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, mamba_ssm_dtype: str | None = None) -> ModelShape:
        """Read a Qwen3.5/3.6 (qwen3_5 / qwen3_next family) config.json as SGLang 0.5.23 does.

        Keys the file leaves out take the config class's defaults (`configs/qwen3_next.py: Qwen3NextConfig`),
        as they do in SGLang; layer kinds come from `full_attention_interval` (`layers_block_type`).
        """
        text = config.get("text_config") or config
        if not isinstance(text, Mapping):
            raise ValueError("config.json: text_config is not an object")

        def num(key: str, default: int) -> int:
            value = text.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"config.json: text_config.{key} = {value!r} is not a non-negative integer")
            return value

        layers = num("num_hidden_layers", 48)
        interval = num("full_attention_interval", 4) or 1
        full = sum(1 for i in range(layers) if (i + 1) % interval == 0)
        key_heads, value_heads = num("linear_num_key_heads", 16), num("linear_num_value_heads", 32)
        key_dim, value_dim = num("linear_key_head_dim", 128), num("linear_value_head_dim", 128)
        ssm_dtype = mamba_ssm_dtype or str(text.get("mamba_ssm_dtype") or "float32")
        if ssm_dtype not in _DTYPE_BYTES:
            raise ValueError(f"config.json: mamba_ssm_dtype {ssm_dtype!r} is not one of {sorted(_DTYPE_BYTES)}")
        vision = config.get("vision_config")
        # SGLang's VLM memory adjustment reads vision_config.hidden_size; a Qwen3.5 config without the block
        # gets the class default (Qwen3_5VisionConfig: 1152).
        has_vision = "vision_config" in config or config.get("model_type") == "qwen3_5"
        vision_hidden = int(vision.get("hidden_size", 1152)) if isinstance(vision, Mapping) else 1152
        return cls(
            context_length=int(text.get("max_position_embeddings") or config.get("max_position_embeddings") or 32768),
            full_attention_layers=full,
            linear_layers=layers - full,
            kv_heads=num("num_key_value_heads", 2),
            head_dim=num("head_dim", 256),
            kv_dtype_bytes=2,  # --kv-cache-dtype auto: the model's BF16
            conv_dim=value_heads * value_dim + 2 * key_heads * key_dim,
            conv_window=num("linear_conv_kernel_dim", 4) - 1,
            conv_dtype_bytes=2,  # SGLANG_MAMBA_CONV_DTYPE default: bfloat16
            ssm_heads=value_heads,
            ssm_head_dim=value_dim,
            ssm_state_size=key_dim,
            ssm_dtype_bytes=_DTYPE_BYTES[ssm_dtype],
            vision_hidden_size=vision_hidden if has_vision else None,
        )

    @classmethod
    def from_model_dir(cls, path: Path, *, mamba_ssm_dtype: str | None = None) -> ModelShape:
        """`from_config` on `path/config.json`."""
        config = json.loads((path / "config.json").read_text(encoding="utf-8"))
        if not isinstance(config, dict):
            raise ValueError(f"{path / 'config.json'}: not a JSON object")
        return cls.from_config(config, mamba_ssm_dtype=mamba_ssm_dtype)


_HYBRID_GDN_MODEL_TYPES = frozenset({"qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next"})


def is_hybrid_gdn(config: Mapping[str, Any]) -> bool:
    """Whether config.json is a Qwen3.5/3.6/Next hybrid GDN model, the family this sizing models."""
    text = config.get("text_config")
    text_type = text.get("model_type") if isinstance(text, Mapping) else None
    return config.get("model_type") in _HYBRID_GDN_MODEL_TYPES or text_type in _HYBRID_GDN_MODEL_TYPES


def weights_bytes(path: Path) -> int | None:
    """Bytes of the checkpoint's weights: the safetensors index's total_size, else the shards' sizes; None if none."""
    index = path / "model.safetensors.index.json"
    if index.is_file():
        total = json.loads(index.read_text(encoding="utf-8")).get("metadata", {}).get("total_size")
        if isinstance(total, int) and total > 0:
            return total
    shards = sorted(path.glob("*.safetensors"))
    return sum(p.stat().st_size for p in shards) if shards else None


@dataclass(frozen=True)
class GpuMemory:
    """One server's GPU as probed, and what loading the weights takes from it.

    `engine_reserved_bytes`: GPU memory the engine takes before it measures what is free for the model (SGLang
    0.5.17's CUDA IPC pool for multimodal features, `SGLANG_MM_FEATURE_CACHE_MB`, 1 GiB by default: seen on a
    lent H100, issue 37). `vlm_cache_in_pools`: whether the engine charges its multimodal embedding cache
    (`SGLANG_VLM_CACHE_SIZE_MB`) to the pools (0.5.23 does; 0.5.17 does not). `measured_pre_model_load_bytes`:
    the engine's own figure from a server's log (`calibrated_gpu`), which replaces the estimate from the probe.
    """

    total_bytes: int
    free_bytes: int  # before the server starts (the probe's free memory)
    weights_bytes: int
    bandwidth_bytes_per_s: float | None = None  # for the decode roofline; None: not known for this card
    engine_reserved_bytes: int = 0
    vlm_cache_in_pools: bool = True
    measured_pre_model_load_bytes: int | None = None

    @property
    def pre_model_load_bytes(self) -> int:
        """What SGLang measures as free before loading (`pre_model_load_memory`): measured, else estimated."""
        if self.measured_pre_model_load_bytes is not None:
            return self.measured_pre_model_load_bytes
        return self.free_bytes - CUDA_CONTEXT_BYTES - self.engine_reserved_bytes


# The engines the plan knows, by what they take from the pools (`GpuMemory` fields): the project's target 0.5.23,
# and 0.5.17 (the newest release that runs on the lent machines' torch 2.11; issue 37).
SGLANG_MM_FEATURE_CACHE_BYTES = 1024 * _MIB
ENGINE_MEMORY: dict[str, dict[str, Any]] = {
    "0.5.23": {"engine_reserved_bytes": 0, "vlm_cache_in_pools": True},
    "0.5.17": {"engine_reserved_bytes": SGLANG_MM_FEATURE_CACHE_BYTES, "vlm_cache_in_pools": False},
}


def for_engine(gpu: GpuMemory, version: str, *, multimodal: bool = True) -> GpuMemory:
    """`gpu` with what SGLang `version` reserves (ENGINE_MEMORY); a text-only model gets no multimodal pool."""
    if version not in ENGINE_MEMORY:
        raise ValueError(f"no memory profile for SGLang {version!r} (known: {', '.join(sorted(ENGINE_MEMORY))})")
    profile = dict(ENGINE_MEMORY[version])
    if not multimodal:
        profile["engine_reserved_bytes"] = 0
    return replace(gpu, **profile)


# Memory bandwidth of cards we plan for (datasheets), by a substring of the name the driver reports.
_BANDWIDTH = {"RTX PRO 6000": 1.792e12, "H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12}


def card_bandwidth(name: str) -> float | None:
    """Datasheet memory bandwidth (bytes/s) of a card by its reported name; None when not in the table."""
    return next((bw for key, bw in _BANDWIDTH.items() if key in name), None)


# Dense BF16 tensor throughput (FLOP/s, datasheets: RTX PRO 6000 Blackwell 4,000 sparse FP4 TOPS = ~500 dense BF16
# TFLOPS), keyed by the same bandwidth figure `GpuMemory` carries, for the multi-turn prefill estimate.
_PREFILL_FLOPS = {1.792e12: 500e12, 4.8e12: 989e12, 3.35e12: 989e12, 8.0e12: 2250e12}
# Share of peak a long prefill reaches (an estimate; the trade it feeds is decided by a factor of several).
PREFILL_MFU = 0.5


def card_prefill_flops(bandwidth_bytes_per_s: float | None) -> float | None:
    """Dense BF16 FLOP/s of the card whose datasheet bandwidth is given; None when the card is not in the table."""
    return _PREFILL_FLOPS.get(bandwidth_bytes_per_s) if bandwidth_bytes_per_s is not None else None


class _Parser(argparse.ArgumentParser):
    """argparse that raises ValueError instead of exiting: a bad flag value is the engine's to report."""

    def error(self, message: str) -> NoReturn:
        raise ValueError(f"server_args: {message}")


@dataclass(frozen=True)
class EngineFlags:
    """The launch flags that decide pool sizes (SGLang 0.5.23 names, defaults as resolved for this model)."""

    disable_radix_cache: bool = False
    mamba_radix_cache_strategy: str = "auto"
    disable_overlap_schedule: bool = False
    mamba_full_memory_ratio: float = _DEFAULT_MAMBA_FULL_MEMORY_RATIO
    max_mamba_cache_size: int | None = None
    max_running_requests: int | None = None
    mem_fraction_static: float | None = None
    cuda_graph_max_bs_decode: int | None = None
    chunked_prefill_size: int | None = None
    mamba_ssm_dtype: str | None = None
    kv_cache_dtype: str | None = None
    speculative_algorithm: str | None = None

    @classmethod
    def from_args(cls, args: Sequence[str]) -> EngineFlags:
        """The sizing flags among `args` (a run spec's server_args); other flags are ignored."""
        p = _Parser(add_help=False, allow_abbrev=False)
        p.add_argument("--disable-radix-cache", action="store_true")
        p.add_argument("--mamba-radix-cache-strategy", default="auto")
        p.add_argument("--disable-overlap-schedule", action="store_true")
        p.add_argument("--mamba-full-memory-ratio", type=float, default=_DEFAULT_MAMBA_FULL_MEMORY_RATIO)
        p.add_argument("--max-mamba-cache-size", type=int)
        p.add_argument("--max-running-requests", type=int)
        p.add_argument("--mem-fraction-static", type=float)
        p.add_argument("--cuda-graph-max-bs-decode", "--cuda-graph-max-bs", dest="cuda_graph_max_bs_decode", type=int)
        p.add_argument("--chunked-prefill-size", type=int)
        p.add_argument("--mamba-ssm-dtype")
        p.add_argument("--kv-cache-dtype")
        p.add_argument("--speculative-algorithm")
        known, _ = p.parse_known_args(list(args))
        return cls(**vars(known))

    def to_args(self) -> list[str]:
        """The flags that differ from SGLang's defaults, as launch arguments."""
        out: list[str] = []
        if self.disable_radix_cache:
            out.append("--disable-radix-cache")
        if self.mamba_full_memory_ratio != _DEFAULT_MAMBA_FULL_MEMORY_RATIO:
            out += ["--mamba-full-memory-ratio", f"{self.mamba_full_memory_ratio:g}"]
        for flag, value in (
            ("--max-mamba-cache-size", self.max_mamba_cache_size),
            ("--max-running-requests", self.max_running_requests),
            ("--mem-fraction-static", self.mem_fraction_static),
            ("--cuda-graph-max-bs-decode", self.cuda_graph_max_bs_decode),
        ):
            if value is not None:
                out += [flag, f"{value:g}" if isinstance(value, float) else str(value)]
        return out

    @property
    def slots_per_request(self) -> int:
        """`_calculate_mamba_ratio`: 1 without the radix cache; else 3, plus 2 (extra_buffer, overlap) or 1."""
        if self.disable_radix_cache:
            return 1
        strategy = self.mamba_radix_cache_strategy
        if strategy == "auto":
            # overrides.py _mamba_radix_cache_resolution (page size 1): extra_buffer with overlap, else no_buffer.
            strategy = "no_buffer" if self.disable_overlap_schedule else "extra_buffer"
        if strategy == "no_buffer":
            return _MAMBA_BASE_SLOTS
        lazy = strategy == "extra_buffer_lazy"
        return _MAMBA_BASE_SLOTS + (1 if lazy or self.disable_overlap_schedule else 2)


def _graph_defaults(gpu_mib: float) -> tuple[int, int]:
    """(chunked_prefill_size, decode CUDA-graph max bs) by card memory, tp 1 (`handle_gpu_memory_settings`)."""
    if gpu_mib < 20 * 1024:
        return 2048, 8
    if gpu_mib < 35 * 1024:
        return 4096, 48
    if gpu_mib < 60 * 1024:
        return 4096, 32
    if gpu_mib < 160 * 1024:
        return 8192, 256
    return 16384, 512


def _prefill_graph_sizes(max_bs: int) -> int:
    """How many prefill CUDA-graph sizes are captured (`generate_prefill_cuda_graph_batch_sizes`)."""
    sizes = [
        *range(4, 33, 4),
        *range(48, 257, 16),
        *range(288, 513, 32),
        *range(576, 1025, 64),
        *range(1280, 4097, 256),
        *range(4608, max_bs + 1, 512),
    ]
    return sum(1 for s in sizes if s <= max_bs)


def decode_graph_max_bs(flags: EngineFlags, gpu_total_bytes: int) -> int:
    """The largest decode batch SGLang captures: the flag, else the card default, lowered to max_running_requests."""
    if flags.cuda_graph_max_bs_decode is not None:
        return flags.cuda_graph_max_bs_decode
    _, default = _graph_defaults(gpu_total_bytes / _MIB)
    if flags.max_running_requests is not None and default > flags.max_running_requests:
        return flags.max_running_requests
    return default


def sglang_mem_fraction_static(model: ModelShape, flags: EngineFlags, gpu_total_bytes: int) -> float:
    """SGLang's own --mem-fraction-static for these flags when none is given (`handle_gpu_memory_settings`).

    The reserve it keeps outside the pools: 512 MiB + 1.5 MiB per token of a prefill chunk + 2 MiB per decode
    CUDA-graph batch size + 8 MiB per prefill graph size, at least 10 GiB on cards over 60 GiB; then 0.95x,
    scaled by the vision tower's size, for a multimodal model.
    """
    if flags.mem_fraction_static is not None:
        return flags.mem_fraction_static
    gpu_mib = gpu_total_bytes / _MIB
    chunk_default, _ = _graph_defaults(gpu_mib)
    chunk = flags.chunked_prefill_size if flags.chunked_prefill_size is not None else chunk_default
    reserved = 512 + max(chunk, 2048) * 1.5 + 1 / 8 * 1024
    reserved += decode_graph_max_bs(flags, gpu_total_bytes) * 2 + _prefill_graph_sizes(chunk) * 8
    if gpu_mib > 60 * 1024:
        reserved = max(reserved, 10 * 1024)
    fraction = round((gpu_mib - reserved) / gpu_mib, 3)
    if model.vision_hidden_size is not None:
        # adjust_mem_fraction_for_vlm: ViT size relative to ViT-L (24 x 1024^2); Qwen3.5's vision config has no
        # num_hidden_layers, so SGLang takes its default of 24 layers.
        ratio = (24 * model.vision_hidden_size**2) / (24 * 1024**2)
        fraction *= 0.95 * max(0.8, min(1.05, 1.0 - 0.1 * (ratio - 1.0)))
    return fraction


@dataclass(frozen=True)
class Sizing:
    """What SGLang 0.5.23 allocates for one server: the state pool, the KV pool and the running-request cap."""

    mem_fraction_static: float
    max_mamba_cache_size: int
    slots_per_request: int
    max_total_num_tokens: int
    max_running_requests: int
    capped_by_state_pool: bool

    def concurrency(self, context_tokens: int) -> int:
        """Requests of `context_tokens` each that run at once: the cap, or fewer when the KV pool is the limit."""
        return max(0, min(self.max_running_requests, self.max_total_num_tokens // max(1, context_tokens)))


class UnstartableError(ValueError):
    """Flags SGLang cannot start a server with on this GPU: no memory is left for the KV cache."""


def _no_kv_reason(
    model: ModelShape, gpu: GpuMemory, flags: EngineFlags, fraction: float, slots: int, rest_gib: float
) -> str:
    """Why these flags leave no KV cache, what would start, and what SGLang itself would say (issue 45).

    SGLang 0.5.23 (`_profile_available_bytes`) subtracts the state pool, finds nothing left and asks for a
    fraction above 1 - free after the weights / free before them: the weights' share alone, lower than the
    fraction given when the state pool is what does not fit.
    """
    pre = gpu.pre_model_load_bytes
    state = (slots + 1) * model.state_bytes_per_slot
    short = -rest_gib * _GIB
    if flags.max_mamba_cache_size is not None:
        cause, knob = f"--max-mamba-cache-size {slots}", "--max-mamba-cache-size"
    else:
        cause, knob = (
            f"--max-running-requests {slots} with --disable-radix-cache (one slot a request)",
            ("--max-running-requests"),
        )
    fits = max(0, slots - math.ceil((short + model.kv_bytes_per_token) / model.state_bytes_per_slot))
    least = math.ceil((fraction + (short + model.kv_bytes_per_token) / pre) * 1000) / 1000
    sglang_asks = math.ceil(gpu.weights_bytes / pre * 1000) / 1000
    remedy = f"lower {knob} to at most {fits}" if fits > 0 else f"no {knob} fits"
    remedy += (
        f" or raise --mem-fraction-static to at least {least:g}"
        if least < 1
        else f"; no --mem-fraction-static below 1 holds {slots} slots"
    )
    return (
        f"this GPU cannot start these flags: {cause} sizes the state pool to {slots} slots "
        f"({state / _GIB:.1f} GiB); with the weights ({gpu.weights_bytes / _GIB:.1f} GiB) that is "
        f"{short / _GIB:.2f} GiB more than --mem-fraction-static {fraction:g} of the {pre / _GIB:.2f} GiB free "
        f"before the weights ({fraction * pre / _GIB:.2f} GiB), so no KV cache is left. {remedy[0].upper()}"
        f"{remedy[1:]}. (SGLang 0.5.23 stops at start with 'Loaded weights leave no GPU memory for the KV cache "
        f"under --mem-fraction-static={fraction:g}. Raise --mem-fraction-static above {sglang_asks:.3f}': the "
        "weights' share alone, below the fraction given, because the state pool is what does not fit.)"
    )


def sglang_sizing(model: ModelShape, gpu: GpuMemory, flags: EngineFlags) -> Sizing:
    """SGLang 0.5.23's pool sizes and running-request cap for one hybrid-GDN server (tp 1, page 1, no spec)."""
    if flags.speculative_algorithm:
        raise ValueError("sizing with speculative decoding is not modelled (its state reserve differs)")
    fraction = sglang_mem_fraction_static(model, flags, gpu.total_bytes)
    pre_gib = gpu.pre_model_load_bytes / _GIB
    available_gib = (gpu.pre_model_load_bytes - gpu.weights_bytes) / _GIB
    rest = available_gib - pre_gib * (1 - fraction)
    if model.vision_hidden_size is not None and gpu.vlm_cache_in_pools:
        rest -= _VLM_CACHE_BYTES / _MIB / 1024
    per_slot = model.state_bytes_per_slot
    ratio = flags.slots_per_request
    if flags.max_mamba_cache_size is not None:
        slots = flags.max_mamba_cache_size
    elif flags.disable_radix_cache and flags.max_running_requests is not None:
        slots = max(1, flags.max_running_requests)
    else:
        r = flags.mamba_full_memory_ratio
        budget = rest * r / (1 + r) * _GIB
        slots = int((budget - per_slot) // per_slot)
    if slots <= 0:
        raise ValueError(f"no memory left for the state pool (max_mamba_cache_size={slots})")
    rest -= (slots + 1) * per_slot / _GIB  # +1: each pool's padding slot
    if rest <= 0:
        raise UnstartableError(_no_kv_reason(model, gpu, flags, fraction, slots, rest))
    tokens = int(rest * _GIB) // model.kv_bytes_per_token
    if tokens <= 0:
        raise ValueError("no KV cache tokens fit")
    if flags.max_running_requests is not None:
        cap = min(max(1, flags.max_running_requests), tokens // 2)
    else:
        estimated = max(min(int(tokens / model.context_length * 512), 4096), 2048)
        cap = min(estimated, tokens // 2)
    state_cap = slots // ratio
    return Sizing(
        mem_fraction_static=fraction,
        max_mamba_cache_size=slots,
        slots_per_request=ratio,
        max_total_num_tokens=tokens,
        max_running_requests=min(cap, state_cap),
        capped_by_state_pool=state_cap < cap,
    )


# --- what the engine says it allocated (its log), and the plan recalibrated from it -------------------------

_GB = re.compile(r"([0-9]+(?:\.[0-9]+)?) GB")
_LOGGED = {
    "pre_load": re.compile(r"Load weight begin\. avail mem=([0-9.]+) GB"),
    "post_load": re.compile(r"Load weight end\..*?avail mem=([0-9.]+) GB"),
    "fraction": re.compile(r"mem_fraction_static'?[=:] ?([0-9.]+)"),
    "tokens": re.compile(r"max_total_num_tokens=(\d+)"),
    "running": re.compile(r"max_total_num_tokens=\d+.*?max_running_requests=(\d+)"),
    "slots": re.compile(r"max_mamba_cache_size: (\d+)"),
}


@dataclass(frozen=True)
class LoggedPools:
    """The pools one SGLang server sized, as its startup log prints them (0.5.17 and 0.5.23 write the same lines).

    `pre_model_load_bytes` / `post_model_load_bytes`: free GPU memory before and after the weights ("Load weight
    begin/end ... avail mem=X GB", GiB to two decimals, so +-5 MiB); `mem_fraction_static` from the
    `server_args` line; `max_mamba_cache_size` (state slots, None for a model without state) from "Mamba Cache is
    allocated"; `max_total_num_tokens` and `max_running_requests` from the scheduler's summary line.
    """

    pre_model_load_bytes: int
    post_model_load_bytes: int
    mem_fraction_static: float
    max_total_num_tokens: int
    max_running_requests: int
    max_mamba_cache_size: int | None

    ROUNDING_BYTES: ClassVar[int] = 5 * _MIB  # "%.2f GB" of GiB

    @classmethod
    def parse(cls, text: str) -> LoggedPools | None:
        """The pools of the last server start in `text` (a log); None until the scheduler's summary line is there."""
        found: dict[str, str] = {}
        for key, pattern in _LOGGED.items():
            matches = pattern.findall(text)
            if matches:
                found[key] = matches[-1]
        if not {"pre_load", "post_load", "fraction", "tokens", "running"} <= found.keys():
            return None
        return cls(
            pre_model_load_bytes=round(float(found["pre_load"]) * _GIB),
            post_model_load_bytes=round(float(found["post_load"]) * _GIB),
            mem_fraction_static=float(found["fraction"]),
            max_total_num_tokens=int(found["tokens"]),
            max_running_requests=int(found["running"]),
            max_mamba_cache_size=int(found["slots"]) if "slots" in found else None,
        )

    def describe(self) -> str:
        """The figures in one line, as the engine gave them."""
        slots = f"{self.max_mamba_cache_size} state slots, " if self.max_mamba_cache_size is not None else ""
        return (
            f"{slots}{self.max_total_num_tokens:,} KV tokens, {self.max_running_requests} running requests at most "
            f"(mem_fraction_static {self.mem_fraction_static:g}; {self.pre_model_load_bytes / _GIB:.2f} GiB free "
            f"before the weights, {self.post_model_load_bytes / _GIB:.2f} GiB after)"
        )


def calibrated_gpu(model: ModelShape, gpu: GpuMemory, flags: EngineFlags, logged: LoggedPools) -> GpuMemory:
    """`gpu` with the engine's own memory figures, from the log of a server launched with `flags`.

    The pools come from the free memory SGLang profiles after the weights (A) and its memory before them (P):
    KV = A - P (1 - fraction) - state pool - [VLM cache]. P is logged ("Load weight begin"); A is solved from
    the logged KV pool and state slots (the "Load weight end" figure is A before the last small allocations), so
    sizing these flags again gives exactly the logged pools, and other flags are sized from the same memory.
    Weights become P - A: everything resident before the pools.
    """
    pre = logged.pre_model_load_bytes
    slots = logged.max_mamba_cache_size
    state = (slots + 1) * model.state_bytes_per_slot if slots is not None else 0
    vlm = _VLM_CACHE_BYTES if model.vision_hidden_size is not None and gpu.vlm_cache_in_pools else 0
    # Half a KV token above the floor: the middle of the interval that int() maps to the logged count.
    kv = logged.max_total_num_tokens * model.kv_bytes_per_token + model.kv_bytes_per_token // 2
    available = kv + state + vlm + pre * (1 - logged.mem_fraction_static)
    weights = pre - round(available)
    return replace(gpu, measured_pre_model_load_bytes=pre, weights_bytes=weights)


def pool_shortfall(expected: Sizing, logged: LoggedPools, tolerance: float = 0.02) -> str | None:
    """Why the engine's pools fall short of the plan's prediction (KV tokens or running requests), or None."""
    short: list[str] = []
    if logged.max_total_num_tokens < expected.max_total_num_tokens * (1 - tolerance):
        short.append(
            f"KV pool {logged.max_total_num_tokens:,} tokens where the plan predicted {expected.max_total_num_tokens:,}"
        )
    if logged.max_running_requests < expected.max_running_requests:
        short.append(
            f"{logged.max_running_requests} running requests at most where the plan predicted "
            f"{expected.max_running_requests}"
        )
    return "; ".join(short) if short else None


@dataclass(frozen=True)
class Candidate:
    """One way to launch: its flags, SGLang's sizing for them, and how many requests of the run fit at once."""

    name: str
    flags: EngineFlags
    sizing: Sizing
    concurrency: int
    note: str = ""


@dataclass(frozen=True)
class PrefixReuse:
    """Multi-turn regeneration: each turn's prompt extends the previous turn's history."""

    history_tokens: int  # mean history a turn's prompt holds (its conversation's earlier turns)
    new_tokens: int  # mean tokens a turn's prompt adds to its history: prefilled with the radix cache or without
    output_tokens: int  # mean tokens generated per turn
    prefill_tokens_per_s: float  # prefill rate of one GPU (measured by the pilot, or an estimate)
    decode_steps_per_s: float  # decode steps per second at the planned batch (roofline or measured)
    cached_share: float  # share of the history the radix cache still holds at the next turn (evictions: < 1)

    def gpu_seconds(self, running: int, *, radix: bool) -> float:
        """GPU time per request at `running` requests at once: its share of decode steps, plus its prefill.

        Both sides prefill the new tokens; without the radix cache the whole history too, with it the share the
        cache lost. Prefill stalls the batch, so it is charged in full.
        """
        missed = 1.0 - self.cached_share if radix else 1.0
        prefill = (self.new_tokens + missed * self.history_tokens) / self.prefill_tokens_per_s
        return self.output_tokens / (running * self.decode_steps_per_s) + prefill


Turns = Literal["every", "last"]


@dataclass(frozen=True)
class PromptTokens:
    """The run's prompt lengths in tokens as planning rendered them (the render cache), or an assumption."""

    n: int  # prompts measured (0: assumed, nothing rendered yet)
    mean: float
    p99: int
    max: int
    source: str

    PERCENTILE: ClassVar[float] = 0.99

    @classmethod
    def measured(cls, lengths: Sequence[int], source: str) -> PromptTokens:
        """Mean, 99th percentile (the next value up, as Arrow's quantile "higher") and longest of `lengths`."""
        if not lengths:
            raise ValueError("no prompt lengths to measure")
        ordered = sorted(lengths)
        p99 = ordered[math.ceil(cls.PERCENTILE * (len(ordered) - 1))]
        return cls(len(ordered), sum(ordered) / len(ordered), p99, ordered[-1], source)

    def describe(self) -> str:
        """How many prompts, mean / p99 / max tokens, and where the figures came from."""
        if self.n == 0:
            return f"prompt {self.mean:,.0f} tokens ({self.source})"
        return (
            f"prompt mean {self.mean:,.0f} / p99 {self.p99:,} / max {self.max:,} tokens over {self.n:,} prompts "
            f"({self.source})"
        )


def prefix_reuse_for_turns(
    model: ModelShape,
    gpu: GpuMemory,
    last_turn_context: int,
    turns_per_conversation: float,
    output_tokens: float,
    batch: int,
    radix: Candidate,
    conversations_open: int | None = None,
) -> PrefixReuse | str:
    """The multi-turn trade's inputs for a run that generates every turn, or why they cannot be estimated.

    `last_turn_context`: the tokens a conversation's last turn holds at its end (the plan's `context_tokens`, the
    longest). Each of T turns adds s = last/T tokens (its new prompt tokens, then its output o), so turn k's prompt
    is (k-1) s of history plus s - o new tokens: the history averages s (T-1)/2 (the first turn has none).
    `cached_share`: each conversation in rotation (`conversations_open`; default the radix candidate's running
    requests + QUEUED_PER_SERVER, what datagen's dispatcher holds at a server) keeps its state in the pool between
    turns, and a running request holds all but one of its slots (SGLang 0.5.17's log: 4 of 5), so the spare slots
    hold that share, capped at 1; the others are evicted and re-prefilled. Prefill runs at PREFILL_MFU of the
    card's dense BF16 peak over 2 FLOPs per parameter per token (parameters = BF16 weight bytes / 2); a decode
    step takes the roofline's time at `batch`, the count the radix cache off would run (`decode_roofline`).
    """
    flops = card_prefill_flops(gpu.bandwidth_bytes_per_s)
    if flops is None or gpu.bandwidth_bytes_per_s is None:
        return "the card's bandwidth and compute are not in the table: no estimate of the multi-turn trade"
    t = max(1.0, turns_per_conversation)
    per_turn = last_turn_context / t
    output = max(1, round(output_tokens))
    prefill = PREFILL_MFU * flops / (2 * gpu.weights_bytes / 2)
    batch = max(1, batch)
    per_request = 2 * model.state_bytes_per_slot + model.kv_bytes_per_token * last_turn_context
    steps = gpu.bandwidth_bytes_per_s / (gpu.weights_bytes + batch * per_request)
    in_use = radix.concurrency * (radix.sizing.slots_per_request - 1)
    spare = max(0, radix.sizing.max_mamba_cache_size - in_use)
    rotation = conversations_open if conversations_open is not None else radix.concurrency + QUEUED_PER_SERVER
    return PrefixReuse(
        history_tokens=round(per_turn * (t - 1) / 2),
        new_tokens=max(0, round(per_turn - output)),
        output_tokens=output,
        prefill_tokens_per_s=prefill,
        decode_steps_per_s=steps,
        cached_share=min(1.0, spare / max(1, rotation)),
    )


def choose_prefix_reuse(reuse: PrefixReuse, with_radix: int, without_radix: int) -> tuple[bool, str]:
    """Keep the radix cache for a multi-turn run? Weighs re-prefilling each history against fewer running requests.

    Per request (`PrefixReuse.gpu_seconds`): its share of the decode steps at each side's running count, plus the
    prefill of its new tokens, and of the history without the cache (or the share the cache lost). The cheaper
    side wins.
    """
    if with_radix <= 0 or without_radix <= 0:
        raise ValueError("both strategies must run at least one request")
    with_s = reuse.gpu_seconds(with_radix, radix=True)
    without_s = reuse.gpu_seconds(without_radix, radix=False)
    why = (
        f"per request: {with_s * 1e3:.1f} ms of GPU time with the radix cache ({with_radix} running, "
        f"{reuse.cached_share:.0%} of {reuse.history_tokens} history tokens cached) vs {without_s * 1e3:.1f} ms "
        f"without ({without_radix} running, the history re-prefilled); {reuse.new_tokens} new tokens either way, "
        f"prefill at {reuse.prefill_tokens_per_s:,.0f} tok/s"
    )
    return with_s < without_s, why


def decode_roofline(model: ModelShape, gpu: GpuMemory, batch: int, context_tokens: int) -> float | None:
    """Output tokens/s of one GPU at `batch` running requests, if decode were purely memory-bound.

    One decode step reads every weight once, and per request its recurrent state (read and written) and its KV
    cache, taken at the full context (a request holds less early in its life, so this bound is a little low).
    """
    if gpu.bandwidth_bytes_per_s is None or batch <= 0:
        return None
    per_request = 2 * model.state_bytes_per_slot + model.kv_bytes_per_token * context_tokens
    step_bytes = gpu.weights_bytes + batch * per_request
    return batch * gpu.bandwidth_bytes_per_s / step_bytes


def _best_balanced(
    model: ModelShape, gpu: GpuMemory, base: EngineFlags, context: int, *, radix: bool
) -> tuple[EngineFlags, Sizing]:
    """The explicit state-pool size that makes state slots and KV tokens run out together at `context`."""
    ratio = base.slots_per_request if radix else 1
    fraction_probe = replace(base, disable_radix_cache=not radix, max_running_requests=1, max_mamba_cache_size=None)
    # Memory for both pools: what one slot plus its padding leaves, plus that slot back.
    one = sglang_sizing(model, gpu, fraction_probe if not radix else replace(fraction_probe, max_mamba_cache_size=1))
    pool_bytes = one.max_total_num_tokens * model.kv_bytes_per_token + model.state_bytes_per_slot
    per_request = ratio * model.state_bytes_per_slot + context * model.kv_bytes_per_token
    guess = max(1, pool_bytes // per_request)
    best: tuple[int, EngineFlags, Sizing] | None = None
    # The cap moves the CUDA-graph reserve (and so the pools) a little: try the neighbours of the estimate.
    for n in range(max(1, guess - 4), guess + 5):
        if radix:
            flags = replace(base, disable_radix_cache=False, max_mamba_cache_size=n * ratio, max_running_requests=n)
        else:
            flags = replace(base, disable_radix_cache=True, max_running_requests=n, max_mamba_cache_size=None)
        try:
            sizing = sglang_sizing(model, gpu, flags)
        except ValueError:
            continue
        fit = sizing.concurrency(context)
        if best is None or fit > best[0]:
            best = (fit, flags, sizing)
    if best is None:
        raise ValueError("no balanced state pool fits this GPU")
    return best[1], best[2]


@dataclass
class MemoryPlan:
    """The chosen launch flags, every candidate SGLang's sizing was asked about, and why."""

    context_tokens: int
    context_source: str
    candidates: list[Candidate]
    chosen: str
    plan_args: list[str]  # what the launcher adds (explicit server_args removed)
    overridden: list[str] = field(default_factory=list)  # planned flags the run spec sets itself
    numerics: list[str] = field(default_factory=list)  # output-changing flags the run spec chose
    launched: Sizing | None = None  # SGLang's sizing for what is actually launched
    reasons: list[str] = field(default_factory=list)
    roofline_tokens_per_s: float | None = None
    candidate_args: dict[str, list[str]] = field(default_factory=dict)  # each candidate's flags as launched
    kept_by_trial: str | None = None  # why, when a pilot's side-by-side trial chose the candidate
    # The plan's --mem-fraction-static and its evidence: value, source (measured-headroom, sglang-default,
    # server_args), why; with a measured headroom its need in bytes and each term.
    fraction: dict[str, Any] = field(default_factory=dict)
    # The radix cache as launched, and why: kept (prefix reuse across a conversation's steps) or off (state slots).
    radix_cache: dict[str, Any] = field(default_factory=dict)
    # What the plan was computed from, so it can be computed again from the engine's own memory (`recalibrated`).
    model: ModelShape | None = None
    gpu: GpuMemory | None = None
    inputs: dict[str, Any] = field(default_factory=dict)

    def recalibrated(self, logged: LoggedPools, launched_args: Sequence[str]) -> MemoryPlan:
        """This plan again, from the memory a server launched with `launched_args` logged (`calibrated_gpu`).

        The new plan's predictions for any flags then use what the engine really had, so the pools it chooses
        are the ones the engine will allocate.
        """
        if self.model is None or self.gpu is None:
            raise ValueError("this plan does not record the model and GPU it was computed from")
        gpu = calibrated_gpu(self.model, self.gpu, EngineFlags.from_args(launched_args), logged)
        plan = plan_memory(self.model, gpu, self.context_tokens, context_source=self.context_source, **self.inputs)
        plan.reasons.append(f"recalibrated from the engine's log: {logged.describe()}")
        return plan

    def args_for(self, candidate: Candidate) -> list[str]:
        """The flags the launcher would add to run `candidate` (the spec's explicit flags left out)."""
        return list(self.candidate_args.get(candidate.name, candidate.flags.to_args()))

    def candidate(self, name: str) -> Candidate:
        """The candidate called `name`."""
        return next(c for c in self.candidates if c.name == name)

    @property
    def default(self) -> Candidate:
        """SGLang's defaults (with the spec's explicit flags)."""
        return self.candidate("defaults")

    @property
    def planned(self) -> Candidate:
        """The candidate the plan chose."""
        return self.candidate(self.chosen)

    def summary(self) -> str:
        """One line for the environment report and `datagen check`."""
        launched = self.launched or self.planned.sizing
        fit = launched.concurrency(self.context_tokens)
        line = (
            f"{fit} running requests per GPU at {self.context_tokens:,} tokens of context ({self.context_source}); "
            f"SGLang defaults: {self.default.concurrency}; plan '{self.chosen}': {' '.join(self.plan_args) or '-'}"
        )
        if self.fraction:
            line += f"; --mem-fraction-static {self.fraction['value']:g} ({self.fraction['source']})"
        if self.overridden:
            line += f"; run spec's server_args win for {', '.join(self.overridden)}"
        if self.numerics:
            line += f"; numerics chosen by the run spec: {' '.join(self.numerics)}"
        return line

    def lineage(self) -> dict[str, Any]:
        """The plan as plain JSON for the lineage manifest and the dataset card."""
        launched = self.launched or self.planned.sizing
        return {
            "context_tokens": self.context_tokens,
            "context_source": self.context_source,
            "chosen": self.chosen,
            "plan_args": self.plan_args,
            "overridden_by_server_args": self.overridden,
            "numerics_flags": self.numerics,
            "running_requests_per_gpu": launched.concurrency(self.context_tokens),
            "default_running_requests_per_gpu": self.default.concurrency,
            "sizing": asdict(launched),
            "candidates": {c.name: {"args": c.flags.to_args(), "running": c.concurrency} for c in self.candidates},
            "reasons": self.reasons,
            "kept_by_trial": self.kept_by_trial,
            "radix_cache": self.radix_cache,
            "mem_fraction_static": self.fraction,
        }


def _given(args: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in args)


def numerics_flags(server_args: Sequence[str]) -> list[str]:
    """The output-changing flags among `server_args`, with their values (for the lineage and the card)."""
    out: list[str] = []
    for i, a in enumerate(server_args):
        name = a.split("=", 1)[0]
        if name in NUMERICS_FLAGS or name.startswith("--speculative-"):
            has_value = "=" not in a and i + 1 < len(server_args) and not server_args[i + 1].startswith("--")
            out += [a, server_args[i + 1]] if has_value else [a]
    return out


def plan_memory(
    model: ModelShape,
    gpu: GpuMemory,
    context_tokens: int,
    *,
    context_source: str,
    server_args: Sequence[str] = (),
    prefix_reuse: PrefixReuse | None = None,
    turns: Turns = "last",
    turns_per_conversation: float = 1.0,
    turns_source: str = "",
    output_tokens: float | None = None,
    conversations_open: int | None = None,
    longest_request_tokens: int | None = None,
    prefer: str | None = None,
    prefer_why: str = "",
    headroom: Headroom | None = None,
) -> MemoryPlan:
    """Choose the launch flags that run the most requests of `context_tokens` at once on one GPU.

    Candidates: SGLang's defaults; the radix cache off with the default 0.9 split; the radix cache off with the
    state pool sized to exactly the requests that also fit in the KV pool (`--max-running-requests` with
    `--disable-radix-cache` makes SGLang size the state pool to it and give the rest to KV); and the radix cache
    on with the pools balanced the same way. Explicit server_args win: they are kept in every candidate and the
    plan never repeats them.

    `turns`: "last" (each request is one turn, no prefix is shared: radix cache off) or "every" (turn k+1
    extends turn k: with `turns_per_conversation` > 1 the plan weighs the radix cache's prefix reuse against
    its extra state slots, `prefix_reuse_for_turns`; `prefix_reuse` gives the trade's inputs directly).
    `turns_source`: where `turns_per_conversation` came from (the pilot's measured steps, or the recording), for
    the reasons and `radix_cache`.
    `context_tokens` is what a request holds at its end; in an every-turn run, the conversation's last turn (its
    longest), from which the trade derives the mean history. `output_tokens`: mean output per request (default:
    half the context). `conversations_open`: conversations in rotation per server in an every-turn run (default:
    running + QUEUED_PER_SERVER, as datagen's dispatcher holds them). `longest_request_tokens`: the longest
    prompt plus max_new_tokens; a candidate whose KV pool cannot hold it alone is never chosen.
    `prefer`: a candidate the pilot's side-by-side trial kept (`datagen.engine.plan_trial`); it wins, and
    `prefer_why` is recorded.
    `headroom`: what the engine measurably needs outside its pools (`datagen.engine.headroom`); the plan's own
    candidates then take the largest --mem-fraction-static that leaves it. Without one they keep SGLang's own
    fraction for the defaults, rounded down. Either way `MemoryPlan.fraction` says which and why.
    """
    if context_tokens <= 0:
        raise ValueError(f"context_tokens must be positive, got {context_tokens}")
    prefix_reuse_given = prefix_reuse is not None
    base = EngineFlags.from_args(server_args)
    if base.speculative_algorithm:
        raise ValueError("no memory plan with speculative decoding (set --max-running-requests yourself)")
    if base.mamba_ssm_dtype:
        if base.mamba_ssm_dtype not in _DTYPE_BYTES:
            raise ValueError(
                f"server_args: --mamba-ssm-dtype {base.mamba_ssm_dtype!r} is not one of {sorted(_DTYPE_BYTES)}"
            )
        model = replace(model, ssm_dtype_bytes=_DTYPE_BYTES[base.mamba_ssm_dtype])
    # The plan's own choices start from SGLang's defaults for the flags it may set.
    free = replace(
        base,
        disable_radix_cache=False,
        mamba_full_memory_ratio=_DEFAULT_MAMBA_FULL_MEMORY_RATIO,
        max_mamba_cache_size=None,
        max_running_requests=None,
        cuda_graph_max_bs_decode=base.cuda_graph_max_bs_decode,
    )

    candidates = [
        _candidate(model, gpu, context_tokens, "defaults", free, "SGLang 0.5.23 defaults: radix cache on, pools 0.9:1")
    ]
    default_fraction = candidates[0].sizing.mem_fraction_static
    fractions = {
        "defaults": {
            "value": default_fraction,
            "source": "sglang-default",
            "why": "SGLang's own fraction for its defaults (its generic reserve: 1.5 MiB per prefill-chunk token, "
            "CUDA graphs, a 10 GiB floor, 0.95x for a vision tower)",
        }
    }
    if base.mem_fraction_static is not None:
        own = _own_candidates(model, gpu, free, context_tokens)
        given = {"value": base.mem_fraction_static, "source": "server_args", "why": "the run spec's server_args"}
        fractions = {name: dict(given) for name in ("defaults", *_OWN)}
    elif headroom is None:
        # Pinned at the defaults' value, rounded down: SGLang's generic reserve is the margin, unmeasured here.
        pinned = math.floor(default_fraction * 1000) / 1000
        own = _own_candidates(model, gpu, replace(free, mem_fraction_static=pinned), context_tokens)
        why = f"SGLang's own fraction for its defaults ({default_fraction:g}), rounded down: no measured headroom"
        fractions |= {name: {"value": pinned, "source": "sglang-default", "why": why} for name in _OWN}
    else:
        own, measured = _measured_fraction(model, gpu, free, context_tokens, headroom, default_fraction)
        fractions |= measured
    candidates += own
    reasons = [
        f"state slot {model.state_bytes_per_slot / _MIB:.1f} MiB ({model.linear_layers} GDN layers), "
        f"KV {model.kv_bytes_per_token / 1024:.0f} KiB/token ({model.full_attention_layers} attention layers), "
        f"weights {gpu.weights_bytes / _GIB:.1f} GiB of {gpu.total_bytes / _GIB:.1f} GiB",
    ]
    eligible = candidates
    if longest_request_tokens is not None:
        eligible = [c for c in candidates if c.sizing.max_total_num_tokens >= longest_request_tokens]
        left_out = [c.name for c in candidates if c not in eligible]
        if not eligible:  # nothing holds the longest request alone: the largest KV pool rejects the fewest
            eligible = [max(candidates, key=lambda c: c.sizing.max_total_num_tokens)]
            reasons.append(
                f"no candidate's KV pool holds the longest request ({longest_request_tokens:,} tokens: longest "
                f"prompt + max_new_tokens); '{eligible[0].name}' has the largest "
                f"({eligible[0].sizing.max_total_num_tokens:,})"
            )
        elif left_out:
            reasons.append(
                f"{', '.join(left_out)}: KV pool too small for the longest request ({longest_request_tokens:,} "
                "tokens: longest prompt + max_new_tokens), not chosen"
            )
    radix_off = [c for c in eligible if c.flags.disable_radix_cache]
    radix_on = [c for c in eligible if not c.flags.disable_radix_cache]
    best_no_radix = max(radix_off or eligible, key=lambda c: c.concurrency)
    best_radix = max(radix_on, key=lambda c: c.concurrency) if radix_on else None
    if prefix_reuse is None and turns == "every" and turns_per_conversation > 1 and best_radix is not None:
        estimate = prefix_reuse_for_turns(
            model,
            gpu,
            context_tokens,
            turns_per_conversation,
            output_tokens if output_tokens is not None else context_tokens / 2,
            best_no_radix.concurrency,
            best_radix,
            conversations_open,
        )
        if isinstance(estimate, str):
            reasons.append(f"turns extend a prefix, but {estimate}: radix cache off")
        else:
            prefix_reuse = estimate
    counted = f"{turns_per_conversation:g} turns per conversation" + (f" ({turns_source})" if turns_source else "")
    radix_why = ""
    if prefix_reuse is None or best_radix is None:
        chosen = best_no_radix
        if turns == "last" or turns_per_conversation <= 1:
            why = "turns: last" if turns == "last" else "one turn per conversation"
            why += f", {turns_source}" if turns_source and turns != "last" else ""
            radix_why = f"single-turn requests ({why}): no prompt shares a prefix, so the radix cache only costs slots"
            reasons.append(radix_why)
        elif reasons[-1].startswith("turns extend a prefix, but"):
            radix_why = reasons[-1]
        else:  # no radix-on candidate is eligible (the longest request)
            radix_why = (
                f"turns extend a prefix ({counted}), but no candidate with the radix cache fits: radix cache off"
            )
    else:
        keep, why = choose_prefix_reuse(prefix_reuse, best_radix.concurrency, best_no_radix.concurrency)
        chosen = best_radix if keep else best_no_radix
        reasons.append(
            f"turns extend a prefix ({counted}; " if turns_per_conversation > 1 else "turns extend a prefix ("
        )
        reasons[-1] += (
            f"{best_radix.sizing.slots_per_request} state slots per request with the radix cache, 1 without); "
            f"{'keep' if keep else 'drop'} the radix cache: {why}"
        )
        radix_why = reasons[-1]
    if prefer is not None:
        kept = next((c for c in candidates if c.name == prefer), None)
        if kept is None:
            raise ValueError(f"the pilot's trial kept {prefer!r}, not a candidate of this plan")
        chosen = kept
        reasons.append(f"kept by the pilot's side-by-side trial: {prefer_why or prefer}")
    fraction = fractions[chosen.name]
    reasons.append(f"--mem-fraction-static {fraction['value']:g} ({fraction['source']}): {fraction['why']}")
    chosen_flags, plan_args, overridden = _launch_args(chosen, gpu, server_args)
    reasons.append(
        f"'{chosen.name}' runs {chosen.concurrency} requests of {context_tokens:,} tokens at once "
        f"(defaults: {candidates[0].concurrency}); CUDA graphs cover decode batches up to "
        f"{decode_graph_max_bs(chosen_flags, gpu.total_bytes)}"
    )
    launched_flags = EngineFlags.from_args([*plan_args, *server_args])
    if prefer is not None:
        radix_why = f"{radix_why}; kept by the pilot's side-by-side trial: '{prefer}'".lstrip("; ")
    if base.disable_radix_cache and not radix_why:
        radix_why = "off: the run spec's server_args say --disable-radix-cache"
    plan = MemoryPlan(
        context_tokens=context_tokens,
        context_source=context_source,
        candidates=candidates,
        chosen=chosen.name,
        plan_args=plan_args,
        overridden=overridden,
        numerics=numerics_flags(server_args),
        launched=sglang_sizing(model, gpu, launched_flags),
        reasons=reasons,
        candidate_args={c.name: _launch_args(c, gpu, server_args)[1] for c in candidates},
        kept_by_trial=(prefer_why or prefer) if prefer is not None else None,
        fraction=fraction,
        radix_cache={
            "kept": not launched_flags.disable_radix_cache,
            "turns": turns,
            "turns_per_conversation": turns_per_conversation,
            "turns_source": turns_source or None,
            "why": radix_why or None,
        },
        model=model,
        gpu=gpu,
        inputs={
            "server_args": list(server_args),
            "prefix_reuse": prefix_reuse if prefix_reuse_given else None,
            "turns": turns,
            "turns_per_conversation": turns_per_conversation,
            "turns_source": turns_source,
            "output_tokens": output_tokens,
            "conversations_open": conversations_open,
            "longest_request_tokens": longest_request_tokens,
            "prefer": prefer,
            "prefer_why": prefer_why,
            "headroom": headroom,
        },
    )
    plan.roofline_tokens_per_s = decode_roofline(
        model, gpu, plan.launched.concurrency(context_tokens) if plan.launched else 0, context_tokens
    )
    return plan


def _candidate(
    model: ModelShape, gpu: GpuMemory, context_tokens: int, name: str, flags: EngineFlags, note: str = ""
) -> Candidate:
    sizing = sglang_sizing(model, gpu, flags)
    return Candidate(name, flags, sizing, sizing.concurrency(context_tokens), note)


_OWN = {
    "no-radix": "radix cache off, 0.9:1 split",
    "no-radix-balanced": "radix cache off, state pool = running requests",
    "radix-balanced": "radix cache on, pools balanced",
}


def _own_candidate(model: ModelShape, gpu: GpuMemory, free: EngineFlags, context_tokens: int, name: str) -> Candidate:
    """One of the plan's own candidates (`_OWN`) at `free`'s fraction."""
    if name == "no-radix":
        flags = replace(free, disable_radix_cache=True)
    else:
        flags, _ = _best_balanced(model, gpu, free, context_tokens, radix=name == "radix-balanced")
    return _candidate(model, gpu, context_tokens, name, flags, _OWN[name])


def _own_candidates(model: ModelShape, gpu: GpuMemory, free: EngineFlags, context_tokens: int) -> list[Candidate]:
    """The plan's own candidates at `free`'s fraction: radix off with the 0.9 split, and both balanced pools."""
    return [_own_candidate(model, gpu, free, context_tokens, name) for name in _OWN]


def _measured_fraction(
    model: ModelShape,
    gpu: GpuMemory,
    free: EngineFlags,
    context_tokens: int,
    headroom: Headroom,
    default_fraction: float,
) -> tuple[list[Candidate], dict[str, dict[str, Any]]]:
    """The plan's candidates, each at the largest fraction that leaves `headroom`'s measured need for its launch.

    The need grows with the decode CUDA graphs, which grow with the running-request cap, which grows with the
    fraction: each candidate starts from the fraction for the smallest graphs, lowered until its launch fits.
    """
    chunk = free.chunked_prefill_size or _graph_defaults(gpu.total_bytes / _MIB)[0]
    pre = gpu.pre_model_load_bytes
    own: list[Candidate] = []
    fractions: dict[str, dict[str, Any]] = {}
    for name in _OWN:
        value = headroom.fraction(pre, chunk, 1)
        while True:  # the fraction only falls, by at least 0.001 a round
            cand = _own_candidate(model, gpu, replace(free, mem_fraction_static=value), context_tokens, name)
            batch = decode_graph_max_bs(_launch_args(cand, gpu, ())[0], gpu.total_bytes)
            needed = headroom.fraction(pre, chunk, batch)
            if needed >= value:
                break
            value = needed
        own.append(cand)
        need = headroom.need_bytes(chunk, batch)
        fractions[name] = {
            "value": value,
            "source": "measured-headroom",
            "why": f"leaves {need / _GIB:.2f} GiB of the {pre / _GIB:.2f} GiB free before the weights outside the "
            f"pools: {headroom.describe(chunk, batch)}; SGLang's own fraction would be {default_fraction:g}",
            "sglang_default": default_fraction,
            "need_bytes": need,
            "terms": headroom.terms(chunk, batch),
            "chunk_tokens": chunk,
            "decode_graph_batch": batch,
            "headroom": headroom.as_dict(),
        }
    return own, fractions


def _launch_args(
    cand: Candidate, gpu: GpuMemory, server_args: Sequence[str]
) -> tuple[EngineFlags, list[str], list[str]]:
    """A candidate's flags as launched: decode CUDA graphs up to its cap; flags the spec sets itself left out."""
    flags = cand.flags
    _, graph_default = _graph_defaults(gpu.total_bytes / _MIB)
    cap = cand.sizing.max_running_requests
    if flags.cuda_graph_max_bs_decode is None and cap > graph_default:
        # Decode batches above the captured size run eagerly; SGLang only ever lowers the default to the cap.
        flags = replace(flags, cuda_graph_max_bs_decode=cap)
    planned = flags.to_args()
    overridden = sorted({a for a in planned if a.startswith("--") and _given(server_args, a)})
    return flags, _without(planned, overridden), overridden


def _without(args: list[str], flags: Sequence[str]) -> list[str]:
    """`args` minus each flag in `flags` and its value."""
    out: list[str] = []
    skip = False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in flags:
            skip = i + 1 < len(args) and not args[i + 1].startswith("--")
            continue
        out.append(a)
    return out


def expected_context(
    mean_prompt_tokens: float, mean_output_tokens: float | None, max_new_tokens: int
) -> tuple[int, str]:
    """Tokens of context a running request holds at its end: prompt + output (pilot), else prompt + max/2."""
    if mean_output_tokens is not None:
        return max(1, math.ceil(mean_prompt_tokens + mean_output_tokens)), "prompt + pilot-measured output"
    return max(1, math.ceil(mean_prompt_tokens + max_new_tokens / 2)), "prompt + max_new_tokens/2 (no pilot yet)"
