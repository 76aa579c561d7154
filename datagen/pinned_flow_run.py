"""A flow run as `datagen.worker` starts it: the pinned pull steps and entrypoint, never the API's.

    PREFECT__FLOW_RUN_ID=<id> python -m datagen.pinned_flow_run

This is `python -m prefect.engine` with one difference: the flow is loaded from the pin file on the box
(datagen/operations/deploy_pin.py), after checking once more that the API's deployment still matches it (it may have
changed between the worker's check and this process's start). The pull steps run are the pinned ones.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, cast
from uuid import UUID

__all__ = ["main"]


def main() -> int:
    """Run the flow run named by PREFECT__FLOW_RUN_ID from the pinned definition."""
    from prefect._internal.control_listener import configure_from_env
    from prefect._internal.metrics import RunMetrics
    from prefect.deployments.steps.core import run_steps
    from prefect.engine import _drive_run_flow_result, handle_engine_signals
    from prefect.flow_engine import load_flow_run, run_flow
    from prefect.flows import load_flow_from_entrypoint
    from prefect.logging.loggers import flow_run_logger
    from prefect.utilities.asyncutils import run_coro_as_sync

    from datagen.operations.deploy_pin import PinMismatch, default_pin_path, deployment_changes, read_pin

    flow_run_id = UUID(os.environ["PREFECT__FLOW_RUN_ID"])
    configure_from_env()
    with handle_engine_signals(flow_run_id):
        flow_run = load_flow_run(flow_run_id=flow_run_id)
        logger = flow_run_logger(flow_run=flow_run)
        try:
            pin = read_pin(default_pin_path())
            pinned = pin.deployments.get(str(flow_run.deployment_id))
            if pinned is None:
                raise PinMismatch(f"deployment {flow_run.deployment_id} is not pinned on this box")
            deployment = _read_deployment(flow_run.deployment_id)
            changes = deployment_changes(
                pin, pinned.id, deployment.entrypoint, deployment.pull_steps, deployment.parameter_openapi_schema
            )
            if changes:
                raise PinMismatch("; ".join(changes))
        except PinMismatch as exc:
            reason = f"refused by this box's pin ({default_pin_path()}): {exc}. Nothing of the changed definition ran"
            logger.error(reason)
            _fail(flow_run_id, reason)
            return 1
        run_coro_as_sync(run_steps(pinned.pull_steps, print_function=lambda *_a, **_k: None))
        flow: Any = load_flow_from_entrypoint(pinned.entrypoint, use_placeholder_flow=False)
        with RunMetrics(flow_run, flow):
            _drive_run_flow_result(flow, run_flow(flow, flow_run=flow_run, error_logger=cast(logging.Logger, logger)))
    return 0


def _read_deployment(deployment_id: UUID | None) -> Any:
    from prefect.client.orchestration import get_client

    if deployment_id is None:
        raise ValueError("the flow run has no deployment")
    with get_client(sync_client=True) as client:
        return client.read_deployment(deployment_id)


def _fail(flow_run_id: UUID, reason: str) -> None:
    from prefect.client.orchestration import get_client
    from prefect.states import Failed

    with get_client(sync_client=True) as client:
        client.set_flow_run_state(flow_run_id, Failed(message=reason), force=True)


if __name__ == "__main__":
    sys.exit(main())
