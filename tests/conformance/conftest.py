"""Conformance tier: the project's exact outputs judged by SGLang 0.5.23's own code, with no GPU.

`real_sglang` installs the real wheel (`pip install --no-deps --target`, cached between runs) plus the
few small libraries its CLI and request layers import at module level, and runs real SGLang code in a
subprocess where torch, triton and the other GPU packages are stubs (`real_sglang_shim.py`): the stubs
never enter the pytest process, so other test files see no fake torch.

No registry reachable and no cached install: every test of the tier is SKIPPED with a reason that says
so (set DATAGEN_CONFORMANCE_REQUIRED=1 to make that a failure instead). It never passes unchecked.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shlex
import shutil
import stat
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

SGLANG_VERSION = "0.5.23"
# What sglang 0.5.23 imports at module level on the CLI, settings-resolution and request paths and is not
# in the project's venv (or is there in another version); pinned to sglang's own pins where it has one
# (openai, sentencepiece, transformers, tokenizers). Anything that needs CUDA is a stub instead.
SUPPORT_PACKAGES = (
    "msgspec==0.23.0",
    "psutil==7.2.2",
    "pybase64==1.5.1",
    "pillow==13.0.0",
    "pyzmq==27.3.0",
    "ipython==9.18.1",
    "traitlets==5.16.1",
    "aiohttp==3.14.5",
    "multidict==7.2.1",
    "yarl==1.25.1",
    "propcache==0.5.4",
    "aiohappyeyeballs==2.7.1",
    "aiosignal==1.4.0",
    "frozenlist==1.8.0",
    "sentencepiece==0.2.1",
    "loguru==0.7.3",
    "openai==2.8.0",
    "uvloop==0.23.0",
    "gguf==0.19.0",
    "distro==1.9.0",
    "partial-json-parser==0.2.1.1.post7",
    # sglang's own pins, shadowing the project's newer ones in the tier's subprocesses only.
    "transformers==5.19.0",
    "tokenizers==0.23.2",
)
SHIM = Path(__file__).with_name("real_sglang_shim.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
_MARKER = "CONFORMANCE-RESULT:"
_REQUIRED_ENV = "DATAGEN_CONFORMANCE_REQUIRED"


class RealCodeError(AssertionError):
    """Real SGLang code raised where the test expected a result; carries its traceback."""


def _cache_root() -> Path:
    env = os.environ.get("DATAGEN_CONFORMANCE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "datagen" / "conformance"


def _install_key() -> str:
    spec = json.dumps([SGLANG_VERSION, *SUPPORT_PACKAGES, sys.version_info[:2]])
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def _index_url() -> str:
    return os.environ.get("PIP_INDEX_URL") or "https://pypi.org/simple/"


def _registry_reachable() -> str | None:
    """None when the package index answers for sglang; otherwise why not."""
    url = _index_url().rstrip("/") + "/sglang/"
    try:
        resp = httpx.get(url, timeout=20.0, follow_redirects=True)
    except httpx.HTTPError as exc:
        return f"{url}: {type(exc).__name__}: {exc}"
    return None if resp.status_code < 500 else f"{url} answered {resp.status_code}"


def _skip_or_fail(reason: str) -> None:
    text = f"CONFORMANCE TIER NOT RUN: {reason}"
    if os.environ.get(_REQUIRED_ENV) == "1":
        pytest.fail(f"{text} ({_REQUIRED_ENV}=1)")
    warnings.warn(text, stacklevel=2)
    pytest.skip(text)


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    """An exclusive lock: several pytest processes on the box share one cache."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _install(target: Path) -> None:
    """pip install the pinned wheel and support packages into `target` (atomically: tmp dir, then rename)."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--quiet",
        "--disable-pip-version-check",
        "--no-deps",
        "--only-binary=:all:",
        "--target",
        str(tmp),
        f"sglang=={SGLANG_VERSION}",
        *SUPPORT_PACKAGES,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, check=False)
        if proc.returncode != 0:
            unreachable = _registry_reachable()
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            if unreachable:
                _skip_or_fail(
                    f"sglang=={SGLANG_VERSION} cannot be installed, the registry is unreachable ({unreachable})"
                )
            pytest.fail(f"installing sglang=={SGLANG_VERSION} for the conformance tier failed:\n{tail}")
        (tmp / ".complete").write_text(" ".join(cmd[cmd.index("--target") + 2 :]) + "\n")
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def ensure_install() -> Path:
    """The cached install folder, made on first use."""
    root = _cache_root()
    target = root / f"sglang-{SGLANG_VERSION}-{_install_key()}"
    if (target / ".complete").is_file():
        return target
    with _locked(root / ".install.lock"):
        if not (target / ".complete").is_file():
            shutil.rmtree(target, ignore_errors=True)
            _install(target)
    return target


@dataclass(frozen=True)
class RealSglang:
    """Real SGLang 0.5.23 code, importable in subprocesses with the GPU stack stubbed."""

    site: Path
    version: str = SGLANG_VERSION

    def env(self) -> dict[str, str]:
        """Environment of a subprocess that imports the real sglang (and this repo, for datagen's own code)."""
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(self.site), str(REPO_ROOT)])
        env["PYTHONNOUSERSITE"] = "1"
        env.setdefault("SGLANG_USE_CPU_ENGINE", "0")
        env["HF_HUB_OFFLINE"] = "1"
        env["TRANSFORMERS_OFFLINE"] = "1"
        return env

    def run_raw(
        self, code: str, args: Sequence[str] = (), timeout_s: float = 300.0, gpu: str | None = None
    ) -> dict[str, Any]:
        """Run `code` (sets global RESULT; ARGS holds `args`) next to the real sglang; the shim's report.

        The report is {"ok": True, "result": RESULT} or {"ok": False, "error_type", "error", "traceback"}.
        `gpu="sm120"` makes the stubbed `torch.cuda` report one RTX PRO 6000 (what each server sees).
        """
        env = self.env()
        if gpu is not None:
            env["CONFORMANCE_GPU"] = gpu
        proc = subprocess.run(
            [sys.executable, str(SHIM), *args],
            input=code,
            capture_output=True,
            text=True,
            env=env,
            timeout=timeout_s,
            check=False,
            cwd=REPO_ROOT,
        )
        for line in reversed(proc.stdout.splitlines()):
            if line.startswith(_MARKER):
                report: dict[str, Any] = json.loads(line[len(_MARKER) :])
                report["stderr"] = proc.stderr
                return report
        raise RealCodeError(
            f"the conformance shim printed no result (exit {proc.returncode}):\n"
            f"{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"
        )

    def run(self, code: str, args: Sequence[str] = (), timeout_s: float = 300.0, gpu: str | None = None) -> Any:
        """Like run_raw, but returns RESULT and raises RealCodeError (with the real traceback) on an exception."""
        report = self.run_raw(code, args, timeout_s, gpu)
        if not report["ok"]:
            raise RealCodeError(
                f"real sglang code raised {report['error_type']}: {report['error']}\n{report['traceback']}"
            )
        return report["result"]

    def engine_python(self, folder: Path) -> str:
        """An executable that behaves like an engine venv's `python` (scripts run with the stubs installed)."""
        wrapper = folder / "engine-python"
        pythonpath = shlex.quote(self.env()["PYTHONPATH"])
        # Servers and the flag probe get an allow-listed environment (launcher.server_env): the emulated GPU
        # is chosen when the wrapper is written, not inherited.
        gpu = os.environ.get("CONFORMANCE_GPU")
        gpu_env = f" CONFORMANCE_GPU={shlex.quote(gpu)}" if gpu else ""
        wrapper.write_text(
            f"#!/bin/sh\nexport PYTHONPATH={pythonpath} PYTHONNOUSERSITE=1 HF_HUB_OFFLINE=1{gpu_env}\n"
            f'exec {shlex.quote(sys.executable)} {shlex.quote(str(SHIM))} --script "$@"\n'
        )
        wrapper.chmod(wrapper.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
        return str(wrapper)


@pytest.fixture(scope="session")
def real_sglang() -> RealSglang:
    """SGLang 0.5.23's own code (installed once per cache key), or a loud skip when it cannot be had."""
    if sys.version_info[:2] != (3, 11):
        _skip_or_fail(f"sglang=={SGLANG_VERSION} ships for CPython 3.11 only; this is {sys.version.split()[0]}")
    return RealSglang(site=ensure_install())
