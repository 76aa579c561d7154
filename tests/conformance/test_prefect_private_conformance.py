"""The Prefect internals datagen's worker is built on are the ones it was written against (issue 49).

`datagen/worker.py` and `datagen/pinned_flow_run.py` start flow runs the way Prefect 3.9.1's own process worker and
`python -m prefect.engine` do, with a pinned command and entrypoint instead of the API's (docs/security.md, "The
worker runs only what the operator pinned"). Prefect has no public interface for that: they use its private
modules (`prefect.runner._flow_run_executor`, `_process_manager`, `_starter_engine`, `prefect._internal.*`) and
private functions of public ones (`prefect.engine._drive_run_flow_result`), and `DatagenWorker.run` mirrors
`ProcessWorker.run`. Any change there, in any upgrade, may change what runs on the box or how a run ends, so these
files are pinned by their hashes: a changed file fails here, naming what datagen uses from it. Read the change,
adapt the worker, run tests/e2e/test_security_operator.py and test_security_prefect.py, then record the new hash.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
from pathlib import Path

import prefect
import pytest

PREFECT_VERSION = "3.9.1"

# module -> (sha256 of its source in Prefect 3.9.1, what datagen uses from it, where)
PRIVATE_MODULES: dict[str, tuple[str, tuple[str, ...], str]] = {
    "prefect.runner._flow_run_executor": (
        "be01095b6cc2143f1e959672b0dab29faf8381e8ae5ede6f33710cff7dd3bd07",
        ("FlowRunExecutorContext", "FlowRunExecutionResult"),
        "datagen/worker.py: DatagenWorker.run",
    ),
    "prefect.runner._process_manager": (
        "b574a10def3175782c62ffdbfd63e9f178f12cf207801412d01ec0b46fc22cff",
        ("ProcessHandle",),
        "datagen/worker.py: DatagenWorker.run",
    ),
    "prefect.runner._starter_engine": (
        "f6a90c9656fef60a136fd4a8501d6994ad52db31fefa3932a83edbb7a4e882e4",
        ("EngineCommandStarter",),
        "datagen/worker.py: DatagenWorker.run",
    ),
    "prefect._internal.control_listener": (
        "9dc7985d0b7ba44616e7bf065a28be5183fe10bc96259548461af544ed2b0764",
        ("configure_from_env",),
        "datagen/pinned_flow_run.py: main",
    ),
    "prefect._internal.metrics": (
        "7b4df7f9de0b31a455d527566e706886abedfe640071903d477a4b40c1fcaa80",
        ("RunMetrics",),
        "datagen/pinned_flow_run.py: main",
    ),
    "prefect.engine": (
        "b8cdbed3c4c320f7fd4482caae0d07cdcf73ba109bb4f0e8f424232b0ff573eb",
        ("_drive_run_flow_result", "handle_engine_signals"),
        "datagen/pinned_flow_run.py: main (as `python -m prefect.engine` runs a flow run)",
    ),
    "prefect.workers.process": (
        "58c9118b6816184bca6263d827d2bda85888baf6804fee68e08a4834466d58a2",
        ("ProcessWorker", "ProcessJobConfiguration", "ProcessWorkerResult"),
        "datagen/worker.py: DatagenWorker.run mirrors ProcessWorker.run",
    ),
}

# The parameters datagen passes, by name: a renamed or removed one fails here before it fails on a box.
STARTER = ("command", "cwd", "env", "stream_output", "control_channel")
EXECUTOR = ("flow_run", "starter", "resolve_flow", "propose_submitting")
CALLS: list[tuple[str, str, tuple[str, ...]]] = [
    ("prefect.runner._starter_engine", "EngineCommandStarter", STARTER),
    ("prefect.runner._flow_run_executor", "FlowRunExecutorContext.create_executor", EXECUTOR),
    ("prefect.runner._flow_run_executor", "FlowRunExecutor.submit", ("task_status",)),
    ("prefect._internal.metrics", "RunMetrics", ("flow_run", "flow")),
    ("prefect.engine", "handle_engine_signals", ("flow_run_id",)),
    ("prefect.engine", "_drive_run_flow_result", ()),
    ("prefect._internal.control_listener", "configure_from_env", ()),
]


def _sha256(module: str) -> str:
    path = Path(inspect.getfile(importlib.import_module(module)))
    return hashlib.sha256(path.read_bytes()).hexdigest()


def test_prefect_is_the_version_the_worker_was_written_against() -> None:
    assert prefect.__version__ == PREFECT_VERSION, (
        f"Prefect {prefect.__version__} is installed; datagen's worker builds on Prefect {PREFECT_VERSION}'s private "
        f"modules ({', '.join(PRIVATE_MODULES)}): check each below before changing the pin in pyproject.toml"
    )


@pytest.mark.parametrize("module", sorted(PRIVATE_MODULES))
def test_each_private_module_is_unchanged(module: str) -> None:
    expected, names, where = PRIVATE_MODULES[module]
    imported = importlib.import_module(module)
    missing = [name for name in names if not hasattr(imported, name)]
    assert not missing, f"{module} no longer has {missing}, which {where} uses"
    actual = _sha256(module)
    assert actual == expected, (
        f"{module} changed (sha256 {actual}, written against {expected}): {where} uses {', '.join(names)}. "
        "Read the change, adapt the worker, run tests/e2e/test_security_operator.py, then record the new hash here."
    )


@pytest.mark.parametrize(("module", "qualname", "params"), CALLS, ids=[f"{m}.{q}" for m, q, _ in CALLS])
def test_the_calls_datagen_makes_still_fit(module: str, qualname: str, params: tuple[str, ...]) -> None:
    target: object = importlib.import_module(module)
    for part in qualname.split("."):
        target = getattr(target, part)
    assert callable(target), qualname
    signature = inspect.signature(target)
    missing = [p for p in params if p not in signature.parameters]
    assert not missing, f"{module}.{qualname}{signature} has no {missing}: datagen passes them by name"


def test_the_worker_imports_what_is_pinned_here() -> None:
    # Every private Prefect module the worker's files import is listed above (a new one must be pinned too).
    root = Path(__file__).resolve().parents[2]
    imported: set[str] = set()
    for source in ("datagen/worker.py", "datagen/pinned_flow_run.py"):
        for line in (root / source).read_text().splitlines():
            words = line.split()
            if len(words) >= 2 and words[0] == "from" and ("._" in words[1] or words[1].startswith("prefect._")):
                imported.add(words[1])
    assert imported, "no private imports found: the worker was moved off them; remove this file's pins"
    assert imported <= set(PRIVATE_MODULES), sorted(imported - set(PRIVATE_MODULES))
