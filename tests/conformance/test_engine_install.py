"""The engine venv as documented is installable as pinned: checked against the real wheel's own metadata."""

from __future__ import annotations

import tomllib

from packaging.requirements import Requirement

from tests.conformance.conftest import REPO_ROOT, SGLANG_VERSION, RealSglang


def _exact_pins(requirements: list[str]) -> dict[str, str]:
    pins: dict[str, str] = {}
    for text in requirements:
        req = Requirement(text)
        specs = list(req.specifier)
        if req.marker is None and len(specs) == 1 and specs[0].operator == "==":
            pins[req.name.lower().replace("_", "-")] = specs[0].version
    return pins


def _wheel_metadata(real_sglang: RealSglang) -> tuple[list[str], list[str]]:
    info = real_sglang.site / f"sglang-{SGLANG_VERSION}.dist-info"
    metadata = (info / "METADATA").read_text(encoding="utf-8").splitlines()
    requires = [line.split(":", 1)[1].strip() for line in metadata if line.startswith("Requires-Dist:")]
    tags = [
        line.split(":", 1)[1].strip() for line in (info / "WHEEL").read_text().splitlines() if line.startswith("Tag:")
    ]
    return requires, tags


def test_engine_requirements_pin_the_release_the_tier_checks() -> None:
    lines = (REPO_ROOT / "infra" / "engine-requirements.txt").read_text(encoding="utf-8").splitlines()
    wanted = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert wanted == [f"sglang=={SGLANG_VERSION}"]


def test_readme_says_what_the_engine_venv_needs(real_sglang: RealSglang) -> None:
    """CPython 3.11 (the only wheel tag) and sglang's own torch pin, as the wheel declares them."""
    requires, tags = _wheel_metadata(real_sglang)
    assert tags == ["cp311-cp311-manylinux_2_34_x86_64"]
    torch = _exact_pins([r for r in requires if ";" not in r])["torch"]
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "CPython **3.11**" in readme
    assert f"torch=={torch}" in readme
    assert "infra/engine-requirements.txt" in readme


def test_no_extra_puts_sglang_into_the_pipelines_venv(real_sglang: RealSglang) -> None:
    """sglang's exact pins clash with the pipeline's, so an extra holding sglang could never install as pinned."""
    requires, _ = _wheel_metadata(real_sglang)
    engine_pins = _exact_pins([r for r in requires if ";" not in r and "extra ==" not in r])
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core_pins = _exact_pins(project["dependencies"])
    clashes = {
        n: (core_pins[n], engine_pins[n])
        for n in core_pins.keys() & engine_pins.keys()
        if core_pins[n] != engine_pins[n]
    }
    assert clashes  # e.g. transformers 5.24.0 here vs 5.19.0 in sglang 0.5.23: one venv cannot hold both
    for extra, reqs in project.get("optional-dependencies", {}).items():
        names = {Requirement(r).name.lower() for r in reqs}
        assert not names & {"sglang", "torch"}, f"extra [{extra}] would clash with the core pins: {clashes}"
