"""The conformance tier itself: the real wheel is what runs, and its stubs stay out of the pytest process."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

from tests.conformance.conftest import REPO_ROOT, SGLANG_VERSION, RealSglang


def test_real_wheel_is_the_pinned_release(real_sglang: RealSglang) -> None:
    """The code under judgement is sglang 0.5.23 from the registry, imported from the cached install."""
    got = real_sglang.run(
        "import sglang, sglang.srt.server_args as sa\nRESULT = {'version': sglang.__version__, 'file': sa.__file__}\n"
    )
    assert got["version"] == SGLANG_VERSION
    assert got["file"].startswith(str(real_sglang.site))


def test_heavy_modules_are_stubs_only_in_the_subprocess(real_sglang: RealSglang) -> None:
    """torch is a stub in the tier's subprocess and absent (never a stub) in the pytest process."""
    got = real_sglang.run("import torch\nRESULT = torch.__file__\n")
    assert got.startswith("<conformance stub")
    leaked = [n for n, m in list(sys.modules.items()) if str(getattr(m, "__file__", "")).startswith("<conformance")]
    assert leaked == []


def test_real_exceptions_come_back_as_data(real_sglang: RealSglang) -> None:
    """A failure inside real code is reported with its type and message, not swallowed."""
    report = real_sglang.run_raw("import sglang.srt.server_args as sa\nsa.get_global_server_args()\n")
    assert report["ok"] is False
    assert report["error_type"] == "RuntimeError"
    assert "retired" in report["error"]


def _run_tier_offline(tmp_path: Path, required: bool) -> subprocess.CompletedProcess[str]:
    """Run one tier test in a fresh pytest with an empty cache and a package index that refuses connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # nothing listens here once the socket is closed
    env = dict(os.environ)
    env.update(
        DATAGEN_CONFORMANCE_DIR=str(tmp_path / "empty-cache"),
        PIP_INDEX_URL=f"http://127.0.0.1:{closed_port}/simple/",
        PIP_RETRIES="0",
        PIP_DEFAULT_TIMEOUT="5",
    )
    env.pop("DATAGEN_CONFORMANCE_REQUIRED", None)
    if required:
        env["DATAGEN_CONFORMANCE_REQUIRED"] = "1"
    test = f"{Path(__file__).resolve()}::test_real_wheel_is_the_pinned_release"
    cmd = [sys.executable, "-m", "pytest", test, "-q", "-rs", "-p", "no:cacheprovider"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=300, check=False)


def test_without_a_registry_the_tier_is_skipped_loudly_never_passed(tmp_path: Path) -> None:
    """No cache and no reachable index: SKIPPED with the reason; with DATAGEN_CONFORMANCE_REQUIRED=1, failed."""
    skipped = _run_tier_offline(tmp_path, required=False)
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    assert "1 skipped" in skipped.stdout and "passed" not in skipped.stdout
    assert "CONFORMANCE TIER NOT RUN: sglang==0.5.23 cannot be installed, the registry is unreachable" in skipped.stdout
    failed = _run_tier_offline(tmp_path, required=True)
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert "DATAGEN_CONFORMANCE_REQUIRED=1" in failed.stdout
