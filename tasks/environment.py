"""The environment-check stage: every check before any GPU time is spent, as rows of one report.

Order: GPUs (probed under the engine's interpreter), model directory, host resources, launch flags,
then S3 (supplied by the caller). A check that crashes becomes a failed row, so the rest still report.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from datagen.checks import CheckResult
from datagen.checks.gpu import GpuProbeError, gpu_checks, run_probe
from datagen.checks.model_dir import check_free_ram, check_free_space, model_dir_checks
from datagen.checks.server_flags import SERVER_FLAG_CHECK_NAMES, server_flag_checks
from datagen.runspec import RunSpec
from datagen.settings import Settings

__all__ = [
    "GPU_CHECK_NAMES",
    "MIN_RAM_PER_SERVER_BYTES",
    "MIN_SHM_FREE_BYTES",
    "MIN_WORK_DIR_FREE_BYTES",
    "format_report",
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


def _guarded(name: str, fn: Callable[[], list[CheckResult]]) -> list[CheckResult]:
    try:
        return fn()
    except Exception as exc:  # one broken check must not hide the others' rows
        return [CheckResult(name, "fail", f"check crashed: {type(exc).__name__}: {exc}")]


def _gpu(settings: Settings) -> list[CheckResult]:
    why = None
    if settings.skip_gpu_checks:
        why = "DATAGEN_SKIP_GPU_CHECKS=true"
    elif settings.server_urls:
        why = "attach mode: the servers and their GPUs are managed elsewhere"
    elif settings.engine == "standin":
        why = "engine is the CPU stand-in"
    if why is not None:
        return [CheckResult(n, "skipped", why) for n in GPU_CHECK_NAMES]
    try:
        probe = run_probe(settings.engine_python)
    except GpuProbeError as exc:
        return [CheckResult("gpu.probe", "fail", str(exc))]
    return gpu_checks(probe, expected_devices=settings.num_servers, allowed=settings.allowed_compute_capabilities)


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
    results = _guarded("gpu.probe", lambda: _gpu(settings))
    results += _guarded("model_dir", lambda: _model_and_host(settings, spec))
    results += _guarded("engine.server_flags", lambda: _flags(settings, spec))
    if s3_check is None:
        results.append(CheckResult("s3", "skipped", "no S3 check supplied"))
    else:
        results += _guarded("s3", s3_check)
    return results


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
