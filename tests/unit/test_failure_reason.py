"""A failed run's one line (datagen.operations.failure): the reason's wording, one traceback per exception, the
report's links."""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest
from prefect.settings import PREFECT_UI_URL, temporary_settings

from datagen.checks import CheckResult
from datagen.checks.quality import QualityGateError, TokenDistribution, ValidationSummary, check_quality_gate
from datagen.engine.launcher import ServerStartError
from datagen.operations.failure import Failure, OnceTraceback, reason, report_markdown
from datagen.publishing.storage import StorageUnreachable
from datagen.runspec import QualityGate
from tasks.environment import EnvironmentCheckFailed, raise_if_failed


def test_a_failed_gate_is_one_line_with_each_failed_check() -> None:
    # The placeholder incident: 870 of 1000 answers are 6 tokens long.
    n = 1000
    summary = ValidationSummary(total=n, accepted=n, loss_tokens=TokenDistribution(counts={6: 870, 900: 130}))
    summary.accepted_by_source = {"sharegpt": n}
    gate = check_quality_gate(summary, QualityGate())
    with pytest.raises(QualityGateError) as err:
        gate.raise_if_failed()
    line = reason(err.value)
    failed = [c.name for c in gate.checks if not c.passed]
    assert line.startswith(f"{len(failed)} of {len(gate.checks)} checks failed: short_share: "), line
    assert all(f"{name}: " in line for name in failed) and "\n" not in line, line
    assert "validation-report" not in line  # the multi-line summary stays the task's own message


def test_failed_environment_checks_are_named_on_one_line() -> None:
    results = [
        CheckResult("model_dir.exists", "fail", "/models/x is not a directory"),
        CheckResult("s3.credentials", "pass", "ok"),
        CheckResult("engine.attention_backend", "fail", "fa3 needs SM90\nuse flashinfer"),
    ]
    with pytest.raises(EnvironmentCheckFailed) as err:
        raise_if_failed(results)
    assert reason(err.value) == (
        "2 of 3 environment checks failed: model_dir.exists: /models/x is not a directory; "
        "engine.attention_backend: fa3 needs SM90 | use flashinfer"
    )
    raise_if_failed(results[1:2])  # all passed: nothing raised


def test_ours_speak_for_themselves_others_say_their_type_and_long_ones_are_clipped(tmp_path: Path) -> None:
    ours = StorageUnreachable("S3 endpoint http://127.0.0.1:9 is unreachable\nduring put")
    assert reason(ours, tmp_path) == "S3 endpoint http://127.0.0.1:9 is unreachable during put"
    assert reason(KeyError("spec"), tmp_path) == "KeyError: 'spec'"
    assert reason(RuntimeError(), tmp_path) == "RuntimeError"
    long = reason(ValueError("x" * 1000), tmp_path)
    assert len(long) == 300 and long.endswith("…")


def test_a_server_that_died_is_named_with_the_last_error_of_its_log() -> None:
    tail = ["loading weights", "AssertionError: Only flashinfer backends are supported. Got fa3", "sigquit"]
    exc = ServerStartError("gpu0", "exited with code 1 during startup", Path("/work/logs/server-0.log"), tail)
    assert reason(exc) == (
        "server gpu0 exited with code 1 during startup: AssertionError: Only flashinfer backends are supported. Got fa3"
    )
    assert "/work/logs/server-0.log" in str(exc)  # the full text (the artifact's) keeps the log's path and tail


def test_each_exception_keeps_its_first_traceback_only(caplog: pytest.LogCaptureFixture) -> None:
    logger = logging.getLogger("datagen.test.once")
    logger.addFilter(OnceTraceback())
    first, second = ValueError("shard 3"), ValueError("shard 4")
    with caplog.at_level(logging.INFO, logger="datagen.test.once"):
        for exc in (first, first, second, first):
            logger.error("failed: %s", exc, exc_info=exc)
    records = [r for r in caplog.records if r.name == "datagen.test.once"]
    assert [r.getMessage() for r in records] == [
        "failed: shard 3",
        "failed: shard 3",
        "failed: shard 4",
        "failed: shard 3",
    ]
    assert [r.exc_info is not None for r in records] == [True, False, True, False]


def test_a_failed_task_says_it_once(caplog: pytest.LogCaptureFixture) -> None:
    # As Prefect's task engine logs a failure: the exception with its traceback, then "Finished in state Failed".
    logger = logging.getLogger("datagen.test.task")
    logger.addFilter(OnceTraceback())
    exc = RuntimeError("gate")
    with caplog.at_level(logging.INFO, logger="datagen.test.task"):
        logger.info("Finished in state Completed()", extra={"task_run_id": "a"})
        logger.info("Finished in state Failed('not logged before')", extra={"task_run_id": "b"})
        logger.error("Task run failed with exception: %r", exc, exc_info=exc, extra={"task_run_id": "c"})
        logger.error(
            "Finished in state Failed('Task run encountered an exception RuntimeError: gate')",
            extra={"task_run_id": "c"},
        )
    messages = [r.getMessage() for r in caplog.records if r.name == "datagen.test.task"]
    assert messages == [
        "Finished in state Completed()",
        "Finished in state Failed('not logged before')",
        "Task run failed with exception: RuntimeError('gate')",
    ]


@dataclass
class _Artifact:
    id: uuid.UUID
    key: str
    description: str


@dataclass
class _Run:
    id: uuid.UUID
    name: str


def test_report_links_the_run_the_task_and_every_artifact_in_the_v2_ui() -> None:
    run, task_run_id = _Run(uuid.uuid4(), "expand ns · calm-fox"), uuid.uuid4()
    validation = _Artifact(uuid.uuid4(), "validation-report", "Validation of ns")
    failure = Failure(reason="1 of 4 checks failed: x", task="quality gate", task_run_id=task_run_id)
    exc = QualityGateError("quality gate FAILED (1 check(s))\n- x: y")
    with temporary_settings({PREFECT_UI_URL: "http://box:4200/v2"}):
        md = report_markdown(failure, exc, run, [validation])
    assert md.startswith("# quality gate failed: 1 of 4 checks failed: x\n"), md
    assert f"| Failing task | [quality gate](http://box:4200/v2/runs/task-run/{task_run_id}) |" in md
    assert f"| Run | [expand ns · calm-fox](http://box:4200/v2/runs/flow-run/{run.id}) |" in md
    assert f"- [validation-report](http://box:4200/v2/artifacts/artifact/{validation.id}): Validation of ns" in md
    assert f"[the run log](http://box:4200/v2/runs/flow-run/{run.id}?tab=Logs)" in md
    assert "quality gate FAILED (1 check(s))\n- x: y" in md  # the whole error
    wide = report_markdown(failure, ValueError("word " * 60), run, [])
    assert max(len(line) for line in wide.split("```text")[1].splitlines()) <= 76  # wrapped, not scrolled
    # No UI URL known (a local run): names, not links.
    with temporary_settings({PREFECT_UI_URL: ""}):
        md = report_markdown(Failure(reason="r", flow="pilot"), exc, run, [validation])
    assert md.startswith("# pilot failed outside its tasks: r\n") and "http" not in md, md
