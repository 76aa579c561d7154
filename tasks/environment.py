"""The environment-check stage: every check before any GPU time is spent, as rows of one report.

Order: GPUs (probed under the engine's interpreter), model directory, host resources, launch flags,
then S3 (supplied by the caller). A check that crashes becomes a failed row, so the rest still report.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from datagen.checks import CheckResult
from datagen.checks.gpu import GpuProbeError, gpu_checks, run_probe
from datagen.checks.model_dir import check_free_ram, check_free_space, model_dir_checks
from datagen.checks.server_flags import SERVER_FLAG_CHECK_NAMES, server_flag_checks
from datagen.conversation.turn_mode import turn_mode
from datagen.engine import plan_trial
from datagen.engine.headroom import Headroom, headroom_for
from datagen.engine.memory_plan import (
    ENGINE_MEMORY,
    EngineFlags,
    GpuMemory,
    MemoryPlan,
    ModelShape,
    PromptTokens,
    UnstartableError,
    card_bandwidth,
    expected_context,
    for_engine,
    is_hybrid_gdn,
    plan_memory,
    weights_bytes,
)
from datagen.runspec import RunSpec
from datagen.settings import Settings
from datagen.standin.knobs import Knobs

__all__ = [
    "GPU_CHECK_NAMES",
    "MEMORY_PLAN_CHECK",
    "MIN_RAM_PER_SERVER_BYTES",
    "MIN_SHM_FREE_BYTES",
    "MIN_WORK_DIR_FREE_BYTES",
    "EnvironmentCheckFailed",
    "format_report",
    "memory_plan_for",
    "raise_if_failed",
    "report_rows",
    "run_checks",
]

_GIB = 1024**3
# SGLang and NCCL keep shared memory segments in /dev/shm beside the staged model.
MIN_SHM_FREE_BYTES = 2 * _GIB
# Completions (JSONL with thinking), validated rows and the tokenized dataset of a ~1M-prompt run.
MIN_WORK_DIR_FREE_BYTES = 50 * _GIB
# Host memory per SGLang server beyond the (shared, tmpfs) weights: tokenizer workers, CUDA host buffers.
MIN_RAM_PER_SERVER_BYTES = 8 * _GIB
_STANDIN_MIN_BYTES = 1 * _GIB  # the stand-in and a demo-sized run

GPU_CHECK_NAMES = (
    "gpu.count",
    "gpu.compute_capability",
    "gpu.torch_arch",
    "gpu.free",
    "engine.sglang_version",
    "engine.flashinfer",
)


MEMORY_PLAN_CHECK = "engine.memory_plan"
# Mean prompt tokens assumed before the prompts are rendered (chat template + a typical instruction prompt);
# the output side, which dominates a thinking model's context, comes from the pilot or max_new_tokens.
PROMPT_TOKENS_ESTIMATE = 512


def _guarded(name: str, fn: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    try:
        return fn()
    except Exception as exc:  # one broken check must not hide the others' rows
        return [CheckResult(name, "fail", f"check crashed: {type(exc).__name__}: {exc}")]


def _gpu_and_probe(settings: Settings) -> tuple[list[CheckResult], dict[str, Any] | None]:
    why = None
    if settings.skip_gpu_checks:
        why = "DATAGEN_SKIP_GPU_CHECKS=true"
    elif settings.server_urls:
        why = "attach mode: the servers and their GPUs are managed elsewhere"
    elif settings.engine == "standin":
        why = "engine is the CPU stand-in"
    if why is not None:
        return [CheckResult(n, "skipped", why) for n in GPU_CHECK_NAMES], None
    try:
        probe = run_probe(settings.engine_python)
    except GpuProbeError as exc:
        return [CheckResult("gpu.probe", "fail", str(exc))], None
    checks = gpu_checks(probe, expected_devices=settings.num_servers, allowed=settings.allowed_compute_capabilities)
    return checks, probe


def _planned_gpu(settings: Settings, probe: dict[str, Any] | None, model_dir: Path) -> GpuMemory | str:
    """The GPU each server gets (the smallest free one of the probe, or the stand-in's emulated card), or why none."""
    if settings.server_urls:
        return "attach mode: the servers were launched elsewhere"
    if settings.engine == "standin":
        knobs = Knobs.from_env()
        if knobs.gpu_memory_bytes is None:
            return "the stand-in emulates no GPU memory (DATAGEN_STANDIN_GPU_MEMORY_BYTES unset)"
        return GpuMemory(
            knobs.gpu_memory_bytes, knobs.gpu_memory_bytes, knobs.weights_bytes, card_bandwidth("RTX PRO 6000")
        )
    devices = [d for d in (probe or {}).get("devices", []) if isinstance(d.get("total_memory_bytes"), int)]
    if not devices:
        return "no GPU probe (GPU checks skipped or failed)"
    weights = weights_bytes(model_dir)
    if weights is None:
        return f"{model_dir}: no safetensors weights to size"
    gpu = min(devices, key=lambda d: d.get("free_memory_bytes") or d["total_memory_bytes"])
    free = gpu.get("free_memory_bytes") or gpu["total_memory_bytes"]
    planned = GpuMemory(gpu["total_memory_bytes"], free, weights, card_bandwidth(str(gpu.get("name", ""))))
    # What the installed engine takes from the pools (ENGINE_MEMORY: 0.5.17 reserves 1 GiB for multimodal
    # transfers first, issue 37); an engine without a profile is sized as the target 0.5.23. The launcher checks
    # the pools each server logs either way.
    version = _engine_version(probe)
    if version is not None and version in ENGINE_MEMORY:
        return for_engine(planned, version)
    return planned


def memory_plan_for(
    settings: Settings,
    spec: RunSpec,
    probe: dict[str, Any] | None = None,
    mean_output_tokens: float | None = None,
    prompt_tokens: PromptTokens | None = None,
    *,
    turns_per_conversation: float = 1.0,
    turns_source: str = "",
    prefer: str | None = None,
    prefer_why: str = "",
    headroom: Headroom | None = None,
    headroom_why: str = "",
    higher: bool = False,
) -> tuple[MemoryPlan | None, str]:
    """This run's memory plan (None with the reason when there is nothing to plan); probes the GPUs if needed.

    `prompt_tokens`: the run's prompt lengths as planning rendered them (`tasks.planning.prompt_tokens`); without
    them (`datagen check`, before planning) PROMPT_TOKENS_ESTIMATE is assumed and the plan says so.
    `turns_per_conversation`: expected turns of a run that generates every turn (steps, each extending the last),
    `turns_source` where that figure came from (`tasks.pilot.plan_turns`). `prefer`/`prefer_why`: the
    candidate a pilot's side-by-side trial kept (`datagen.engine.plan_trial`).
    The fraction comes from the engine's measured headroom (`datagen.engine.headroom.HEADROOM`, by the probed
    SGLang version; none: SGLang's own fraction), or `headroom` (the one a pilot's trial kept, `headroom_why`
    saying so). `higher`: the plan at the fraction the pilot's trial tries above that (`plan_trial.trial_headroom`);
    None when there is none to try.
    """
    model_dir = Path(spec.model_path)
    config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
    if not is_hybrid_gdn(config):
        return None, "not a hybrid GDN model: SGLang's defaults"
    if EngineFlags.from_args(spec.server_args).speculative_algorithm:
        # Speculative decoding reserves draft state in the pools, which the plan does not model.
        return None, "speculative decoding chosen in server_args: no plan, the spec's flags as given"
    if probe is None and settings.engine == "sglang" and not settings.server_urls and not settings.skip_gpu_checks:
        probe = run_probe(settings.engine_python)
    gpu = _planned_gpu(settings, probe, model_dir)
    if isinstance(gpu, str):
        return None, gpu
    version = _engine_version(probe)
    if higher:
        headroom = plan_trial.trial_headroom(version, headroom_for(version))
        if headroom is None:
            return None, "no higher fraction to try (no measured headroom without a margin)"
        headroom_why = "the pilot's trial: a higher fraction"
    elif headroom is None:
        headroom = headroom_for(version)
    if prompt_tokens is None:
        prompt_tokens = PromptTokens(
            0,
            PROMPT_TOKENS_ESTIMATE,
            PROMPT_TOKENS_ESTIMATE,
            PROMPT_TOKENS_ESTIMATE,
            "assumed: the prompts are not rendered yet",
        )
    max_new = spec.sampling.max_new_tokens
    context, output_source = expected_context(prompt_tokens.mean, mean_output_tokens, max_new)
    output = mean_output_tokens if mean_output_tokens is not None else max_new / 2
    plan = plan_memory(
        ModelShape.from_config(config),
        gpu,
        context,
        context_source=f"{prompt_tokens.describe()}; {output_source}",
        server_args=spec.server_args,
        turns=turn_mode(spec).name,  # the mode's physics (prefix reuse) is the plan's: its one hand-off
        turns_per_conversation=turns_per_conversation,
        turns_source=turns_source,
        output_tokens=output,
        longest_request_tokens=prompt_tokens.max + max_new if prompt_tokens.n else None,
        prefer=prefer,
        prefer_why=prefer_why,
        headroom=headroom,
        headroom_why=headroom_why,
    )
    return plan, plan.summary()


def _engine_version(probe: dict[str, Any] | None) -> str | None:
    """The SGLang version the GPU probe found under the engine's interpreter (None: not probed)."""
    packages = (probe or {}).get("packages")
    version = packages.get("sglang") if isinstance(packages, dict) else None
    return version if isinstance(version, str) else None


def _memory_plan(settings: Settings, spec: RunSpec, probe: dict[str, Any] | None) -> list[CheckResult]:
    try:
        plan, why = memory_plan_for(settings, spec, probe or {})
    except UnstartableError as exc:  # the spec's own flags: refused here, before any server is launched
        return [CheckResult(MEMORY_PLAN_CHECK, "fail", f"server_args {' '.join(spec.server_args)}: {exc}")]
    if plan is None:
        return [CheckResult(MEMORY_PLAN_CHECK, "skipped", why)]
    return [CheckResult(MEMORY_PLAN_CHECK, "pass", f"{why} ({'; '.join(plan.reasons)})")]


def _model_and_host(settings: Settings, spec: RunSpec) -> list[CheckResult]:
    launching_sglang = settings.engine == "sglang" and not settings.server_urls
    weights_skip = None if launching_sglang else "no weights loaded here (stand-in engine or attach mode)"
    results = model_dir_checks(
        Path(spec.model_path),
        require_tmpfs=settings.require_tmpfs_model and not settings.server_urls,
        weights_skip_reason=weights_skip,
    )
    if launching_sglang:
        results.append(check_free_space("host.shm_free", Path("/dev/shm"), MIN_SHM_FREE_BYTES, "SGLang/NCCL segments"))
    else:
        results.append(CheckResult("host.shm_free", "skipped", "no SGLang server is started on this box"))
    work_min = MIN_WORK_DIR_FREE_BYTES if launching_sglang else _STANDIN_MIN_BYTES
    results.append(check_free_space("host.work_dir_free", settings.work_dir, work_min, "staging disk"))
    ram_min = MIN_RAM_PER_SERVER_BYTES * settings.num_servers if launching_sglang else _STANDIN_MIN_BYTES
    results.append(check_free_ram(ram_min))
    return results


def _flags(settings: Settings, spec: RunSpec) -> list[CheckResult]:
    if settings.server_urls:
        why = "attach mode: the servers were launched elsewhere"
        return [CheckResult(n, "skipped", why) for n in SERVER_FLAG_CHECK_NAMES]
    return server_flag_checks(settings, spec)


def run_checks(
    settings: Settings, spec: RunSpec, s3_check: Callable[[], list[CheckResult]] | None = None
) -> list[CheckResult]:
    """Run every environment check for this run on this box; never raises for a failed check."""
    probed: list[dict[str, Any] | None] = [None]

    def gpu() -> list[CheckResult]:
        checks, probed[0] = _gpu_and_probe(settings)
        return checks

    results = _guarded("gpu.probe", gpu)
    results += _guarded("model_dir", lambda: _model_and_host(settings, spec))
    results += _guarded("engine.server_flags", lambda: _flags(settings, spec))
    results += _guarded(MEMORY_PLAN_CHECK, lambda: _memory_plan(settings, spec, probed[0]))
    if s3_check is None:
        results.append(CheckResult("s3", "skipped", "no S3 check supplied"))
    else:
        results += _guarded("s3", s3_check)
    return results


class EnvironmentCheckFailed(RuntimeError):
    """One or more environment checks failed; nothing was started."""


def raise_if_failed(results: list[CheckResult]) -> None:
    """Raise EnvironmentCheckFailed naming each failed check and its detail (one line each)."""
    failed = [r for r in results if r.failed]
    if failed:
        raise EnvironmentCheckFailed(
            f"{len(failed)} of {len(results)} environment checks failed:\n"
            + "\n".join(f"- {r.name}: {_one_line(r.detail)}" for r in failed)
        )


def _one_line(text: str) -> str:
    return " | ".join(part.strip() for part in text.splitlines() if part.strip())


def format_report(results: list[CheckResult]) -> str:
    """A plain-text table for `datagen check`: one line per check, then a summary line."""
    status_w = max([len("STATUS"), *(len(r.status) for r in results)])
    name_w = max([len("CHECK"), *(len(r.name) for r in results)])
    lines = [f"{'STATUS':<{status_w}}  {'CHECK':<{name_w}}  DETAIL"]
    lines += [f"{r.status.upper():<{status_w}}  {r.name:<{name_w}}  {_one_line(r.detail)}" for r in results]
    counts = {s: sum(r.status == s for r in results) for s in ("pass", "fail", "skipped")}
    # Worded so CI log scrapers never mistake it for a test runner's summary line.
    lines.append(f"checks: {counts['pass']} pass, {counts['fail']} fail, {counts['skipped']} skipped")
    return "\n".join(lines)


def report_rows(results: list[CheckResult]) -> list[dict[str, str]]:
    """Rows for a Prefect table artifact: check, status, detail."""
    return [{"check": r.name, "status": r.status, "detail": r.detail} for r in results]
