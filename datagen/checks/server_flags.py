"""Launch-flag check: every flag the pipeline will pass is one the installed engine's own `--help` lists.

SGLang renames and removes flags between releases (`--mamba-scheduler-strategy` is gone in 0.5.23);
an unknown flag is an argparse error that would kill all eight servers at startup. Reading the
engine's `--help` reports it here, by name, before anything starts.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Sequence

from datagen.checks import CheckResult
from datagen.engine.launcher import engine_command, launch_flags
from datagen.runspec import RunSpec
from datagen.settings import Settings

__all__ = [
    "check_attention_backend",
    "check_flags",
    "flags_of",
    "help_command",
    "parse_help_flags",
    "read_engine_flags",
    "server_flag_checks",
]

_FLAG_RE = re.compile(r"(?<![\w-])--[A-Za-z0-9][A-Za-z0-9_-]*")
# Rejected for hybrid-GDN models (Qwen3.6) on SM120 by SGLang's attention registry.
_SM120_FORBIDDEN_BACKENDS = frozenset({"fa3", "fa4"})


def help_command(settings: Settings) -> list[str]:
    """The engine's `--help` command: the same interpreter and module the launcher starts."""
    return [*engine_command(settings), "--help"]


def parse_help_flags(help_text: str) -> set[str]:
    """Every `--flag` token in an argparse help text."""
    return set(_FLAG_RE.findall(help_text))


def flags_of(args: Sequence[str]) -> list[str]:
    """The flags (not their values) in an argument list, `--a=b` read as `--a`."""
    return [a.split("=", 1)[0] for a in args if a.startswith("--") and len(a) > 2]


def _resolve(flag: str, known: set[str]) -> str | None:
    """The known flag `flag` selects, as argparse (allow_abbrev) would: exact, or one unambiguous prefix."""
    if flag in known:
        return flag
    matches = [k for k in known if k.startswith(flag)]
    return matches[0] if len(matches) == 1 else None


def check_flags(args: Sequence[str], known: set[str], engine: str) -> CheckResult:
    """Every flag in `args` is one the engine accepts."""
    name = "engine.server_flags"
    unknown = [f for f in dict.fromkeys(flags_of(args)) if _resolve(f, known) is None]
    if unknown:
        return CheckResult(
            name,
            "fail",
            f"{engine} does not accept {', '.join(unknown)} (not in its --help); remove or rename "
            f"{'it' if len(unknown) == 1 else 'them'} in the run spec's server_args",
        )
    return CheckResult(name, "pass", f"all {len(set(flags_of(args)))} launch flags are known to {engine}")


def check_attention_backend(args: Sequence[str], capabilities: Sequence[str]) -> CheckResult:
    """No FlashAttention 3/4 backend on SM120 (SGLang asserts at startup for Qwen3.6 there)."""
    name = "engine.attention_backend"
    chosen: list[str] = []
    for i, a in enumerate(args):
        for flag in ("--attention-backend", "--prefill-attention-backend", "--decode-attention-backend"):
            if a == flag and i + 1 < len(args):
                chosen.append(args[i + 1])
            elif a.startswith(flag + "="):
                chosen.append(a.split("=", 1)[1])
    sm120 = any(c.split(".", 1)[0] == "12" for c in capabilities)
    bad = sorted(set(chosen) & _SM120_FORBIDDEN_BACKENDS)
    if sm120 and bad:
        return CheckResult(
            name,
            "fail",
            f"attention backend {', '.join(bad)} is not supported on SM120 for Qwen3.6 (hybrid GDN); "
            "use flashinfer (default here) or triton",
        )
    return CheckResult(name, "pass", f"attention backend: {', '.join(chosen) or 'engine default'}")


def read_engine_flags(settings: Settings, timeout_s: float = 300.0) -> set[str] | str:
    """The flags the installed engine lists in `--help`, or why they could not be read."""
    cmd = help_command(settings)
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False)
    except FileNotFoundError:
        return f"{cmd[0]!r} not found; set DATAGEN_ENGINE_PYTHON to the engine's interpreter"
    except subprocess.TimeoutExpired:
        return f"`{' '.join(cmd)}` did not finish within {timeout_s:.0f} s"
    flags = parse_help_flags(proc.stdout)
    if proc.returncode != 0 or not flags:
        tail = "\n".join((proc.stderr or proc.stdout).splitlines()[-10:])
        return f"`{' '.join(cmd)}` exited with {proc.returncode}:\n{tail}"
    return flags


def server_flag_checks(settings: Settings, spec: RunSpec) -> list[CheckResult]:
    """Check the launch flags of this run against the installed engine (and the GPU architecture)."""
    # The key's value is irrelevant here and must not appear in any report.
    args = launch_flags(settings, spec, settings.base_port, "***")
    backend = check_attention_backend(args, settings.allowed_compute_capabilities)
    known = read_engine_flags(settings)
    if isinstance(known, str):
        return [CheckResult("engine.server_flags", "fail", f"cannot read the engine's flags: {known}"), backend]
    return [check_flags(args, known, "sglang" if settings.engine == "sglang" else "the stand-in"), backend]
