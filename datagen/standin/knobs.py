"""Environment knobs of the stand-in (timing model, output lengths, fault injection); see the package docstring."""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar

__all__ = ["ENV_PREFIX", "KnobError", "Knobs"]

ENV_PREFIX = "DATAGEN_STANDIN_"
T = TypeVar("T", int, float)


class KnobError(ValueError):
    """An environment knob has a value that cannot be used."""


@dataclass(frozen=True, slots=True)
class Knobs:
    """All DATAGEN_STANDIN_* settings, parsed and checked once at startup."""

    load_s: float = 0.5
    warmup_s: float = 0.5
    gpu_arch: str | None = None
    length_mean: float = 200.0
    length_sigma: float = 0.6
    length_max: int = 2000
    reasoning_fraction: float = 0.7
    max_running: int = 64
    max_total_tokens: int = 1_048_576
    gpu_memory_bytes: int | None = None
    weights_bytes: int = 54_714_000_000
    engine_reserved_bytes: int = 0
    activation_bytes: int = 0
    prefill_graph_bytes: int = 0
    decode_graph_bytes_per_batch: int = 0
    step_base_ms: float = 0.0
    step_per_req_ms: float = 0.0
    time_scale: float = 1.0
    tokens_per_step: int = 16
    error_rate: float = 0.0
    stall_after: int | None = None
    crash_after: int | None = None
    seed: int = 0
    tool_call_rate: float = 0.5
    tool_call_match: bool = True

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> Knobs:
        """Read the knobs from `env` (default: os.environ); raises KnobError on a bad value."""
        source = os.environ if env is None else env
        d = cls()  # defaults (slots dataclass: class attributes are descriptors, not values)

        def num(name: str, conv: Callable[[str], T], default: T, low: float | None = None) -> T:
            raw = source.get(ENV_PREFIX + name)
            if raw is None or raw.strip() == "":
                return default
            try:
                value = conv(raw.strip())
            except ValueError as exc:
                raise KnobError(f"{ENV_PREFIX}{name}={raw!r}: not a valid {conv.__name__}") from exc
            if low is not None and value < low:
                raise KnobError(f"{ENV_PREFIX}{name}={raw!r}: must be >= {low}")
            return value

        def opt_int(name: str) -> int | None:
            raw = source.get(ENV_PREFIX + name)
            if raw is None or raw.strip() == "":
                return None
            return num(name, int, 0, low=0)

        knobs = cls(
            load_s=num("LOAD_S", float, d.load_s, 0),
            warmup_s=num("WARMUP_S", float, d.warmup_s, 0),
            gpu_arch=(source.get(ENV_PREFIX + "GPU_ARCH") or None),
            length_mean=num("LENGTH_MEAN", float, d.length_mean, 1),
            length_sigma=num("LENGTH_SIGMA", float, d.length_sigma, 0),
            length_max=num("LENGTH_MAX", int, d.length_max, 2),
            reasoning_fraction=num("REASONING_FRACTION", float, d.reasoning_fraction, 0),
            max_running=num("MAX_RUNNING", int, d.max_running, 1),
            max_total_tokens=num("MAX_TOTAL_TOKENS", int, d.max_total_tokens, 16),
            gpu_memory_bytes=opt_int("GPU_MEMORY_BYTES"),
            weights_bytes=num("WEIGHTS_BYTES", int, d.weights_bytes, 0),
            engine_reserved_bytes=num("ENGINE_RESERVED_BYTES", int, d.engine_reserved_bytes, 0),
            activation_bytes=num("ACTIVATION_BYTES", int, d.activation_bytes, 0),
            prefill_graph_bytes=num("PREFILL_GRAPH_BYTES", int, d.prefill_graph_bytes, 0),
            decode_graph_bytes_per_batch=num("DECODE_GRAPH_BYTES_PER_BATCH", int, d.decode_graph_bytes_per_batch, 0),
            step_base_ms=num("STEP_BASE_MS", float, d.step_base_ms, 0),
            step_per_req_ms=num("STEP_PER_REQ_MS", float, d.step_per_req_ms, 0),
            time_scale=num("TIME_SCALE", float, d.time_scale, 0),
            tokens_per_step=num("TOKENS_PER_STEP", int, d.tokens_per_step, 1),
            error_rate=num("ERROR_RATE", float, d.error_rate, 0),
            stall_after=opt_int("STALL_AFTER"),
            crash_after=opt_int("CRASH_AFTER"),
            seed=num("SEED", int, d.seed),
            tool_call_rate=num("TOOL_CALL_RATE", float, d.tool_call_rate, 0),
            tool_call_match=_flag(source.get(ENV_PREFIX + "TOOL_CALL_MATCH"), d.tool_call_match, "TOOL_CALL_MATCH"),
        )
        if knobs.reasoning_fraction > 1 or knobs.error_rate > 1 or knobs.tool_call_rate > 1:
            names = ", ".join(ENV_PREFIX + n for n in ("REASONING_FRACTION", "ERROR_RATE", "TOOL_CALL_RATE"))
            raise KnobError(f"{names} must be in [0, 1]")
        return knobs


def _flag(raw: str | None, default: bool, name: str) -> bool:
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes"):
        return True
    if value in ("0", "false", "no"):
        return False
    raise KnobError(f"{ENV_PREFIX}{name}={raw!r}: expected 1/0 (true/false)")
