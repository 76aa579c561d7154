"""Why a run failed, where a person looks first: the failing task and a short reason as the run's state message.

Every deployed flow's body is one call, `return failure.reported(body, ...)`. When `body` raises:

- the run ends Failed with a one-line state message, `<task> failed: <reason>; see the run-failure artifact`
  (the run list, the run page's Details tab, `prefect flow-run inspect` and the alert show it). The task is the
  one whose Prefect task engine the exception's traceback passes through (the task that raised it); the
  reason is the exception's `headline` when it has one, else its own words on one line (`reason`).
- a `run-failure` markdown artifact holds the long report: the exception's full text and links a browser opens
  (the run, the failing task run, every other artifact of the run); a worker-local path is never the only pointer.
- the traceback is in the run's log once. Prefect logs a failed task's exception with its traceback at the
  task, then its "Finished in state Failed(...)" line, and, when the flow raises it, again with the traceback at
  the flow ("Encountered exception during execution") and when the engine exits ("Engine execution exited with
  unexpected exception"): 3 tracebacks (2 for a failure outside a task). The flow no longer raises (it returns
  its Failed state), and `OnceTraceback` keeps the first traceback of each exception object, dropping it from
  later records (their message lines stay) and dropping the failed task's repeated "Finished in state" line.

The flow's Failed state keeps the exception as its data, so a caller of the flow (the CLI, a test) still gets
the original exception raised, and the on-failure alert reads the same description from it (`of_state`).
"""

from __future__ import annotations

import logging
import textwrap
import traceback
from collections.abc import Callable, Iterator
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ParamSpec, TypeVar, cast
from uuid import UUID

__all__ = [
    "ARTIFACT_KEY",
    "Failure",
    "OnceTraceback",
    "describe",
    "failing_task",
    "of_state",
    "reason",
    "report_markdown",
    "report_url",
    "reported",
]

P = ParamSpec("P")
R = TypeVar("R")

ARTIFACT_KEY = "run-failure"
MAX_REASON_CHARS = 300
_LOGGED = "_datagen_traceback_logged"  # set on an exception once a log record carried its traceback
_OURS = ("datagen.", "tasks.", "flows.")  # our exceptions' messages say what to fix; others need their type


@dataclass(frozen=True, slots=True)
class Failure:
    """What failed (a task, or the flow outside its tasks) and a one-line reason."""

    reason: str
    task: str | None = None  # the task run's name as the UI lists it ("quality gate", "generate shard-00003")
    task_run_id: UUID | None = None
    flow: str = "the flow"

    @property
    def line(self) -> str:
        """The run's state message (without the pointer to the artifact)."""
        where = f"{self.task} failed" if self.task else f"{self.flow} failed outside its tasks"
        return f"{where}: {self.reason}"


def reason(exc: BaseException, work_dir: Path | None = None) -> str:
    """One line for a failed run: the error's own words (ours name what to fix), its type when it is not ours.

    An exception's `headline` (a short form of a long report) wins; otherwise the first line of its message,
    with the `- item` lines under it joined by "; " (other lines after a space). A full disk names its path.
    """
    from datagen.operations.diskspace import full_disk_message

    disk = full_disk_message(exc, work_dir or Path.cwd())
    if disk is not None:
        return disk  # whole: it says what to do
    headline = getattr(exc, "headline", None)
    if isinstance(headline, str) and headline.strip():
        text = " ".join(headline.split())
    else:
        lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
        text = lines[0] if lines else ""
        bullets = [line[2:].strip() for line in lines[1:] if line.startswith("- ")]
        others = [line for line in lines[1:] if not line.startswith("- ")]
        if bullets:
            text = text.rstrip(":") + ": " + "; ".join(bullets)
        if others:
            text += " " + " ".join(others)
        text = " ".join(text.split())
        if not text or not type(exc).__module__.startswith(_OURS):
            text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 1] + "…"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def failing_task(exc: BaseException) -> tuple[str, UUID] | None:
    """(name, task run id) of the task that raised `exc`, from the Prefect task engine in its traceback; else None.

    The innermost engine of the first exception on the cause/context chain that passed through one. The name is
    the task run's when the task names its runs ("generate shard-00003"), else the task's ("quality gate").
    """
    from prefect.task_engine import BaseTaskRunEngine

    for current in _chain(exc):
        engine: BaseTaskRunEngine[Any, Any] | None = None
        for frame, _ in traceback.walk_tb(current.__traceback__):
            for local in ("self", "engine"):
                candidate = frame.f_locals.get(local)
                if isinstance(candidate, BaseTaskRunEngine) and candidate.task_run is not None:
                    engine = candidate  # walk_tb goes outermost first: the last one found is the innermost
        if engine is not None and engine.task_run is not None:
            name = engine.task_run.name if engine.task.task_run_name else engine.task.name
            return name, engine.task_run.id
    return None


