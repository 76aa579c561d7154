"""Probe the GPUs as the engine's own interpreter sees them and print one JSON document.

Run with the ENGINE's Python (SGLang often lives in its own venv): ``<engine_python> gpu_probe.py``.
Standalone on purpose: standard library plus torch and pynvml (nvidia-ml-py) when importable, so it
runs in an environment that has never heard of datagen. The checks in `datagen.checks.gpu` read its
output; they never import torch themselves.

Output keys: probe_version, python, executable, torch (version, cuda, arch_list, cuda_available),
device_count, devices (index, name, compute_capability, total/free/used memory in bytes),
processes (gpu_index, pid, used_memory_bytes, cmdline), process_source, packages, errors.
"""

from __future__ import annotations

import csv
import importlib
import importlib.metadata
import io
import json
import os
import platform
import subprocess
import sys
from typing import Any

__all__ = ["PROBE_VERSION", "main", "probe"]

PROBE_VERSION = 1

# Distribution names whose versions the checks need; flashinfer ships under several names.
_PACKAGES = ("sglang", "flashinfer-python", "flashinfer", "torch", "nvidia-ml-py", "sgl-kernel", "sglang-kernel")


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cmdline(pid: int) -> str | None:
    """The process's command line from /proc (None when it is gone or in another PID namespace)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    parts = [p.decode("utf-8", "replace") for p in raw.split(b"\0") if p]
    return " ".join(parts) if parts else None


def _torch_info(errors: list[str]) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
    """torch version, CUDA build, arch list and per-device name/capability."""
    try:
        torch: Any = importlib.import_module("torch")
    except Exception as exc:  # any import failure means "no usable torch here"
        errors.append(f"import torch: {type(exc).__name__}: {exc}")
        return None, []
    info: dict[str, Any] = {
        "version": str(torch.__version__),
        "cuda": torch.version.cuda,
        "arch_list": [],
        "cuda_available": False,
    }
    devices: list[dict[str, Any]] = []
    try:
        info["cuda_available"] = bool(torch.cuda.is_available())
        info["arch_list"] = list(torch.cuda.get_arch_list()) if info["cuda_available"] else []
        for i in range(torch.cuda.device_count() if info["cuda_available"] else 0):
            props = torch.cuda.get_device_properties(i)
            devices.append(
                {
                    "index": i,
                    "name": str(props.name),
                    "compute_capability": f"{props.major}.{props.minor}",
                    "total_memory_bytes": int(props.total_memory),
                    "free_memory_bytes": None,
                    "used_memory_bytes": None,
                }
            )
    except Exception as exc:  # a broken driver must still produce a report, not a traceback
        errors.append(f"torch.cuda: {type(exc).__name__}: {exc}")
    return info, devices


def _nvml_memory_and_processes(
    devices: list[dict[str, Any]], errors: list[str]
) -> tuple[list[dict[str, Any]], str | None] | None:
    """Fill memory figures and list compute processes through NVML; None when NVML is unusable."""
    try:
        nvml: Any = importlib.import_module("pynvml")
        nvml.nvmlInit()
    except Exception as exc:
        errors.append(f"nvml: {type(exc).__name__}: {exc}")
        return None
    processes: list[dict[str, Any]] = []
    try:
        count = int(nvml.nvmlDeviceGetCount())
        by_index = {d["index"]: d for d in devices}
        for i in range(count):
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            mem = nvml.nvmlDeviceGetMemoryInfo(handle)
            dev = by_index.get(i)
            if dev is None:
                # torch saw fewer devices (or none): still report what NVML sees.
                name = nvml.nvmlDeviceGetName(handle)
                major, minor = nvml.nvmlDeviceGetCudaComputeCapability(handle)
                dev = {
                    "index": i,
                    "name": name.decode() if isinstance(name, bytes) else str(name),
                    "compute_capability": f"{major}.{minor}",
                    "total_memory_bytes": int(mem.total),
                }
                devices.append(dev)
            dev["free_memory_bytes"] = int(mem.free)
            dev["used_memory_bytes"] = int(mem.used)
            for proc in nvml.nvmlDeviceGetComputeRunningProcesses(handle):
                used = proc.usedGpuMemory
                processes.append(
                    {
                        "gpu_index": i,
                        "pid": int(proc.pid),
                        "used_memory_bytes": int(used) if isinstance(used, int) else None,
                        "cmdline": _cmdline(int(proc.pid)),
                    }
                )
    except Exception as exc:
        errors.append(f"nvml: {type(exc).__name__}: {exc}")
        return None
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception as exc:
            errors.append(f"nvmlShutdown: {type(exc).__name__}: {exc}")
    return processes, "pynvml"


def _smi(query: str, fields: str, errors: list[str]) -> list[list[str]] | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-{query}={fields}", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=60,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError) as exc:
        errors.append(f"nvidia-smi --query-{query}: {type(exc).__name__}: {exc}")
        return None
    return [[c.strip() for c in row] for row in csv.reader(io.StringIO(out)) if row]


def _smi_memory_and_processes(
    devices: list[dict[str, Any]], errors: list[str]
) -> tuple[list[dict[str, Any]], str | None] | None:
    """The same through nvidia-smi, for engine environments without pynvml."""
    gpus = _smi("gpu", "index,uuid,name,compute_cap,memory.total,memory.used,memory.free", errors)
    if gpus is None:
        return None
    mib = 1024 * 1024
    by_index = {d["index"]: d for d in devices}
    uuid_to_index: dict[str, int] = {}
    for index_s, uuid, name, cap, total, used, free in (row[:7] for row in gpus if len(row) >= 7):
        i = int(index_s)
        uuid_to_index[uuid] = i
        dev = by_index.get(i)
        if dev is None:
            dev = {"index": i, "name": name, "compute_capability": cap, "total_memory_bytes": int(total) * mib}
            devices.append(dev)
        dev["free_memory_bytes"] = int(free) * mib
        dev["used_memory_bytes"] = int(used) * mib
    apps = _smi("compute-apps", "gpu_uuid,pid,used_memory", errors)
    if apps is None:
        return None
    processes = []
    for uuid, pid_s, used_s in (row[:3] for row in apps if len(row) >= 3):
        pid = int(pid_s)
        processes.append(
            {
                "gpu_index": uuid_to_index.get(uuid),
                "pid": pid,
                "used_memory_bytes": int(used_s) * mib if used_s.isdigit() else None,
                "cmdline": _cmdline(pid),
            }
        )
    return processes, "nvidia-smi"


def probe() -> dict[str, Any]:
    """Collect the probe document (never raises: failures land in `errors`)."""
    errors: list[str] = []
    torch_info, devices = _torch_info(errors)
    found = _nvml_memory_and_processes(devices, errors)
    if found is None:
        found = _smi_memory_and_processes(devices, errors)
    processes, source = found if found is not None else ([], None)
    # This probe's own CUDA context is not "another process holding the GPU".
    processes = [p for p in processes if p["pid"] != os.getpid()]
    devices.sort(key=lambda d: int(d["index"]))
    return {
        "probe_version": PROBE_VERSION,
        "python": platform.python_version(),
        "executable": sys.executable,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "torch": torch_info,
        "device_count": len(devices),
        "devices": devices,
        "processes": processes,
        "process_source": source,
        "packages": {name: _version(name) for name in _PACKAGES},
        "errors": errors,
    }


def main() -> int:
    """Print the probe document as JSON on stdout."""
    # torch and NVML must number the GPUs alike, and alike to CUDA_VISIBLE_DEVICES=i of the servers.
    os.environ.setdefault("CUDA_DEVICE_ORDER", "PCI_BUS_ID")
    json.dump(probe(), sys.stdout, indent=2)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
