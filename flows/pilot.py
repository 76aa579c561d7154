"""The `pilot` flow: a seeded, source-stratified sample through generation and validation, projected to the full set.

It measures instead of assuming: output tokens (mean, percentiles, per source), throughput per server, and from
them wall time, GPU-hours, reject rate and dataset size for the whole prompt set. The report is a markdown
artifact plus `pilot.json`/`pilot.md` in the pilot's run directory. A main run with `RunSpec.pilot = <name>`
reuses the pilot's completions (same request keys) and, with `order = "long_first"`, its length estimates.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact
from prefect.cache_policies import NO_CACHE
from prefect.futures import PrefectFuture
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from datagen.checks.repetition import word_tokens
from datagen.conversation.turn_mode import turn_mode
from datagen.engine import plan_trial
from datagen.engine.client import sampling_params_for
from datagen.engine.launcher import ServerFleet
from datagen.engine.memory_plan import MemoryPlan
from datagen.operations import alerts, failure, report
from datagen.runspec import RunSpec
from flows import skeleton
from tasks import generation, pilot, planning
from tasks.serving import serving

__all__ = ["pilot_flow"]


plan_pilot_task = task(name="plan pilot sample", cache_policy=NO_CACHE)(pilot.plan_pilot)
project_task = task(name="project full run", cache_policy=NO_CACHE)(pilot.project)


@flow(
    name="pilot",
    task_runner=cast("TaskRunner[PrefectFuture[Any]]", ThreadPoolTaskRunner(max_workers=skeleton.SHARDS_IN_FLIGHT)),
    log_prints=True,
    flow_run_name=report.run_name("pilot"),
    on_failure=[alerts.announce_failure],
)
def pilot_flow(spec: RunSpec = RunSpec(), pilot_spec: pilot.PilotSpec = pilot.PilotSpec()) -> dict[str, Any]:  # noqa: B008
    """Generate and validate a sample of the run's prompts; project tokens, time, GPU-hours and size for all."""
    return failure.reported(_pilot, spec, pilot_spec)


def _pilot(spec: RunSpec, pilot_spec: pilot.PilotSpec) -> dict[str, Any]:
    logger = get_run_logger()
    with skeleton.open_run(spec, layout_name=pilot_spec.name) as run:
        skeleton.check_environment_task(run.settings, spec, run.store)
        # The sample comes from what the main run would generate: the same catalog skips and targets.
        skip, _ = skeleton.published_skips(run)
        plan, population = plan_pilot_task(spec, pilot_spec, run.layout, skip)
        logger.info("pilot sample: %d prompts in %d shards", plan.n_prompts, len(plan.shard_ids))
        if plan.n_prompts == 0:
            raise ValueError("the pilot found no prompts to sample (all published already, or targets of 0)")
        # Before any output is measured the plan assumes max_new_tokens/2 of output; the main run's plan below
        # uses the pilot's measured mean. Prompt lengths: the sample's, as planning rendered them.
        planned = skeleton.Planned(
            plan, planning.prompt_tokens(plan, run.layout, spec), planning.conversation_turns(plan, run.layout), None
        )
        pilot_plan, _ = skeleton.box_memory_plan(
            run.settings, spec, planned.prompt_tokens, planned.recorded_turns, None
        )
        trial, results, throughput = _generate_sample(run, planned, pilot_plan, pilot_spec)
        summary = skeleton.validate_task(
            [Path(r.completions_path) for r in results],
            run.layout.validated_dir,
            spec.validation,
            spec.sampling.enable_thinking,
            word_tokens(run.chat),  # judged like the main run: structure is not a loop
            turns=turn_mode(spec),
        )
        servers = pilot_spec.project_servers or run.settings.num_servers
        projection = project_task(
            run.layout, plan, population, summary, throughput, servers, pilot_spec, turns=turn_mode(spec)
        )
        # The main run's plan as the main run computes it: from the steps, output and trial this pilot measured.
        projection.engine = {"trial": trial} if trial else {}
        main_plan, main_why = skeleton.box_memory_plan(
            run.settings, spec, planned.prompt_tokens, planned.recorded_turns, projection
        )
        projection.engine = pilot.engine_section(pilot_plan, main_plan, main_why)
        if main_plan is not None:  # without a plan there was nothing to try (the section says why)
            projection.engine.update(
                {"trial": trial} if trial else {"trial_skipped": _trial_note(run, pilot_spec, pilot_plan)}
            )
        path = pilot.write_projection(run.layout, projection)
    create_markdown_artifact(
        markdown=pilot.render_projection(projection), key="pilot-projection", description="Pilot projection"
    )
    logger.info("pilot projection written to %s", path)
    return {"path": str(path), **projection.model_dump(mode="json")}


def _trial_note(run: skeleton.Run, pilot_spec: pilot.PilotSpec, plan: MemoryPlan | None) -> str:
    settings = run.settings
    return plan_trial.wanted(pilot_spec.plan_trial, settings.num_servers, plan, bool(settings.server_urls))[1]


def _generate_sample(
    run: skeleton.Run, planned: skeleton.Planned, pilot_plan: MemoryPlan | None, pilot_spec: pilot.PilotSpec
) -> tuple[dict[str, Any] | None, list[generation.ShardResult], dict[str, Any]]:
    """The sample generated on this box's fleet, with candidate plans side by side where the trial runs."""
    logger = get_run_logger()
    settings, spec = run.settings, run.spec
    trial_on, trial_note = plan_trial.wanted(
        pilot_spec.plan_trial, settings.num_servers, pilot_plan, bool(settings.server_urls)
    )
    arms: list[plan_trial.Arm] = []
    if trial_on and pilot_plan:
        higher, higher_why = skeleton.memory_plan_task(
            settings,
            spec,
            None,
            None,
            planned.prompt_tokens,
            turns_per_conversation=planned.recorded_turns,
            turns_source=pilot.RECORDED_TURNS,
            higher=True,
        )
        logger.info("higher fraction to try: %s", higher_why)
        arms = plan_trial.trial_arms(pilot_plan, settings.num_servers, higher)
    logger.info("candidate plans side by side: %s", "; ".join(f"{a.name} on {a.servers}" for a in arms) or trial_note)
    held: dict[str, dict[str, Any]] = {}
    longest = planned.prompt_tokens.max if planned.prompt_tokens else spec.prompt_token_limit

    def worst_case(fleet: ServerFleet) -> None:
        """Every arm's servers take the worst case first (plan_trial.burst_and_relaunch)."""
        held.update(
            plan_trial.burst_and_relaunch(
                fleet,
                arms,
                prompt_tokens=min(longest, spec.prompt_token_limit),
                sampling=sampling_params_for(spec.sampling),
                token_range=(1000, max(1001, run.chat.vocab_size - 1000)),
            )
        )

    with (
        serving(
            settings,
            spec,
            run.layout,
            plan_args=pilot_plan.plan_args if pilot_plan else (),
            server_plan_args=plan_trial.server_plan_args(arms, settings.num_servers) if arms else None,
            ready=worst_case if arms else None,
        ) as served,
        pilot.ThroughputProbe(served.dispatcher, served.fleet.endpoints) as probe,
    ):
        names = [e.name for e in served.fleet.endpoints]
        results = skeleton.generate_shards(planned.plan, run, served.dispatcher, None)
    queued = [(s.t, s.queued) for s in probe.samples]
    trial = plan_trial.judge(arms, names, probe.server_readings, queued, held) if arms else None
    return trial, results, probe.measure()
