"""The engine's packages install as pinned: checked against the real wheel's own metadata."""

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


def _engine_pins(real_sglang: RealSglang) -> dict[str, str]:
    requires, _ = _wheel_metadata(real_sglang)
    return _exact_pins([r for r in requires if ";" not in r])


def test_engine_requirements_pin_the_release_the_tier_checks() -> None:
    lines = (REPO_ROOT / "infra" / "engine-requirements.txt").read_text(encoding="utf-8").splitlines()
    wanted = [ln.strip() for ln in lines if ln.strip() and not ln.lstrip().startswith("#")]
    assert wanted == [f"sglang=={SGLANG_VERSION}"]


def test_readme_says_what_the_engine_venv_needs(real_sglang: RealSglang) -> None:
    """CPython 3.11 (the only wheel tag) and sglang's own torch pin, as the wheel declares them."""
    _, tags = _wheel_metadata(real_sglang)
    assert tags == ["cp311-cp311-manylinux_2_34_x86_64"]
    torch = _engine_pins(real_sglang)["torch"]
    readme = (REPO_ROOT / "README.md").read_text(encoding="utf-8")
    assert "CPython **3.11**" in readme
    assert f"torch=={torch}" in readme
    assert "infra/engine-requirements.txt" in readme


def test_gpu_extra_installs_beside_the_core_pins(real_sglang: RealSglang) -> None:
    """Every package both pin is pinned alike, and [gpu] holds this sglang and the torch it pins."""
    engine = _engine_pins(real_sglang)
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    core = _exact_pins(project["dependencies"])
    shared = core.keys() & engine.keys()
    assert {"transformers", "tokenizers"} <= shared  # the tokenizer the pipeline renders with is the engine's
    assert {n: core[n] for n in shared} == {n: engine[n] for n in shared}
    gpu = _exact_pins(project["optional-dependencies"]["gpu"])
    assert gpu == {"sglang": SGLANG_VERSION, "torch": engine["torch"]}
