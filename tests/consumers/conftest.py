"""Consumer tier: what datagen publishes, read by the trainers' own preprocessing code (SpecForge, speculators).

`trainers` installs the pinned wheels with `pip --no-deps --target` into a cached folder (shared between
pytest processes under a file lock), beside a CPU torch and only the few libraries their preprocessing imports
that the project's venv lacks; the project's venv never gets torch. Their code runs in a subprocess
(`trainer_judge.py`) whose path holds that folder, so the pytest process imports none of it.

No registry reachable and no cached install: the tier is SKIPPED with a reason that says so (set
DATAGEN_CONFORMANCE_REQUIRED=1 to make that a failure instead). It never passes unchecked.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.conformance.conftest import _cache_root, _locked, _registry_reachable

SPECFORGE = "specforge==0.2.0"
SPECULATORS = "speculators==0.9.0"
# What their preprocessing imports and the project's venv lacks. torch 2.13.0 is a CPU build (this machine's
# pip finds it on local disk); its own imports need sympy, mpmath and networkx; speculators' package import
# pulls openai (pinned as the SGLang tier pins it, before openai needed httpx2) and hs-connectors.
SUPPORT_PACKAGES = (
    "torch==2.13.0",
    "sympy==1.14.0",
    "mpmath==1.4.1",
    "networkx==3.6.1",
    "openai==2.8.0",
    "distro==1.9.0",
    "jiter==0.19.0",
    "hs-connectors==0.9.0",
)
JUDGE = Path(__file__).with_name("trainer_judge.py")
REPO_ROOT = Path(__file__).resolve().parents[2]
_REQUIRED_ENV = "DATAGEN_CONFORMANCE_REQUIRED"


def _skip_or_fail(reason: str) -> None:
    text = f"CONSUMER TIER NOT RUN: {reason}"
    if os.environ.get(_REQUIRED_ENV) == "1":
        pytest.fail(f"{text} ({_REQUIRED_ENV}=1)")
    warnings.warn(text, stacklevel=2)
    pytest.skip(text)


def _install_key() -> str:
    spec = json.dumps([SPECFORGE, SPECULATORS, *SUPPORT_PACKAGES, sys.version_info[:2]])
    return hashlib.sha256(spec.encode()).hexdigest()[:12]


def _install(target: Path) -> float:
    """pip install the wheels into `target` atomically (tmp dir, then rename); the seconds it took."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    packages = [SPECFORGE, SPECULATORS, *SUPPORT_PACKAGES]
    cmd = [sys.executable, "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "--no-deps"]
    cmd += ["--only-binary=:all:", "--target", str(tmp), *packages]
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, check=False)
        if proc.returncode != 0:
            unreachable = _registry_reachable()
            if unreachable:
                _skip_or_fail(
                    f"{SPECFORGE} and {SPECULATORS} cannot be installed, the registry is unreachable ({unreachable})"
                )
            tail = "\n".join(proc.stderr.splitlines()[-15:])
            pytest.fail(f"installing the trainers for the consumer tier failed:\n{tail}")
        (tmp / ".complete").write_text(" ".join(packages) + "\n")
        tmp.rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return time.monotonic() - start


@dataclass(frozen=True)
class Trainers:
    """The pinned trainers' code, importable in subprocesses; `install_s` is 0 when the cache had it."""

    site: Path
    install_s: float

    def rows(self, trainer: str, model_dir: Path, namespace_dir: Path, work: Path) -> list[dict[str, Any]]:
        """The (input_ids, loss_mask) rows `trainer`'s own preprocessing derives from a downloaded namespace."""
        out = work / f"{trainer}-rows.json"
        env = dict(os.environ)
        env.update(
            PYTHONPATH=os.pathsep.join([str(self.site), str(REPO_ROOT)]),
            PYTHONNOUSERSITE="1",
            HF_HUB_OFFLINE="1",
            HF_DATASETS_OFFLINE="1",
            HF_HOME=str(work / "hf-home"),  # their datasets caches stay in the test's folder
            TOKENIZERS_PARALLELISM="false",
        )
        cmd = [sys.executable, str(JUDGE), trainer, str(model_dir), str(namespace_dir), str(out)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False, cwd=work)
        if proc.returncode != 0:
            raise AssertionError(f"{trainer}'s preprocessing failed on what we publish:\n{proc.stderr[-6000:]}")
        rows: list[dict[str, Any]] = json.loads(out.read_text())
        return rows


def ensure_trainers() -> Trainers:
    """The cached install folder, made on first use."""
    root = _cache_root()
    target = root / f"trainers-{_install_key()}"
    if (target / ".complete").is_file():
        return Trainers(site=target, install_s=0.0)
    with _locked(root / ".trainers.lock"):
        if (target / ".complete").is_file():
            return Trainers(site=target, install_s=0.0)
        shutil.rmtree(target, ignore_errors=True)
        target.parent.mkdir(parents=True, exist_ok=True)
        return Trainers(site=target, install_s=_install(target))


@pytest.fixture(scope="session")
def trainers() -> Trainers:
    """SpecForge 0.2.0 and speculators 0.9.0 (installed once per cache key), or a loud skip when they cannot be had."""
    if sys.version_info[:2] != (3, 11):
        _skip_or_fail(f"the CPU torch wheel here is for CPython 3.11; this is {sys.version.split()[0]}")
    return ensure_trainers()
