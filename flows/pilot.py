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
from prefect.futures import PrefectFuture, as_completed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from datagen import paths
from datagen.chat import ChatTokenizer
from datagen.checks.repetition import word_tokens
from datagen.conversation.turn_mode import turn_mode
from datagen.engine import plan_trial
from datagen.engine.client import sampling_params_for
from datagen.engine.launcher import ServerFleet
from datagen.layout import RunLayout
from datagen.operations import alerts, failure, report
from datagen.publishing.catalog import published_prompt_ids, repair
from datagen.publishing.storage import ObjectStore
from datagen.runspec import AUTO_NAMESPACE, RunSpec
from datagen.settings import Settings
from flows.expand_dataset import (
    SHARDS_IN_FLIGHT,
    check_environment_task,
    generate_shard_task,
    memory_plan_task,
    validate_task,
)
from tasks import generation, pilot, planning
from tasks.serving import serving

__all__ = ["pilot_flow"]


plan_pilot_task = task(name="plan pilot sample", cache_policy=NO_CACHE)(pilot.plan_pilot)
project_task = task(name="project full run", cache_policy=NO_CACHE)(pilot.project)


@flow(
    name="pilot",
    task_runner=cast("TaskRunner[PrefectFuture[Any]]", ThreadPoolTaskRunner(max_workers=SHARDS_IN_FLIGHT)),
    log_prints=True,
    flow_run_name=report.run_name("pilot"),
    on_failure=[alerts.announce_failure],
)
def pilot_flow(spec: RunSpec = RunSpec(), pilot_spec: pilot.PilotSpec = pilot.PilotSpec()) -> dict[str, Any]:  # noqa: B008
    """Generate and validate a sample of the run's prompts; project tokens, time, GPU-hours and size for all."""
    return failure.reported(_pilot, spec, pilot_spec)


