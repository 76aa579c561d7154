"""The conformance tier itself: the real wheel is what runs, and its stubs stay out of the pytest process."""

from __future__ import annotations

import sys

from tests.conformance.conftest import SGLANG_VERSION, RealSglang


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