def describe(exc: BaseException, flow: str = "the flow", work_dir: Path | None = None) -> Failure:
    """The failing task (if a task raised it) and the one-line reason of `exc`."""
    task = failing_task(exc)
    return Failure(
        reason=reason(exc, work_dir), task=task[0] if task else None, task_run_id=task[1] if task else None, flow=flow
    )


def of_state(state: Any, flow: str = "the flow") -> Failure | None:
    """The failure behind a Failed state, when its exception is at hand (in the process that ran the flow)."""
    from prefect.exceptions import CancelledRun, CrashedRun, FailedRun
    from prefect.states import get_state_exception

    try:
        exc = get_state_exception(state)
    except Exception:
        return None
    if not isinstance(exc, BaseException) or isinstance(exc, FailedRun | CrashedRun | CancelledRun):
        return None  # only the state's message, wrapped by Prefect: nothing more to say than the message
    return describe(exc, flow)


class OnceTraceback(logging.Filter):
    """Keeps the first traceback of each exception in the log: later records about it keep only their message.

    A task run whose failure was just logged with its traceback also drops its "Finished in state Failed(...)"
    line: the same message again, without anything new.
    """

    def __init__(self) -> None:
        super().__init__()
        self._task_runs_logged: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        task_run = str(getattr(record, "task_run_id", "") or "")
        if task_run in self._task_runs_logged and str(record.msg).startswith("Finished in state Failed"):
            return False
        exc = record.exc_info[1] if record.exc_info else None
        if exc is None or record.levelno < logging.INFO:
            return True
        if getattr(exc, _LOGGED, False):
            record.exc_info = None
            record.exc_text = None
            return True
        with suppress(AttributeError, TypeError):  # one that takes no attributes is logged whole every time
            setattr(exc, _LOGGED, True)
        if task_run:
            self._task_runs_logged.add(task_run)
        return True


def _install_once_traceback() -> None:
    # Prefect's run loggers: every task's and flow's records (engine and ours) are created on these two.
    for name in ("prefect.task_runs", "prefect.flow_runs"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, OnceTraceback) for f in logger.filters):
            logger.addFilter(OnceTraceback())


def _ui_link(kind: str, obj_id: UUID | str) -> str | None:
    from prefect.settings import PREFECT_UI_URL

    base = PREFECT_UI_URL.value()
    if not base:
        return None
    paths = {"flow-run": "runs/flow-run", "task-run": "runs/task-run", "artifact": "artifacts/artifact"}
    return f"{base.rstrip('/')}/{paths[kind]}/{obj_id}"


def _md_link(text: str, url: str | None) -> str:
    return f"[{text}]({url})" if url else f"`{text}`"


def _run_artifacts(flow_run_id: UUID, key: str | None = None) -> list[Any]:
    """The run's keyed artifacts (only `key`'s versions when given)."""
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId, ArtifactFilterKey

    keys = ArtifactFilterKey(any_=[key]) if key else ArtifactFilterKey(exists_=True)
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(flow_run_id=ArtifactFilterFlowRunId(any_=[flow_run_id]), key=keys)
        )
    return list(artifacts)