def _pilot(spec: RunSpec, pilot_spec: pilot.PilotSpec) -> dict[str, Any]:
    logger = get_run_logger()
    settings = Settings()
    paths.secure_run(settings, spec)  # run paths under the box's roots, a private work dir: before anything
    store = ObjectStore.from_settings(settings)
    layout = RunLayout.for_run(settings.work_dir, pilot_spec.name)
    layout.root.mkdir(parents=True, exist_ok=True)

    check_environment_task(settings, spec, store)
    # The sample comes from what the main run would generate: the same catalog skips and targets.
    exclude = set() if spec.namespace == AUTO_NAMESPACE else {spec.namespace}
    if spec.skip_published:
        repair(store)  # a namespace published without its catalog part still counts as published
    skip = published_prompt_ids(store, exclude=exclude, retry=spec.retry_rejected) if spec.skip_published else set()
    plan, population = plan_pilot_task(spec, pilot_spec, layout, skip)
    logger.info("pilot sample: %d prompts in %d shards", plan.n_prompts, len(plan.shard_ids))
    if plan.n_prompts == 0:
        raise ValueError("the pilot found no prompts to sample (all published already, or targets of 0)")
    chat = ChatTokenizer.shared(spec.model_path)

    # Before any output is measured the plan assumes max_new_tokens/2 of output; the main run's plan below
    # uses the pilot's measured mean. Prompt lengths: the sample's, as planning rendered them.
    prompt_tokens = planning.prompt_tokens(plan, layout, spec)
    turns = planning.conversation_turns(plan, layout)
    pilot_plan, plan_why = memory_plan_task(
        settings, spec, None, None, prompt_tokens, turns_per_conversation=turns, turns_source=pilot.RECORDED_TURNS
    )
    logger.info("memory plan: %s", plan_why)
    trial_on, trial_note = plan_trial.wanted(
        pilot_spec.plan_trial, settings.num_servers, pilot_plan, bool(settings.server_urls)
    )
    higher = None
    if trial_on and pilot_plan:
        higher, higher_why = memory_plan_task(
            settings,
            spec,
            None,
            None,
            prompt_tokens,
            turns_per_conversation=turns,
            turns_source=pilot.RECORDED_TURNS,
            higher=True,
        )
        logger.info("higher fraction to try: %s", higher_why)
    arms = plan_trial.trial_arms(pilot_plan, settings.num_servers, higher) if trial_on and pilot_plan else []
    logger.info("candidate plans side by side: %s", "; ".join(f"{a.name} on {a.servers}" for a in arms) or trial_note)
    held: dict[str, dict[str, Any]] = {}

    def worst_case(fleet: ServerFleet) -> None:
        """Every arm's servers take the worst case; a server whose arm did not hold runs the first arm that did."""
        held.update(
            plan_trial.burst(
                arms,
                fleet.endpoints,
                prompt_tokens=min(
                    prompt_tokens.max if prompt_tokens else spec.prompt_token_limit, spec.prompt_token_limit
                ),
                sampling=sampling_params_for(spec.sampling),
                token_range=(1000, max(1001, chat.vocab_size - 1000)),
            )
        )
        safe = next((a.plan_args for a in arms if held.get(a.name, {}).get("held")), [])
        for arm in arms:
            logger.info("worst-case burst, arm '%s': %s", arm.name, held.get(arm.name, {}).get("why", "not run"))
            if not held.get(arm.name, {}).get("held", True):
                for i in arm.servers:
                    fleet.relaunch(i, safe)

    results: list[generation.ShardResult] = []
    with (
        serving(
            settings,
            spec,
            layout,
            plan_args=pilot_plan.plan_args if pilot_plan else (),
            server_plan_args=plan_trial.server_plan_args(arms, settings.num_servers) if arms else None,
            ready=worst_case if arms else None,
        ) as served,
        pilot.ThroughputProbe(served.dispatcher, served.fleet.endpoints) as probe,
    ):
        server_names = [e.name for e in served.fleet.endpoints]
        futures = [
            generate_shard_task.with_options(result_storage=layout.root / "task-results").submit(
                shard_id, plan.plan_sha256, chat.fingerprint, spec, layout, served.dispatcher, chat
            )
            for shard_id in plan.shard_ids
        ]
        results = [f.result() for f in as_completed(futures)]
    throughput = probe.measure()

    results.sort(key=lambda r: r.shard_id)
    summary = validate_task(
        [Path(r.completions_path) for r in results],
        layout.validated_dir,
        spec.validation,
        spec.sampling.enable_thinking,
        word_tokens(chat),  # judged like the main run: structure is not a loop
        turns=turn_mode(spec),
    )
    servers = pilot_spec.project_servers or settings.num_servers
    projection = project_task(layout, plan, population, summary, throughput, servers, pilot_spec, turns=turn_mode(spec))
    trial = (
        plan_trial.judge(arms, server_names, probe.server_readings, [(s.t, s.queued) for s in probe.samples], held)
        if arms
        else None
    )
    # The radix cache's trade: weighed on the steps the pilot measured (user turns, tool rounds), not the recording's.
    main_turns, main_turns_source = pilot.plan_turns(projection, turns)
    main_plan, main_why = memory_plan_task(
        settings,
        spec,
        None,
        float(projection.output_tokens["mean"]),
        prompt_tokens,
        turns_per_conversation=main_turns,
        turns_source=main_turns_source,
        **plan_trial.kept_plan({"trial": trial} if trial else None),
    )
    projection.engine = pilot.engine_section(pilot_plan, main_plan, main_why)
    if main_plan is not None:  # without a plan there was nothing to try (the section says why)
        projection.engine.update({"trial": trial} if trial else {"trial_skipped": trial_note})
    path = pilot.write_projection(layout, projection)
    create_markdown_artifact(
        markdown=pilot.render_projection(projection), key="pilot-projection", description="Pilot projection"
    )
    logger.info("pilot projection written to %s", path)
    return {"path": str(path), **projection.model_dump(mode="json")}
