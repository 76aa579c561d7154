"""Every test file lives in tests/unit, tests/e2e or tests/conformance: pyproject's testpaths collect only those."""

from __future__ import annotations

from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def test_no_test_file_sits_outside_the_three_test_folders() -> None:
    stray = sorted(p.relative_to(TESTS.parent).as_posix() for p in TESTS.glob("test_*.py"))
    assert stray == [], (
        f"{stray} would never run: move each into tests/unit (no servers, in-process fakes) or tests/e2e "
        "(real processes: stand-ins, S3, Prefect)"
    )
