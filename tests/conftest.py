import os
import tempfile
from pathlib import Path

import pytest

# Shared fixtures live in their own modules; this file only makes them visible to every test.
from tests.conversation_fixtures import *  # noqa: F403
from tests.flow_fixtures import *  # noqa: F403
from tests.prefect_fixtures import session_prefect_server  # noqa: F401
from tests.s3_fixtures import *  # noqa: F403

# Tests read prompts from pytest's temporary directories and models from the fixture cache or a temporary copy:
# those are this machine's roots (set here, so workers and flows started by tests inherit them). A box keeps
# the defaults or names its own (README, Settings); tests/e2e/test_security_runtime.py passes narrower ones.
_REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DATAGEN_DATA_ROOTS", os.pathsep.join([str(_REPO / "data"), tempfile.gettempdir()]))
os.environ.setdefault(
    "DATAGEN_MODEL_ROOTS", os.pathsep.join(["/dev/shm", str(Path.home() / ".cache" / "datagen"), tempfile.gettempdir()])
)


# infra/test.sh runs the suite in parallel processes, one file at a time per process (pytest-xdist, --dist loadfile,
# --no-loadscope-reorder): files are handed out in collection order. These files take longest (measured in the
# 3-process run, slowest first, docs/testing.md); starting them first leaves only short files for the end, so no
# process runs a long file alone while the others are idle. A file not named here keeps its place after them.
# Serial runs are unaffected in what they test; only the order changes.
LONG_FILES_FIRST = (
    "tests/e2e/test_runs_on_boxes.py",  # one box and two boxes: expansions, same rows, runs started together
    "tests/e2e/test_multi_box.py",  # both turn modes' multi-box runs, one after the other
    "tests/e2e/test_prefect_deploy.py",
    "tests/e2e/test_publish_resume.py",
    "tests/e2e/test_ui_browser.py",
    "tests/e2e/test_crash_resume.py",
    "tests/e2e/test_generation.py",
    "tests/e2e/test_security_prefect.py",
    "tests/e2e/test_flow_e2e.py",
    "tests/e2e/test_cli_errors.py",
    "tests/e2e/test_provisioning.py",
    "tests/e2e/test_pilot.py",
    "tests/e2e/test_flow_bad_input.py",
    "tests/e2e/test_expansion.py",
    "tests/e2e/test_prompt_identity.py",
    "tests/e2e/test_before_issue47.py",
    "tests/e2e/test_serving.py",
    "tests/e2e/test_conversation_export.py",
)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Put the items of LONG_FILES_FIRST first, in that order; the rest keep their collection order."""
    rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
    last = len(LONG_FILES_FIRST)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], last))
