"""The provisioning stage: start the generation servers (or attach to running ones) for the length of a block.

    with provision(settings, spec, layout, api_key) as fleet:
        fleet.endpoints          # list[ServerEndpoint], one per healthy server
        fleet.restart("gpu3")    # the dispatcher's on_server_down callback

Every server the pipeline started is stopped when the block ends, however it ends; when the process is
killed outright (SIGKILL, OOM killer), `stop_leftover_servers` at the start of the next run stops them.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence

from pydantic import SecretStr

from datagen.engine.launcher import ServerFleet, ServerStartError, reap_orphaned_servers
from datagen.engine.memory_plan import MemoryPlan
from datagen.layout import RunLayout
from datagen.operations.prefect_reaper import reap_orphaned_prefect_servers, record_embedded_prefect_server
from datagen.runspec import RunSpec
from datagen.settings import Settings

__all__ = [
    "ServerFleet",
    "ServerStartError",
    "api_key_for",
    "new_api_key",
    "provision",
    "record_prefect_server",
    "stop_leftover_servers",
]


def api_key_for(settings: Settings) -> SecretStr:
    """The configured server API key, or a fresh random one for servers this run starts."""
    return settings.sglang_api_key or new_api_key()


def new_api_key() -> SecretStr:
    """A random key of 32 URL-safe characters that never starts with "-" (it would read as a flag elsewhere)."""
    return SecretStr("k" + secrets.token_urlsafe(24))


def provision(
    settings: Settings,
    spec: RunSpec,
    layout: RunLayout,
    api_key: SecretStr,
    plan_args: Sequence[str] = (),
    server_plan_args: Sequence[Sequence[str]] | None = None,
    memory_plan: MemoryPlan | None = None,
) -> ServerFleet:
    """A fleet to use as a context manager: servers start (or are health-checked) on entry, stop on exit.

    `plan_args`: the memory plan's flags (`tasks.environment.memory_plan_for`), added before the spec's own.
    `server_plan_args`: one flag list per server instead (a pilot's side-by-side trial of candidate plans).
    `memory_plan`: the plan whose predicted pools each launched server's log is checked against (`ServerFleet`).
    """
    return ServerFleet(
        settings,
        spec,
        layout,
        api_key,
        plan_args=plan_args,
        server_plan_args=server_plan_args,
        memory_plan=memory_plan,
    )


def stop_leftover_servers(settings: Settings) -> list[str]:
    """Stop servers that an earlier pipeline on this box started and, killed, never stopped; what was stopped.

    Only servers recorded under `settings.work_dir` whose pipeline process is gone: generation servers (attach
    mode never stops any) and embedded Prefect servers (`record_prefect_server`).
    """
    prefect = reap_orphaned_prefect_servers(settings.work_dir)
    if settings.server_urls:
        return prefect
    return reap_orphaned_servers(settings.work_dir) + prefect


def record_prefect_server(settings: Settings) -> None:
    """Record this pipeline's embedded Prefect server, if any, so a run after a SIGKILL can stop it."""
    record_embedded_prefect_server(settings.work_dir)
