"""Launch-flag checks: the installed engine's own code parses and resolves the exact command line we will run.

SGLang renames and removes flags between releases (`--mamba-scheduler-strategy` is gone in 0.5.23), narrows
choices, and rejects some flag/model combinations only while resolving settings (`--language-model-only` for
Qwen3.6). Any of these kills all eight servers at startup. `flag_probe.py`, run in the engine's interpreter
(DATAGEN_ENGINE_PYTHON), judges the argv with the engine's parser (names, choices and values) and its
settings resolution against the model's config.json, and reports it here before anything starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from datagen.checks import CheckResult
from datagen.checks.tuning import ServerArgsError
from datagen.engine.launcher import free_ports_below_ephemeral, launch_flags, server_env, write_key_config
from datagen.runspec import RunSpec
from datagen.settings import Settings

__all__ = [
    "PROBE_SCRIPT",
    "SERVER_FLAG_CHECK_NAMES",
    "SM120_HYBRID_GDN_BACKENDS",
    "check_attention_backend",
    "probe_command",
    "run_flag_probe",
    "server_flag_checks",
]

PROBE_SCRIPT = Path(__file__).with_name("flag_probe.py")
SERVER_FLAG_CHECK_NAMES = ("engine.server_flags", "engine.settings", "engine.attention_backend")
# The only attention backends SGLang 0.5.23 allows for hybrid-GDN models (Qwen3.6) on SM120: an assert in
# `layers/attention/attention_registry.py` when the model runner starts, i.e. on the GPU, after loading.
# tests/conformance/test_launch_conformance.py reads the set from the real source.
SM120_HYBRID_GDN_BACKENDS = frozenset({"triton", "trtllm_mha", "flashinfer"})
_BACKEND_FLAGS = ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend")


def probe_command(settings: Settings) -> list[str]:
    """The probe in the interpreter the launcher starts servers with."""
    if settings.engine == "standin":
        return [sys.executable, str(PROBE_SCRIPT), "standin"]
    return [settings.engine_python, str(PROBE_SCRIPT), "sglang"]


def run_flag_probe(
    settings: Settings, argv: Sequence[str], resolve: bool, timeout_s: float = 300.0
) -> dict[str, Any] | str:
    """The probe's report on `argv`, or why the engine's code could not be run."""
    cmd = probe_command(settings)
    request = json.dumps({"argv": list(argv), "resolve": resolve})
    try:
        proc = subprocess.run(
            cmd,
            input=request,
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
            env=server_env(0),  # resolution looks at the GPU as server 0 will
        )
    except FileNotFoundError:
        return f"{cmd[0]!r} not found; set DATAGEN_ENGINE_PYTHON to the engine's interpreter"
    except subprocess.TimeoutExpired:
        return f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f} s"
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    try:
        report = json.loads(lines[-1]) if lines else None
    except json.JSONDecodeError:
        report = None
    if proc.returncode != 0 or not isinstance(report, dict):
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-10:])
        engine = "sglang" if settings.engine == "sglang" else "the stand-in"
        hint = f" (is {engine} installed in {cmd[0]}? set DATAGEN_ENGINE_PYTHON)" if settings.engine == "sglang" else ""
        return f"`{' '.join(cmd)}` exited with {proc.returncode}{hint}:\n{tail}"
    return report


def check_attention_backend(args: Sequence[str], capabilities: Sequence[str]) -> CheckResult:
    """On SM120 only SGLang's hybrid-GDN allow-list (flashinfer, triton, trtllm_mha); it asserts otherwise."""
    name = "engine.attention_backend"
    chosen: list[str] = []
    for i, a in enumerate(args):
        for flag in _BACKEND_FLAGS:
            if a == flag and i + 1 < len(args):
                chosen.append(args[i + 1])
            elif a.startswith(flag + "="):
                chosen.append(a.split("=", 1)[1])
    sm120 = any(c.split(".", 1)[0] == "12" for c in capabilities)
    bad = sorted(set(chosen) - SM120_HYBRID_GDN_BACKENDS)
    if sm120 and bad:
        allowed = ", ".join(sorted(SM120_HYBRID_GDN_BACKENDS))
        return CheckResult(
            name,
            "fail",
            f"attention backend {', '.join(bad)} is not supported on SM120 for Qwen3.6 (hybrid GDN): SGLang "
            f"allows only {allowed} there and stops each server after loading the weights; use flashinfer "
            "(default here)",
        )
    return CheckResult(name, "pass", f"attention backend: {', '.join(chosen) or 'engine default'}")


def server_flag_checks(settings: Settings, spec: RunSpec) -> list[CheckResult]:
    """Judge this run's launch flags with the installed engine's own parser and settings resolution."""
    # The key's value is irrelevant here and must not appear in any report; the NCCL port is picked as the
    # fleet picks it, so its flag and value are judged too.
    serving = range(settings.base_port, settings.base_port + settings.num_servers)
    nccl_port = free_ports_below_ephemeral(1, exclude=serving)[0]
    engine = "sglang" if settings.engine == "sglang" else "the stand-in"
    model_dir = Path(spec.model_path)
    no_gpu = settings.engine == "sglang" and settings.skip_gpu_checks
    with tempfile.TemporaryDirectory(prefix="datagen-flags-") as tmp:  # the key file as servers get it
        key_config = write_key_config(Path(tmp) / "key.yaml", SecretStr("***"))
        try:
            args = launch_flags(settings, spec, settings.base_port, key_config, nccl_port)
        except ServerArgsError as exc:  # a flag the run may not set: the engine never sees it
            return [
                CheckResult("engine.server_flags", "fail", str(exc)),
                CheckResult("engine.settings", "skipped", "the run's server_args are refused"),
                CheckResult("engine.attention_backend", "skipped", "the run's server_args are refused"),
            ]
        report = run_flag_probe(settings, args, resolve=model_dir.is_dir() and not no_gpu)
    backend = check_attention_backend(args, settings.allowed_compute_capabilities)
    if isinstance(report, str):
        why = f"cannot run the engine's own parser: {report}"
        return [
            CheckResult("engine.server_flags", "fail", why),
            CheckResult("engine.settings", "skipped", "the engine's code could not be run"),
            backend,
        ]
    version = f" {report['version']}" if report.get("version") else ""
    parse, resolve = report["parse"], report["resolve"]
    if not parse["ok"]:
        flags = CheckResult(
            "engine.server_flags",
            "fail",
            f"{engine}{version} rejects the launch flags: {parse['error']} (check the run spec's server_args)",
        )
        return [flags, CheckResult("engine.settings", "skipped", "the flags do not parse"), backend]
    flags = CheckResult(
        "engine.server_flags", "pass", f"{engine}{version}'s own parser accepts all {len(args)} launch arguments"
    )
    if resolve["ok"] is None:
        why = (
            "DATAGEN_SKIP_GPU_CHECKS: SGLang's settings resolution reads the GPU"
            if no_gpu
            else f"{model_dir} does not exist"
        )
        settings_check = CheckResult("engine.settings", "skipped", why)
    elif resolve["ok"]:
        settings_check = CheckResult(
            "engine.settings", "pass", f"{engine}{version} resolves these settings for {model_dir.name}"
        )
    else:
        settings_check = CheckResult(
            "engine.settings",
            "fail",
            f"{engine}{version} rejects these settings for {model_dir}: {resolve['error']} "
            "(the server would exit at startup; change the run spec's server_args)",
        )
    return [flags, settings_check, backend]
