"""GPU checks: pure functions over the JSON that `gpu_probe.py` prints under the engine's interpreter.

Being pure, they run on recorded probes (tests/fixtures/gpu_probe_*.json) exactly as on a live one.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from datagen.checks import CheckResult

__all__ = [
    "BUSY_MEMORY_BYTES",
    "MIN_SGLANG_VERSION",
    "PROBE_SCRIPT",
    "GpuProbeError",
    "arch_for",
    "check_arch_list",
    "check_compute_capability",
    "check_device_count",
    "check_flashinfer",
    "check_gpus_free",
    "check_sglang_version",
    "gpu_checks",
    "parse_version",
    "run_probe",
]

PROBE_SCRIPT = Path(__file__).with_name("gpu_probe.py")
MIN_SGLANG_VERSION = "0.5.10"  # first release that runs Qwen3.6 (SGLang cookbook)
# An idle GPU shows some driver-reserved memory as used (0.6 GiB on an idle H200); a process
# that NVML cannot attribute (another container) holding more than this still makes it busy.
BUSY_MEMORY_BYTES = 2 * 1024**3
_GIB = 1024**3


class GpuProbeError(RuntimeError):
    """The probe could not run or printed something that is not its JSON document."""


def run_probe(engine_python: str, timeout_s: float = 180.0) -> dict[str, Any]:
    """Run gpu_probe.py under the engine's interpreter and return its JSON document."""
    try:
        proc = subprocess.run(
            [engine_python, str(PROBE_SCRIPT)], capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError as exc:
        raise GpuProbeError(
            f"engine interpreter {engine_python!r} not found; set DATAGEN_ENGINE_PYTHON to SGLang's venv python"
        ) from exc
    except subprocess.TimeoutExpired as exc:
        raise GpuProbeError(f"GPU probe under {engine_python} did not finish within {timeout_s:.0f} s") from exc
    if proc.returncode != 0:
        tail = "\n".join(proc.stderr.splitlines()[-15:])
        raise GpuProbeError(f"GPU probe under {engine_python} exited with {proc.returncode}:\n{tail}")
    try:
        doc = json.loads(proc.stdout)
    except json.JSONDecodeError as exc:
        raise GpuProbeError(f"GPU probe under {engine_python} printed no JSON: {proc.stdout[:300]!r}") from exc
    if not isinstance(doc, dict):
        raise GpuProbeError(f"GPU probe under {engine_python} printed {type(doc).__name__}, not an object")
    return doc


def parse_version(text: str) -> tuple[int, ...]:
    """Leading numeric release of a version string: '0.5.10.post1' -> (0, 5, 10)."""
    m = re.match(r"^\s*v?(\d+(?:\.\d+)*)", text)
    if not m:
        raise ValueError(f"not a version: {text!r}")
    return tuple(int(p) for p in m.group(1).split("."))


def arch_for(capability: str) -> str:
    """torch arch-list entry that holds native kernels for a compute capability: '12.0' -> 'sm_120'."""
    major, _, minor = capability.partition(".")
    return f"sm_{int(major)}{int(minor or 0)}"


def _devices(probe: dict[str, Any]) -> list[dict[str, Any]]:
    devices = probe.get("devices")
    return [d for d in devices if isinstance(d, dict)] if isinstance(devices, list) else []


def _where(probe: dict[str, Any]) -> str:
    return str(probe.get("executable") or "the engine's python")


def check_arch_list(probe: dict[str, Any], allowed: Sequence[str]) -> CheckResult:
    """torch in the engine's env was built for the GPUs' architecture (sm_120 for capability 12.0)."""
    name = "gpu.torch_arch"
    torch = probe.get("torch")
    if not isinstance(torch, dict):
        return CheckResult(
            name, "fail", f"torch is not importable in {_where(probe)}; install a CUDA build of torch there"
        )
    if not torch.get("cuda_available"):
        return CheckResult(
            name, "fail", f"torch {torch.get('version')} in {_where(probe)} sees no CUDA device (driver, container?)"
        )
    have = {str(a) for a in torch.get("arch_list") or []}
    # sm_90a-style entries carry sm_90's kernels too.
    have_base = have | {a.rstrip("af") for a in have}
    needed = sorted(
        {arch_for(c) for c in allowed} | {arch_for(str(d.get("compute_capability"))) for d in _devices(probe)}
    )
    missing = [a for a in needed if a not in have_base]
    if missing:
        return CheckResult(
            name,
            "fail",
            f"torch {torch.get('version')} (CUDA {torch.get('cuda')}) lacks {', '.join(missing)} "
            f"(has {', '.join(sorted(have)) or 'none'}); install a build that includes it (e.g. cu128/cu130 wheels)",
        )
    return CheckResult(name, "pass", f"torch {torch.get('version')} (CUDA {torch.get('cuda')}) has {', '.join(needed)}")


def check_device_count(probe: dict[str, Any], expected: int) -> CheckResult:
    """At least one GPU per server."""
    name = "gpu.count"
    count = len(_devices(probe))
    if count < expected:
        return CheckResult(
            name,
            "fail",
            f"{count} GPU(s) visible < {expected} servers wanted; "
            "lower DATAGEN_NUM_SERVERS or check CUDA_VISIBLE_DEVICES",
        )
    return CheckResult(name, "pass", f"{count} GPU(s) visible, {expected} needed")


def check_compute_capability(probe: dict[str, Any], allowed: Sequence[str]) -> CheckResult:
    """Every GPU has an allowed compute capability (the launch flags are chosen for them)."""
    name = "gpu.compute_capability"
    devices = _devices(probe)
    if not devices:
        return CheckResult(name, "fail", "no GPU visible")
    bad = [d for d in devices if str(d.get("compute_capability")) not in allowed]
    if bad:
        found = "; ".join(f"GPU {d.get('index')}: {d.get('name')} is {d.get('compute_capability')}" for d in bad)
        return CheckResult(
            name,
            "fail",
            f"{found}; allowed: {', '.join(allowed)} "
            "(set DATAGEN_ALLOWED_COMPUTE_CAPABILITIES if this box is intended)",
        )
    caps = sorted({str(d.get("compute_capability")) for d in devices})
    return CheckResult(name, "pass", f"{len(devices)} GPU(s) of capability {', '.join(caps)}")


def _gib(n: Any) -> str:
    return f"{n / _GIB:.1f} GB" if isinstance(n, int) else "memory"


def check_gpus_free(probe: dict[str, Any], busy_bytes: int = BUSY_MEMORY_BYTES) -> CheckResult:
    """No other process holds memory on any GPU (stop old training jobs first)."""
    name = "gpu.free"
    devices = _devices(probe)
    if not devices:
        return CheckResult(name, "fail", "no GPU visible")
    processes = probe.get("processes")
    problems: list[str] = []
    for d in devices:
        idx = d.get("index")
        held = [p for p in processes or [] if isinstance(p, dict) and p.get("gpu_index") == idx]
        for p in held:
            cmd = p.get("cmdline") or "command line not visible from here"
            problems.append(f"GPU {idx}: {_gib(p.get('used_memory_bytes'))} held by PID {p.get('pid')} ({cmd})")
        used = d.get("used_memory_bytes")
        if not held and isinstance(used, int) and used > busy_bytes:
            problems.append(f"GPU {idx}: {_gib(used)} in use by processes not visible here (another container?)")
    if problems:
        return CheckResult(name, "fail", "; ".join(problems) + "; stop those processes before generating")
    if probe.get("process_source") is None:
        return CheckResult(name, "fail", "could not list GPU processes (neither pynvml nor nvidia-smi worked)")
    return CheckResult(name, "pass", f"{len(devices)} GPU(s) hold no other process's memory")


def check_sglang_version(probe: dict[str, Any], minimum: str = MIN_SGLANG_VERSION) -> CheckResult:
    """SGLang is installed in the engine's env and new enough for Qwen3.6."""
    name = "engine.sglang_version"
    packages = probe.get("packages") if isinstance(probe.get("packages"), dict) else {}
    version = packages.get("sglang") if isinstance(packages, dict) else None
    if not isinstance(version, str):
        return CheckResult(
            name,
            "fail",
            f"sglang is not installed in {_where(probe)}; install it there: pip install 'sglang>={minimum}' "
            f"(or point DATAGEN_ENGINE_PYTHON at SGLang's venv)",
        )
    try:
        ok = parse_version(version) >= parse_version(minimum)
    except ValueError:
        return CheckResult(name, "fail", f"cannot read sglang version {version!r}")
    if not ok:
        return CheckResult(
            name, "fail", f"sglang {version} < {minimum}, the first release that runs Qwen3.6; upgrade it"
        )
    return CheckResult(name, "pass", f"sglang {version} (>= {minimum})")


def check_flashinfer(probe: dict[str, Any]) -> CheckResult:
    """FlashInfer is installed where SM120 GPUs need it (the launcher passes --attention-backend flashinfer)."""
    name = "engine.flashinfer"
    sm120 = [d for d in _devices(probe) if str(d.get("compute_capability", "")).startswith("12.")]
    if not sm120:
        return CheckResult(name, "skipped", "no SM120 GPU: SGLang picks its own attention backend")
    packages = probe.get("packages")
    versions = packages if isinstance(packages, dict) else {}
    version = versions.get("flashinfer-python") or versions.get("flashinfer")
    if not version:
        return CheckResult(
            name,
            "fail",
            f"flashinfer is not installed in {_where(probe)}; SM120 needs it (pip install flashinfer-python)",
        )
    return CheckResult(name, "pass", f"flashinfer {version}")


def gpu_checks(probe: dict[str, Any], *, expected_devices: int, allowed: Sequence[str]) -> list[CheckResult]:
    """Every GPU check over one probe document, in report order."""
    return [
        check_device_count(probe, expected_devices),
        check_compute_capability(probe, allowed),
        check_arch_list(probe, allowed),
        check_gpus_free(probe),
        check_sglang_version(probe),
        check_flashinfer(probe),
    ]
