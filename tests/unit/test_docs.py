"""The docs say what the code does: the settings table against `Settings`, the Quickstart CI runs, links that resolve.

README.md is the front door (issue 48: at most 150 lines); the settings table lives in docs/settings.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from datagen.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
SETTINGS_DOC = ROOT / "docs" / "settings.md"
LINKED_DOCS = [README, ROOT / "benchmarks" / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

_LINK = re.compile(r"\]\(([^)\s]+)\)")


def _section(text: str, heading: str) -> str:
    start = text.index(heading + "\n")
    end = text.find("\n## ", start + len(heading))
    return text[start : end if end != -1 else len(text)]


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def test_readme_is_a_short_front_door() -> None:
    assert len(README.read_text(encoding="utf-8").splitlines()) <= 150


def test_the_quickstart_holds_the_command_ci_runs() -> None:
    quickstart = _section(README.read_text(encoding="utf-8"), "## Quickstart")
    block = quickstart.split("```bash\n", 1)[1].split("```", 1)[0]
    assert block.splitlines() == ["bash infra/demo.sh", "bash infra/test.sh"]
    ci = (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()
    assert "bash infra/test.sh" in ci


def test_the_settings_table_names_every_setting_and_its_default() -> None:
    table = _section(SETTINGS_DOC.read_text(encoding="utf-8"), "## `Settings`")
    documented: dict[str, str] = {}
    for line in table.splitlines():
        if not line.startswith("| `DATAGEN_"):
            continue
        names = re.findall(r"`(DATAGEN_[A-Z0-9_]+)`", line.split(" | ")[0])
        default = line.split(" | ")[1].strip()
        documented.update(dict.fromkeys(names, default))
    fields = {f"DATAGEN_{name.upper()}": info for name, info in Settings.model_fields.items()}
    assert sorted(documented) == sorted(fields)
    for env, default in documented.items():
        value = fields[env].default
        if re.fullmatch(r"\d+(\.\d+)?", default):
            assert float(default) == value, env
        elif default in ("true", "false"):
            assert (default == "true") is value, env


@pytest.mark.parametrize("doc", LINKED_DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc: Path) -> None:
    broken = []
    for target in _LINK.findall(doc.read_text(encoding="utf-8")):
        if re.match(r"[a-z]+:", target):
            continue  # a URL
        path, _, anchor = target.partition("#")
        dest = (doc.parent / path).resolve() if path else doc
        if not dest.exists():
            broken.append(target)
        elif anchor and dest.suffix == ".md":
            headings = re.findall(r"^#+ (.+)$", dest.read_text(encoding="utf-8"), re.M)
            if anchor not in {_slug(h) for h in headings}:
                broken.append(target)
    assert not broken, f"{doc.relative_to(ROOT)}: links that resolve to nothing: {broken}"
