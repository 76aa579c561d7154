"""Every test file lives under one of pyproject's testpaths (tests/unit, e2e, conformance, consumers)."""

from __future__ import annotations

import tomllib
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
REPO = TESTS.parent


def test_no_test_file_sits_outside_the_collected_folders() -> None:
    testpaths = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["pytest"]["ini_options"][
        "testpaths"
    ]
    collected = [REPO / p for p in testpaths]
    stray = sorted(
        p.relative_to(REPO).as_posix()
        for p in TESTS.rglob("test_*.py")
        if not any(folder in p.parents for folder in collected)
    )
    assert stray == [], (
        f"{stray} would never run: move each into tests/unit (no servers, in-process fakes) or tests/e2e "
        f"(real processes: stand-ins, S3, Prefect), or add its folder to pyproject's testpaths ({testpaths})"
    )


def test_no_two_test_files_share_a_name() -> None:
    # The folders have no __init__.py, so pytest imports each test file as a top-level module by its basename: a
    # second file of the same name aborts collection of the whole suite ("import file mismatch"), as CI saw once.
    by_name: dict[str, list[str]] = {}
    for p in TESTS.rglob("test_*.py"):
        by_name.setdefault(p.name, []).append(p.relative_to(REPO).as_posix())
    clashes = {name: sorted(paths) for name, paths in by_name.items() if len(paths) > 1}
    assert clashes == {}, f"test files sharing a module name (rename one of each): {clashes}"
