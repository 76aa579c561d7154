import os
import tempfile
from pathlib import Path

# Shared fixtures live in their own modules; this file only makes them visible to every test.
from tests.conversation_fixtures import *  # noqa: F403
from tests.flow_fixtures import *  # noqa: F403
from tests.s3_fixtures import *  # noqa: F403

# Tests read prompts from pytest's temporary directories and models from the fixture cache or a temporary copy:
# those are this machine's roots (set here, so workers and flows started by tests inherit them). A box keeps
# the defaults or names its own (README, Settings); tests/e2e/test_security_runtime.py passes narrower ones.
_REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DATAGEN_DATA_ROOTS", os.pathsep.join([str(_REPO / "data"), tempfile.gettempdir()]))
os.environ.setdefault(
    "DATAGEN_MODEL_ROOTS", os.pathsep.join(["/dev/shm", str(Path.home() / ".cache" / "datagen"), tempfile.gettempdir()])
)
