"""datagen's worker: Prefect's process worker that runs only what the box's operator pinned.

    python -m datagen.worker --pool gpu-box-1 --name gpu-worker-a [--work-queue box-a] [--limit 1]

Before a flow run executes anything, the worker reads the run's deployment and the work pool from the API and
compares them with the pin file (`datagen pin`, datagen/operations/deploy_pin.py): a change made through the API
since the pin fails the run, naming what changed, and nothing of the changed definition runs. A run that matches starts
`python -m datagen.pinned_flow_run` (the worker's fixed command; no template or job variable can give it another),
which runs the PINNED pull steps and entrypoint. Its environment is the worker's, minus the secrets its flow does
not need (`flow_run_env`). Why these hooks: docs/security.md, "The worker runs only what the operator pinned".
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import anyio
import anyio.abc
from prefect.flows import Flow, load_flow_from_entrypoint
from prefect.runner._flow_run_executor import FlowRunExecutionResult, FlowRunExecutorContext
from prefect.runner._process_manager import ProcessHandle
from prefect.runner._starter_engine import EngineCommandStarter
from prefect.states import Failed
from prefect.utilities.processutils import command_to_string
from prefect.workers.process import ProcessJobConfiguration, ProcessWorker, ProcessWorkerResult

from datagen.operations.deploy_pin import (
    DeploymentPin,
    PinFile,
    PinMismatch,
    default_pin_path,
    deployment_changes,
    pool_changes,
    read_pin,
)

if TYPE_CHECKING:
    from prefect.client.schemas.objects import FlowRun

__all__ = ["DatagenWorker", "flow_run_env", "main"]

# The flows whose tasks start SGLang servers (and so use the box's SGLang key). Every flow reads or writes S3.
SGLANG_KEY_FLOWS = frozenset(
    {
        "flows/expand_dataset.py:expand_dataset",
        "flows/pilot.py:pilot_flow",
        "flows/multi_box.py:generate_on_box",
    }
)
S3_SECRET_FLOWS = frozenset(
    SGLANG_KEY_FLOWS | {"flows/check_environment.py:check_environment", "flows/multi_box.py:expand_dataset_multibox"}
)
# Never in a flow run: the server's own auth string, the file holding it, the proxy's credential map.
_NEVER = ("PREFECT_SERVER_API_AUTH_STRING", "DATAGEN_PREFECT_AUTH_FILE", "DATAGEN_PROXY_DIR")
_OPERATOR_AUTH = "DATAGEN_OPERATOR_AUTH_STRING"


def flow_run_env(worker_env: Mapping[str, str], entrypoint: str, flow_run_id: str) -> dict[str, str]:
    """The flow run's environment: the worker's, without the secrets this entrypoint's tasks do not need."""
    env = {k: v for k, v in worker_env.items() if k not in _NEVER and k != _OPERATOR_AUTH}
    # PREFECT__* variables steer Prefect's engine (PREFECT__FLOW_ENTRYPOINT replaces the flow): only the run id.
    env = {k: v for k, v in env.items() if not k.startswith("PREFECT__")}
    if entrypoint not in SGLANG_KEY_FLOWS:
        env.pop("DATAGEN_SGLANG_API_KEY", None)
    if entrypoint not in S3_SECRET_FLOWS:
        env.pop("DATAGEN_S3_SECRET_ACCESS_KEY", None)
        env.pop("AWS_SECRET_ACCESS_KEY", None)
    env["PREFECT__FLOW_RUN_ID"] = flow_run_id
    return env


def pinned_flow_loader(home: Path, entrypoint: str) -> Any:
    """A flow resolver for Prefect's crash/cancel hooks that loads the pinned entrypoint, never the API's."""

    async def resolve(_: FlowRun) -> Flow[..., Any]:
        path, _sep, func = entrypoint.rpartition(":")
        return load_flow_from_entrypoint(f"{home / path}:{func}", use_placeholder_flow=False)

    return resolve


