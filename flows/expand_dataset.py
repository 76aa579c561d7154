"""The `expand-dataset` flow: prompts in, a validated, tokenized dataset published to S3 out, on this box's GPUs.

The run is the skeleton's (`flows/skeleton.py`: open, plan, generate, finish and publish); what is this flow's
own is who generates: this box's fleet, one server per GPU, fed by one dispatcher, each shard validated and
tokenized as soon as it and those before it are generated.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from datagen.checks import CheckResult
from datagen.conversation.turn_mode import turn_mode
from datagen.layout import RunLayout
from datagen.operations import alerts, failure, report
from datagen.runspec import RunSpec
from flows import skeleton
from flows.skeleton import Generated, Planned, Run
from tasks import finishing, planning
from tasks.serving import serving

__all__ = ["OneBox", "expand_dataset"]

# The old import path of the stage wrappers (moved to flows.skeleton): scripts that used them keep working.
generate_shard_task = skeleton.generate_shard_task
publish_task = skeleton.publish_task
catalog_task = skeleton.catalog_task


def _checkpoints(plan: planning.ShardPlan, layout: RunLayout) -> tuple[list[Path], list[Path]]:
    return [layout.shard_completions(i) for i in plan.shard_ids], [layout.shard_rejects(i) for i in plan.shard_ids]


@dataclass(frozen=True)
class OneBox:
    """This box generates: its GPUs checked, its memory plan, its fleet and one dispatcher."""

    def check(self, run: Run) -> list[CheckResult]:
        return skeleton.check_environment_task(run.settings, run.spec, run.store)

    def generate(self, run: Run, planned: Planned) -> Generated:
        logger = get_run_logger()
        spec, layout, plan = run.spec, run.layout, planned.plan
        memory_plan, memory_why = skeleton.box_memory_plan(
            run.settings, spec, planned.prompt_tokens, planned.recorded_turns, planned.projection
        )
        if spec.pilot:
            reused = skeleton.import_pilot_task(
                RunLayout.for_run(run.settings.work_dir, spec.pilot), layout, plan, spec, run.chat
            )
            logger.info("reused %d completions of pilot %s", reused.imported_completions, spec.pilot)
        label = f"Generation of {spec.namespace}: "
        progress_id = cast(
            UUID,
            create_progress_artifact(
                progress=0.0,
                key="generation-progress",
                description=f"{label}{turn_mode(spec).progress_label}, of {plan.n_prompts}",
            ),
        )
        pending = skeleton.pending_task(plan.shard_ids, layout, run.chat, spec)
        stream = finishing.StreamingFinish(plan.shard_ids, layout, run.chat, spec)
        hardware = {
            "gpu": _gpu_description(run),
            "memory_plan": memory_plan.lineage() if memory_plan else {"skipped": memory_why},
        }
        out = Generated([], hardware, stream, plan_args=list(memory_plan.plan_args) if memory_plan else [])
        out.shards_reused = sum(1 for n in pending.values() if n == 0)
        if memory_plan and memory_plan.kept_by_trial:
            out.plan_note = f"kept by the pilot's side-by-side trial: {memory_plan.kept_by_trial}"
        if not any(pending.values()):  # a retry whose shards are all checkpointed loads no model
            logger.info("all %d shards are already generated (checkpoints): no servers started", len(plan.shard_ids))
            out.shard_results = skeleton.generate_shards(plan, run, None, stream)
            update_progress_artifact(
                artifact_id=progress_id, progress=100.0, description=f"{label}all prompts settled before"
            )
            return out
        with serving(
            run.settings,
            spec,
            layout,
            plan_args=out.plan_args,
            memory_plan=memory_plan,
            start=skeleton.start_servers_task,
        ) as served:
            run.clock.mark("server start")
            reporter = report.ProgressReporter(
                served.dispatcher,
                plan.n_prompts,
                plan.n_prompts - sum(pending.values()),
                progress_id,
                logger,
                label=label,
                turns=turn_mode(spec).step_tail(*_checkpoints(plan, layout), plan.n_prompts),
            )
            with reporter as progress:
                out.shard_results = skeleton.generate_shards(plan, run, served.dispatcher, stream)
            if progress.last_stats is not None:
                logger.info("%s", progress.last_stats.line())
            # The fleet relaunched with the plan recalibrated when the engine's pools fell short of it (issue 37).
            out.plan_args = list(served.fleet.plan_args)
            out.final_stats, out.throughput = progress.last_stats, progress.throughput_series()
            out.engine_version = served.fleet.engine_version
        return out


def _gpu_description(run: Run) -> str:
    """The GPU checks' findings, as the environment report showed them (empty when they were skipped)."""
    return "; ".join(r.detail for r in run.checks if r.name.startswith("gpu.") and r.status == "pass")


@flow(
    name="expand-dataset",
    task_runner=cast("TaskRunner[PrefectFuture[Any]]", ThreadPoolTaskRunner(max_workers=skeleton.SHARDS_IN_FLIGHT)),
    log_prints=True,
    flow_run_name=report.run_name("expand-dataset"),
    on_failure=[alerts.announce_failure],
)
def expand_dataset(spec: RunSpec = RunSpec(), dry_run: bool = False) -> dict[str, Any]:  # noqa: B008
    """Generate completions for a prompt set, validate, tokenize and publish them (never overwriting).

    Args:
        spec: What this run does: prompt sources, model, sampling, sharding and the output namespace.
        dry_run: Do everything except writing to S3 (generate, validate, tokenize), then list what would be published.
    """
    return failure.reported(skeleton.run_dataset, spec, dry_run, OneBox())