def _wrapped(text: str, width: int = 76) -> list[str]:
    """A code block's lines, long ones wrapped (the UI scrolls a code block sideways instead of wrapping it)."""
    out: list[str] = []
    for line in text.splitlines() or [""]:
        out += textwrap.wrap(line, width, subsequent_indent="    ", break_on_hyphens=False) or [""]
    return out


def report_markdown(failure: Failure, exc: BaseException, flow_run: Any, artifacts: list[Any]) -> str:
    """The run-failure artifact: the one line, the links, the exception's full text."""
    run_url = _ui_link("flow-run", flow_run.id)
    task = (
        _md_link(failure.task, _ui_link("task-run", failure.task_run_id))
        if failure.task and failure.task_run_id
        else "none: it failed outside its tasks"
    )
    lines = [
        f"# {failure.line}",
        "",
        "| | |",
        "|---|---|",
        f"| Failing task | {task} |",
        f"| Run | {_md_link(str(flow_run.name), run_url)} |",
        f"| Exception | `{type(exc).__module__}.{type(exc).__name__}` |",
        "",
        "## The error, in full",
        "",
        "```text",
        *_wrapped(str(exc).replace("```", "'''") or type(exc).__name__),
        "```",
        "",
        "## Where to look",
        "",
    ]
    for artifact in sorted(artifacts, key=lambda a: str(a.key)):
        about = f": {artifact.description}" if artifact.description else ""
        lines.append(f"- {_md_link(str(artifact.key), _ui_link('artifact', artifact.id))}{about}")
    logs = f"{run_url}?tab=Logs" if run_url else None
    lines.append(f"- {_md_link('the run log', logs)}: the traceback, once")
    return "\n".join(lines) + "\n"


def report_url(flow_run_id: UUID) -> str | None:
    """The browser link of a run's run-failure artifact (its first line is the reason), if it has one."""
    found = _run_artifacts(flow_run_id, ARTIFACT_KEY)
    return _ui_link("artifact", found[0].id) if found else None


def _write_report(failure: Failure, exc: BaseException, flow_run: Any) -> bool:
    from prefect import get_run_logger
    from prefect.artifacts import create_markdown_artifact

    try:
        markdown = report_markdown(failure, exc, flow_run, _run_artifacts(flow_run.id))
        create_markdown_artifact(markdown=markdown, key=ARTIFACT_KEY, description=f"Why {flow_run.name} failed")
    except Exception as error:  # the run still fails with its one line; say why the report is missing
        get_run_logger().warning("could not write the %s artifact: %s", ARTIFACT_KEY, error)
        return False
    return True


def reported(body: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> R:
    """Run a flow's body; if it raises, fail the run with one line naming the task and reason (module docstring).

    Returns what `body` returns, or a Failed state (Prefect makes it the run's final state) holding the exception.
    """
    from prefect import get_run_logger
    from prefect.context import FlowRunContext
    from prefect.states import Failed

    _install_once_traceback()
    try:
        return body(*args, **kwargs)
    except Exception as exc:
        ctx = FlowRunContext.get()
        flow_run = ctx.flow_run if ctx else None
        failure = describe(exc, ctx.flow.name if ctx and ctx.flow else "the flow", _work_dir())
        if not getattr(exc, _LOGGED, False):  # raised outside a task: nothing has logged it yet
            get_run_logger().error("%s", failure.line, exc_info=exc)
        written = flow_run is not None and _write_report(failure, exc, flow_run)
        message = failure.line + (f"; see the {ARTIFACT_KEY} artifact" if written else "")
        return cast(R, Failed(message=message, data=exc))


def _work_dir() -> Path | None:
    from datagen.settings import Settings

    try:
        return Settings().work_dir
    except Exception:  # settings that do not load are the failure being reported, not a second one
        return None