class DatagenWorker(ProcessWorker):
    """A process worker that checks each run against the box's pin and starts it with a fixed command."""

    type = "process"  # serves the project's process pools; only how a run starts differs

    @classmethod
    def __dispatch_key__(cls) -> str:
        # Prefect registers worker classes by this key; "process" would replace ProcessWorker in its registry.
        return "datagen-process"

    async def _pinned(self, flow_run: FlowRun) -> tuple[PinFile, DeploymentPin]:
        """The run's pinned deployment, after checking the API's deployment and pool against the pin."""
        pin = read_pin(default_pin_path())
        if flow_run.deployment_id is None:
            raise PinMismatch("the run has no deployment: this box runs only pinned deployments")
        deployment = await self.client.read_deployment(flow_run.deployment_id)
        pool = await self.client.read_work_pool(self._work_pool_name)
        changes = pool_changes(pin, pool.name, pool.base_job_template)
        changes += deployment_changes(
            pin, str(deployment.id), deployment.entrypoint, deployment.pull_steps, deployment.parameter_openapi_schema
        )
        if changes:
            raise PinMismatch("; ".join(changes))
        return pin, pin.deployments[str(deployment.id)]

    async def run(
        self,
        flow_run: FlowRun,
        configuration: ProcessJobConfiguration,
        task_status: anyio.abc.TaskStatus[int] | None = None,
    ) -> ProcessWorkerResult:
        """Check the run against the pin, then start `python -m datagen.pinned_flow_run` in DATAGEN_HOME."""
        if task_status is None:
            task_status = anyio.TASK_STATUS_IGNORED
        try:
            _, pinned = await self._pinned(flow_run)
        except PinMismatch as exc:
            reason = (
                f"refused by this box's pin ({default_pin_path()}): {exc}. Nothing of the changed definition ran; "
                "if the change is the operator's, they run `datagen pin` on the box and start the run again"
            )
            self.get_flow_run_logger(flow_run).error(reason)
            await self.client.set_flow_run_state(flow_run.id, Failed(message=reason), force=True)
            raise PinMismatch(reason) from None
        home = Path(os.environ.get("DATAGEN_HOME") or Path.cwd()).resolve()
        # The command, environment and directory come from the worker alone: no template or job variable reaches them.
        command = command_to_string([sys.executable, "-m", "datagen.pinned_flow_run"])
        env: dict[str, str | None] = dict(flow_run_env(os.environ, pinned.entrypoint, str(flow_run.id)))
        async with FlowRunExecutorContext() as ctx:
            starter = EngineCommandStarter(
                command=command,
                cwd=home,
                env=env,
                stream_output=configuration.stream_output,
                control_channel=ctx.control_channel,
            )
            executor = ctx.create_executor(
                flow_run,
                starter,
                resolve_flow=pinned_flow_loader(home, pinned.entrypoint),
                propose_submitting=False,
            )
            execution: FlowRunExecutionResult | None = None

            async def execute(*, task_status: anyio.abc.TaskStatus[ProcessHandle] = anyio.TASK_STATUS_IGNORED) -> None:
                nonlocal execution
                execution = await executor.submit(task_status=task_status)

            async with anyio.create_task_group() as task_group:
                handle = await task_group.start(execute)
                if handle.pid is None:
                    raise RuntimeError("Flow run process has no PID")
                task_status.started(handle.pid)
        if execution is None or execution.status_code is None:
            raise RuntimeError("Failed to start flow run process.")
        return ProcessWorkerResult(status_code=execution.status_code, identifier=str(execution.handle.pid))


async def _serve(args: argparse.Namespace) -> None:
    from prefect.settings import PREFECT_WORKER_HEARTBEAT_SECONDS

    worker = DatagenWorker(
        name=args.name,
        work_pool_name=args.pool,
        work_queues=args.work_queue or None,
        limit=args.limit,
        heartbeat_interval_seconds=int(PREFECT_WORKER_HEARTBEAT_SECONDS.value()),
        create_pool_if_not_found=False,
    )
    await worker.start(with_healthcheck=False, printer=print)


def main(argv: list[str] | None = None) -> int:
    """Start the worker; SIGINT stops it."""
    parser = argparse.ArgumentParser(prog="python -m datagen.worker", description=__doc__.splitlines()[0])
    parser.add_argument("--pool", required=True)
    parser.add_argument("--name", required=True)
    parser.add_argument("--work-queue", action="append", default=[])
    parser.add_argument("--limit", type=int, default=1)
    args = parser.parse_args(argv)
    try:
        read_pin(default_pin_path())
    except PinMismatch as exc:
        print(f"datagen worker: {exc}", file=sys.stderr)
        return 2
    try:
        asyncio.run(_serve(args))
    except KeyboardInterrupt:
        print(f"worker {args.name!r} stopped")
    return 0


if __name__ == "__main__":
    sys.exit(main())
