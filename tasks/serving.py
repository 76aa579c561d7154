"""One place that serves: start (or attach) the fleet, build the dispatcher with restarts wired, stop both.

    with serving(settings, spec, layout, plan_args=memory_plan.plan_args) as served:
        served.dispatcher.submit(job)     # every server was contacted once before the block starts
        served.fleet.engine_version

`expand-dataset`, `pilot` and `generate-on-box` all serve through it: a server the dispatcher marks down
(refused, dropped, hung) is restarted by the fleet (attach mode: waited for), and the dispatcher and then the
servers stop when the block ends, however it ends. Each flow computes its memory plan
(`tasks.environment.memory_plan_for`, recorded in its lineage or report) and hands the plan's flags here, so
every server of every flow, restarts included, starts with them.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from datagen.engine.dispatcher import Dispatcher
from datagen.engine.launcher import ServerFleet
from datagen.engine.memory_plan import MemoryPlan
from datagen.layout import RunLayout
from datagen.runspec import RunSpec
from datagen.settings import Settings
from tasks import provisioning

__all__ = ["Serving", "serving"]


@dataclass(frozen=True, slots=True)
class Serving:
    """The fleet and the one dispatcher that feeds it, for the length of a `serving` block."""

    fleet: ServerFleet
    dispatcher: Dispatcher


@contextmanager
def serving(
    settings: Settings,
    spec: RunSpec,
    layout: RunLayout,
    *,
    plan_args: Sequence[str] = (),
    server_plan_args: Sequence[Sequence[str]] | None = None,
    memory_plan: MemoryPlan | None = None,
    start: Callable[[ServerFleet], object] = ServerFleet.start,
    ready: Callable[[ServerFleet], object] | None = None,
) -> Iterator[Serving]:
    """Servers up (started or attached), a dispatcher over them with `on_server_down=fleet.restart`, then stopped.

    `plan_args`: the memory plan's flags, before the spec's own `server_args` on every launched server (attach
    mode launches nothing); `server_plan_args`, one list per server, instead (`datagen.engine.plan_trial`).
    `memory_plan`: the plan itself (its flags when `plan_args` is empty): each launched server's logged pools are
    checked against its prediction, and a short server is relaunched once with the plan recalibrated from its log
    (`ServerFleet`, issue 37); `served.fleet.memory_plan` is then the plan the servers run.
    `start` starts the fleet; a flow passes its named task there, so a server that fails to start shows as a red
    task with its log lines. `ready`: run on the started fleet before the dispatcher contacts it (the pilot's
    worst-case burst, which may relaunch servers with other flags).
    """
    key = provisioning.api_key_for(settings)
    fleet = provisioning.provision(settings, spec, layout, key, plan_args, server_plan_args, memory_plan)
    try:
        start(fleet)
        if ready is not None:
            ready(fleet)
        with Dispatcher(
            fleet.endpoints,
            on_server_down=fleet.restart,
            hang_timeout_s=settings.server_hang_timeout_s,
            affinity_wait_s=settings.affinity_wait_s,
        ) as dispatcher:
            dispatcher.wait_ready(settings.server_start_timeout_s)  # every server contacted before work is sent
            yield Serving(fleet, dispatcher)
    finally:
        fleet.stop()
