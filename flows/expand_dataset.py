"""The `expand-dataset` flow: prompts in, a validated, tokenized dataset published to S3 out.

The flow body only orchestrates. Stage bodies are plain functions in `tasks/`; this module wraps
each once with `task(...)`, where names, retries and caching are visible together. Tasks pass
references (paths, counts, checksums), never the records themselves.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    create_table_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext, TaskRunContext
from prefect.futures import PrefectFuture, as_completed
from prefect.states import Completed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

import datagen
from datagen import paths
from datagen.chat import ChatTokenizer
from datagen.checks import CheckResult
from datagen.checks.quality import GateReport, ValidationSummary, check_quality_gate, render_validation_report
from datagen.conversation.turn_mode import turn_mode
from datagen.conversation.turn_stats import TurnCounts
from datagen.engine import plan_trial
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.launcher import ServerFleet
from datagen.engine.memory_plan import MemoryPlan, numerics_flags
from datagen.engine.stats import DispatcherStats
from datagen.identity import generation_cache_key
from datagen.layout import RunLayout
from datagen.operations import alerts, diskspace, failure, report
from datagen.publishing import catalog
from datagen.publishing.dataset_card import Lineage, write_dataset_card
from datagen.publishing.pinned import PinnedFacts, pin_facts
from datagen.publishing.storage import ObjectStore, s3_preflight
from datagen.runspec import AUTO_NAMESPACE, QualityGate, RunSpec
from datagen.settings import Settings
from tasks import (
    environment,
    finishing,
    generation,
    ordering,
    pilot,
    planning,
    provisioning,
    publishing,
    tokenization,
    validation,
)
from tasks.serving import serving

__all__ = ["expand_dataset", "finish_dataset", "publish_dataset", "published_before", "retry_unless_disk_full"]

log = logging.getLogger(__name__)

# How many shards are in flight at once. Every in-flight shard feeds its requests to the one dispatcher,
# and a shard's worker waits for its slowest (longest) generation before it takes the next shard, so
# shards in flight x shard size must stay well above the box's slots (8 servers x ~76 = ~600) even while
# several shards sit on their last long request; 4 shards drained the servers in the benchmark.
SHARDS_IN_FLIGHT = 32


def _generation_cache_key(context: TaskRunContext, parameters: dict[str, Any]) -> str:
    """Content key of a shard's generation (datagen.identity): survives new flow runs."""
    spec: RunSpec = parameters["spec"]
    return generation_cache_key(
        spec.namespace,
        parameters["plan_sha256"],
        spec.sampling,
        parameters["model_fingerprint"],
        parameters["shard_id"],
        turn_mode(spec),
    )


def _check_environment(settings: Settings, spec: RunSpec, store: ObjectStore) -> list[CheckResult]:
    # Before the GPU checks: servers a killed run left behind would hold the GPUs and fail them.
    for line in provisioning.stop_leftover_servers(settings):
        get_run_logger().warning("stopped a server left running by a pipeline that was killed: %s", line)
    provisioning.record_prefect_server(settings)
    results = environment.run_checks(settings, spec, s3_check=lambda: s3_preflight(store, spec.namespace, resume=True))
    create_table_artifact(
        table=environment.report_rows(results),
        key="environment-report",
        description=f"Environment checks for namespace {spec.namespace}",
    )
    environment.raise_if_failed(results)
    return results


def _shards_to_generate(shard_ids: list[int], layout: RunLayout, chat: ChatTokenizer, spec: RunSpec) -> dict[int, int]:
    """Shard id -> requests its checkpoint has no result for (0: done before, e.g. a retry of this run)."""
    return {shard_id: generation.unsettled_requests(shard_id, layout, chat, spec) for shard_id in shard_ids}


def _start_servers(fleet: ServerFleet) -> list[str]:
    endpoints = fleet.start()
    return [f"{e.name}={e.url} (max running {e.max_running_requests})" for e in endpoints]


def _generate_shard(
    shard_id: int,
    plan_sha256: str,
    model_fingerprint: str,
    spec: RunSpec,
    layout: RunLayout,
    dispatcher: Dispatcher | None,
    chat: ChatTokenizer,
) -> generation.ShardResult:
    return generation.generate_shard(shard_id, layout, dispatcher, chat, spec)


def retry_unless_disk_full(task: object, task_run: object, state: State[Any]) -> bool:
    """Prefect's retry condition of every retried task: a full disk is not retried (waiting does not free it).

    The run then fails at once and its reason names the path (datagen.operations.failure,
    datagen.operations.diskspace), instead of failing the same way after 70 s of retry delays.
    """
    return not (isinstance(state.data, BaseException) and diskspace.full_disk(state.data) is not None)


check_environment_task = task(name="check environment", cache_policy=NO_CACHE)(_check_environment)
memory_plan_task = task(name="memory plan", cache_policy=NO_CACHE)(environment.memory_plan_for)
plan_task = task(name="plan shards", cache_policy=NO_CACHE)(planning.plan_shards)
start_servers_task = task(name="start servers", cache_policy=NO_CACHE)(_start_servers)
pending_task = task(name="check checkpoints", cache_policy=NO_CACHE)(_shards_to_generate)
generate_shard_task = task(
    name="generate",
    task_run_name="generate shard-{shard_id:05d}",
    cache_key_fn=_generation_cache_key,
    persist_result=True,
    retries=2,
    retry_delay_seconds=[10, 60],
    retry_condition_fn=retry_unless_disk_full,
)(_generate_shard)


def _quality_gate(
    summary: ValidationSummary,
    gate: QualityGate,
    upstream_reasons: dict[str, int],
    reject_paths: list[str],
    downstream_reasons: dict[str, int] | None = None,
    namespace: str = "",
    published_before: int = 0,
) -> GateReport:
    downstream = downstream_reasons or {}
    report = check_quality_gate(
        summary,
        gate,
        sum(upstream_reasons.values()),
        sum(downstream.values()),
        upstream_reasons,
        reject_paths,
        downstream,
        published_before=published_before,
    )
    create_markdown_artifact(
        markdown=render_validation_report(summary, report),
        key="validation-report",
        description=f"Validation of {namespace}: per-sample verdicts, reject reasons with examples, the quality gate",
    )
    report.raise_if_failed()  # inside the task: the gate itself is the red task, its report the message
    return report


validate_task = task(name="validate", cache_policy=NO_CACHE)(validation.validate_shards)
load_gate_task = task(name="quality gate on load rejects", cache_policy=NO_CACHE)(planning.check_plan)
gate_task = task(name="quality gate", cache_policy=NO_CACHE)(_quality_gate)
# Validation and tokenization stream: one run per shard as soon as it (and every shard before it) is generated.
finish_shard_task = task(
    name="validate and tokenize", task_run_name="validate+tokenize shard-{result.shard_id:05d}", cache_policy=NO_CACHE
)(finishing.finish_shard)
close_validation_task = task(name="validation summary", cache_policy=NO_CACHE)(finishing.close_validation)
close_tokenization_task = task(name="tokenized files", cache_policy=NO_CACHE)(finishing.close_tokenization)
publish_task = task(
    name="publish", cache_policy=NO_CACHE, retries=1, retry_delay_seconds=5, retry_condition_fn=retry_unless_disk_full
)(publishing.publish)
import_pilot_task = task(name="reuse pilot completions", cache_policy=NO_CACHE)(pilot.import_pilot)
catalog_task = task(
    name="catalog prompt ids",
    cache_policy=NO_CACHE,
    retries=1,
    retry_delay_seconds=5,
    retry_condition_fn=retry_unless_disk_full,
)(catalog.write_part)


def publish_dataset(
    spec: RunSpec, layout: RunLayout, store: ObjectStore, lineage: dict[str, Any], dry_run: bool
) -> publishing.PublishResult:
    """Publish the staged dataset, then its catalog part (every flow that publishes goes through here)."""
    created_at = pin_facts(layout.pinned_facts, None).created_at  # the first attempt's, like the card's
    published = publish_task(layout.staging_dir, spec.namespace, store, lineage, dry_run=dry_run, created_at=created_at)
    if not dry_run:
        # After the manifest: a crash in between leaves a published namespace without a part, which
        # catalog.repair recovers before the next plan; the reverse would skip prompts never published.
        catalog_task(store, spec.namespace, layout.staging_dir)
    return published


def published_before(store: ObjectStore, spec: RunSpec, layout: RunLayout) -> dict[str, Any] | None:
    """The summary of a run whose earlier attempt already published it (killed after its manifest), else None.

    Its catalog part is written if it is missing; nothing else is done (no servers, no generation). Staged files
    are shared by every run of the namespace on this box, so a namespace another run spec published is refused
    (PublishError naming that run) before they are compared. Without staged files it touches nothing: the
    environment check is the first to reach S3, and `refuse_other_run` follows it.
    """
    if not layout.staging_dir.is_dir():
        return None
    publishing.refuse_other_run(store, spec.namespace, spec.model_dump(mode="json"))
    manifest = publishing.published_as_staged(store, spec.namespace, layout.staging_dir)
    message = f"{spec.namespace} was published by an earlier attempt of this run; its catalog part is in place"
    if manifest is None and (claim := publishing.claimed_as_staged(store, spec.namespace, layout.staging_dir)):
        # Killed in its publish: finish it from the files it claimed (issue 47: the claim's bytes, whatever code).
        publish_dataset(spec, layout, store, claim.get("lineage") or {}, dry_run=False)
        manifest = publishing.published_as_staged(store, spec.namespace, layout.staging_dir)
        message = f"{spec.namespace}: finished the publish an earlier attempt claimed, from the files it staged"
    if manifest is None:
        return None
    catalog_task(store, spec.namespace, layout.staging_dir)
    lineage = manifest.get("lineage") or {}
    get_run_logger().info("%s", message)
    return {
        "uri": store.uri(spec.namespace + "/"),
        "namespace": spec.namespace,
        "rows": lineage.get("rows"),
        "rejects": lineage.get("rejects"),
        "already_published": True,
        "message": message,
    }


def manifest_lineage(
    spec: RunSpec,
    chat: ChatTokenizer,
    settings: Settings,
    plan: planning.ShardPlan,
    tokenized: tokenization.TokenizationSummary,
    *,
    first_attempt: PinnedFacts,
    engine_version: str | None,
    hardware: Mapping[str, Any],
    conversations: TurnCounts | None,
    published: Mapping[str, int],
) -> dict[str, Any]:
    """The manifest's lineage, for a run on one box and a run over several (`hardware`: what each records of its
    GPUs and memory plans, in this order between the engine and the pipeline version).

    `first_attempt`: the run id and name of the run's first attempt, named when another run spec targets this
    namespace (publishing.refuse_other_run); like the card's, so a re-run publishes the bytes its interrupted
    attempt claimed. `conversations`: an every-turn run's conversation counts (`TurnMode.conversation_counts`; a `last`
    run has none), then `published`: what the published rows hold of them.
    """
    lineage = {
        "run_spec": spec.model_dump(mode="json"),
        "run_id": first_attempt.run_id,
        "run_name": first_attempt.run_name,
        "model_path": spec.model_path,
        "model_fingerprint": chat.fingerprint,
        "chat_template_hash": chat.template_hash,
        "engine": settings.engine,
        "engine_version": engine_version,
        **hardware,
        "pipeline_version": datagen.__version__,
        "plan_sha256": plan.plan_sha256,
        "prompt_id_scheme": plan.id_scheme,  # datagen.identity; the catalog part records it (issue 47)
        "rows": tokenized.n_rows,
        "rejects": tokenized.n_rejects,
        "rejects_by_reason": tokenized.rejects_by_reason,
        "skipped_published": plan.n_skipped_published,
        "old_rejects_skipped": plan.n_old_rejects_skipped,
        # Rows identical to an earlier row (kept; issue 47: conversations that open alike, deterministic decoding).
        "duplicate_rows": tokenized.duplicate_rows,
        "duplicate_row_groups": tokenized.duplicate_groups,
    }
    return lineage | ({"conversations": conversations.summary() | dict(published)} if conversations is not None else {})


def finish_dataset(
    spec: RunSpec,
    layout: RunLayout,
    chat: ChatTokenizer,
    n_load_rejects: int,
    shard_results: list[generation.ShardResult],
    run_id: str | None,
    stream: finishing.StreamingFinish | None = None,
    plan_args: Sequence[str] = (),
    plan_note: str | None = None,
    plan_args_by_box: Mapping[str, Sequence[str]] | None = None,
    skipped: tuple[int, int] = (0, 0),
) -> tokenization.TokenizationSummary:
    """Gate what the stream validated, close tokenization, gate again and write the dataset card.

    Without a `stream` (callers that did not finish shards while generating), every shard is finished here.
    `plan_args` (or `plan_args_by_box`, a multi-box run) and `plan_note` are the memory plan the card records.
    `skipped`: the plan's prompts and old load rejects skipped as published before (the gate and the card).
    """
    if stream is None:
        stream = finishing.StreamingFinish([r.shard_id for r in shard_results], layout, chat, spec)
        for result in shard_results:
            for ready in stream.ready(result):
                finish_shard_task(stream, ready)
    summary = close_validation_task(stream)
    upstream_reasons = validation.count_reject_reasons(
        [layout.load_rejects, *(Path(r.rejects_path) for r in shard_results)]
    )
    tokenized = close_tokenization_task(stream)
    # One gate, on the final counts (rows can still fail the token round-trip check), before anything ships:
    # one `quality gate` task and one validation-report artifact per run. Reject files by their keys in the
    # namespace, not local paths: the report is published, and must not change with the work dir.
    published_rejects = list(tokenized.reject_files)
    final = gate_task(
        summary,
        spec.quality_gate,
        upstream_reasons,
        published_rejects,
        # Every tokenize reject by its reason: "tokenize=3" said nothing a person could act on.
        {k: v for k, v in tokenized.rejects_by_reason.items() if k.startswith("tokenize/")},
        namespace=spec.namespace,
        published_before=skipped[0],
    )
    ctx = FlowRunContext.get()
    pinned = pin_facts(layout.pinned_facts, run_id, ctx.flow_run.name if ctx and ctx.flow_run else None)
    # Published with the data: each reject reason's share and example rows, and the gate that passed.
    (layout.staging_dir / validation.REPORT_NAME).write_text(render_validation_report(summary, final), encoding="utf-8")
    write_dataset_card(
        layout.staging_dir,
        namespace=spec.namespace,
        model=spec.served_model_name,
        sampling=spec.sampling,
        lineage=Lineage(
            model_fingerprint=chat.fingerprint,
            template_hash=chat.template_hash,
            source_mix=tokenized.rows_by_source,
            category_mix=tokenized.rows_by_category,
            server_args=spec.server_args,
            numerics_flags=numerics_flags(spec.server_args),
            memory_plan=list(plan_args),
            memory_plan_by_box={box: list(args) for box, args in (plan_args_by_box or {}).items()},
            memory_plan_note=plan_note,
            # The first attempt's: a re-run must publish the README.md its interrupted attempt claimed.
            run_id=pinned.run_id,
            created_at=pinned.created_at,
            skipped_published=skipped[0],
            old_rejects_skipped=skipped[1],
        ),
        sizes=tokenized.sizes(),
    )
    return tokenized


@dataclass(frozen=True, slots=True)
class _Generated:
    shard_results: list[generation.ShardResult]  # in shard order
    final_stats: DispatcherStats | None = None  # None when no server was needed
    throughput: list[tuple[str, float]] = field(default_factory=list)
    engine_version: str | None = None
    plan_args: list[str] | None = None  # the memory plan's flags the servers ran (recalibrated at launch, or not)


def _generate(
    settings: Settings,
    spec: RunSpec,
    layout: RunLayout,
    chat: ChatTokenizer,
    plan: planning.ShardPlan,
    pending: dict[int, int],
    stream: finishing.StreamingFinish,
    progress_id: UUID,
    clock: report.StageClock,
    plan_args: Sequence[str] = (),
    memory_plan: MemoryPlan | None = None,
) -> _Generated:
    """Every shard generated (validated and tokenized as each is done); servers only when a shard has work left.

    `plan_args`: the memory plan's flags the servers start with (`serving` passes them to the fleet);
    `memory_plan`: the plan, whose predicted pools the fleet checks against each server's log.
    """
    logger = get_run_logger()
    if not any(pending.values()):  # a retry whose shards are all checkpointed loads no model
        logger.info("all %d shards are already generated (checkpoints): no servers started", len(plan.shard_ids))
        results = _generate_shards(plan, spec, layout, chat, None, stream)
        description = f"Generation of {spec.namespace}: all prompts settled before"
        update_progress_artifact(artifact_id=progress_id, progress=100.0, description=description)
        return _Generated(results)
    with serving(
        settings, spec, layout, plan_args=plan_args, memory_plan=memory_plan, start=start_servers_task
    ) as served:
        clock.mark("server start")
        settled_before = plan.n_prompts - sum(pending.values())
        label = f"Generation of {spec.namespace}: "
        reporter = report.ProgressReporter(
            served.dispatcher,
            plan.n_prompts,
            settled_before,
            progress_id,
            logger,
            label=label,
            turns=turn_mode(spec).step_tail(*_checkpoints(plan, layout), plan.n_prompts),
        )
        with reporter as progress:
            results = _generate_shards(plan, spec, layout, chat, served.dispatcher, stream)
        if progress.last_stats is not None:
            logger.info("%s", progress.last_stats.line())
        fleet = served.fleet
        return _Generated(
            results, progress.last_stats, progress.throughput_series(), fleet.engine_version, list(fleet.plan_args)
        )


def _checkpoints(plan: planning.ShardPlan, layout: RunLayout) -> tuple[list[Path], list[Path]]:
    """The plan's checkpoint files: (completions, rejects)."""
    return [layout.shard_completions(i) for i in plan.shard_ids], [layout.shard_rejects(i) for i in plan.shard_ids]


def _generate_shards(
    plan: planning.ShardPlan,
    spec: RunSpec,
    layout: RunLayout,
    chat: ChatTokenizer,
    dispatcher: Dispatcher | None,
    stream: finishing.StreamingFinish,
) -> list[generation.ShardResult]:
    """One generate task per shard; each shard is validated and tokenized once it and those before it are done."""
    futures = [
        generate_shard_task.with_options(result_storage=layout.root / "task-results").submit(
            shard_id, plan.plan_sha256, chat.fingerprint, spec, layout, dispatcher, chat
        )
        for shard_id in plan.shard_ids
    ]
    results: list[generation.ShardResult] = []
    for future in as_completed(futures):
        results.append(future.result())
        for ready in stream.ready(results[-1]):
            finish_shard_task(stream, ready)  # while later shards generate
    return sorted(results, key=lambda r: r.shard_id)


@flow(
    name="expand-dataset",
    task_runner=cast("TaskRunner[PrefectFuture[Any]]", ThreadPoolTaskRunner(max_workers=SHARDS_IN_FLIGHT)),
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
    return failure.reported(_expand_dataset, spec, dry_run)


def _expand_dataset(spec: RunSpec, dry_run: bool) -> dict[str, Any]:
    logger = get_run_logger()
    report.quiet_per_shard_completions()  # no line per shard task run: the progress lines stay readable
    settings = Settings()
    paths.secure_run(settings, spec)  # run paths under the box's roots, a private work dir: before anything
    store = ObjectStore.from_settings(settings)
    if spec.namespace == AUTO_NAMESPACE:
        spec = spec.model_copy(update={"namespace": catalog.next_expansion_namespace(store)})
        logger.info("namespace 'auto' -> %s", spec.namespace)
        report.rename_flow_run(AUTO_NAMESPACE, spec.namespace)
    layout = RunLayout.for_target(settings.work_dir, spec.namespace, settings.s3_target)
    layout.root.mkdir(parents=True, exist_ok=True)
    if not dry_run and (done := published_before(store, spec, layout)) is not None:
        return done
    clock = report.StageClock()

    env_results = check_environment_task(settings, spec, store)
    publishing.refuse_other_run(store, spec.namespace, spec.model_dump(mode="json"))  # before any work
    gpu_description = "; ".join(r.detail for r in env_results if r.name.startswith("gpu.") and r.status == "pass")
    ctx = FlowRunContext.get()
    run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    chat = ChatTokenizer.shared(spec.model_path)
    # Prompts an earlier namespace published are skipped (this run's own part is not: a rerun plans the same).
    # Repaired first: a namespace whose run was killed between manifest and part would be generated again.
    for repaired in catalog.repair(store) if spec.skip_published else []:
        logger.warning("catalog: namespace %s was published without its catalog part; backfilled it", repaired)
    skip = (
        catalog.published_prompt_ids(store, exclude={spec.namespace}, retry=spec.retry_rejected)
        if spec.skip_published
        else set()
    )
    # Rows another namespace published as load rejects: skipped like published prompts, neither judged by the
    # gates nor published again (a source's permanent broken rows must not fail every later expansion).
    old_rejects = catalog.published_load_rejects(store, exclude={spec.namespace}) if spec.skip_published else set()
    projection = pilot.load_projection(settings.work_dir, spec.pilot) if spec.pilot else None
    select, selection = ordering.run_filter(
        spec, skip, layout.root / "sort-spill", projection.length_model if projection else None
    )
    clock.mark("environment checks, tokenizer, catalog")
    plan = plan_task(spec, layout, select=select, published=skip, old_rejects=old_rejects)
    clock.mark("planning")
    logger.info(
        "planned %d prompts in %d shards (%d load rejects; skipped as published before: %d prompts and %d old rejects)",
        plan.n_prompts,
        len(plan.shard_ids),
        plan.n_load_rejects,
        plan.n_skipped_published,
        plan.n_old_rejects_skipped,
    )
    if selection is not None:
        create_markdown_artifact(
            markdown="# Selection\n\n```json\n" + selection.model_dump_json(indent=1) + "\n```\n",
            key="selection",
            description=f"Which prompts {spec.namespace} took: skipped as published, over target, selected",
        )
    load_gate_task(plan, spec.quality_gate, layout)  # bad input fails here, before any server starts
    if plan.n_prompts == 0:
        markdown, message = report.nothing_to_do_report(
            spec.namespace,
            [src.path for src in spec.sources],
            plan.n_skipped_published,
            [n for n in catalog.catalog_namespaces(store) if n != spec.namespace] if skip else [],
            plan.n_load_rejects,
            spec.skip_published,
            selection.model_dump() if selection is not None else None,
            plan.n_rows_in_sources,
            n_old_rejects=plan.n_old_rejects_skipped,
        )
        create_markdown_artifact(
            markdown=markdown, key="run-report", description=f"Run report of {spec.namespace}: nothing to do"
        )
        logger.warning("%s", message)
        summary = {
            "uri": None,
            "namespace": spec.namespace,
            "prompts": 0,
            "rows_read": plan.n_rows,
            "skipped_published": plan.n_skipped_published,
            "old_rejects_skipped": plan.n_old_rejects_skipped,
            "load_rejects": plan.n_load_rejects,
        }
        # A Completed state with a message: the run list and the run page say "nothing new" at a glance.
        return cast("dict[str, Any]", Completed(message=message, data={**summary, "message": message}))
    # After planning: the plan sizes for the prompts as rendered, the pilot's measured output and its trial.
    kept, kept_why = plan_trial.kept_candidate(projection.engine if projection else None)
    # The radix cache's trade: the steps per conversation the pilot measured, else the recording's count.
    turns, turns_source = pilot.plan_turns(projection, planning.conversation_turns(plan, layout))
    memory_plan, memory_why = memory_plan_task(
        settings,
        spec,
        None,
        float(projection.output_tokens["mean"]) if projection else None,
        planning.prompt_tokens(plan, layout, spec),
        turns_per_conversation=turns,
        turns_source=turns_source,
        prefer=kept,
        prefer_why=kept_why,
    )
    logger.info("memory plan: %s", memory_why)
    if memory_plan is not None and memory_plan.radix_cache.get("why"):
        radix = memory_plan.radix_cache
        logger.info("radix cache %s: %s", "kept" if radix["kept"] else "off", radix["why"])
    if spec.pilot:
        reused = import_pilot_task(RunLayout.for_run(settings.work_dir, spec.pilot), layout, plan, spec, chat)
        logger.info("reused %d completions of pilot %s", reused.imported_completions, spec.pilot)

    progress_id = cast(
        UUID,
        create_progress_artifact(
            progress=0.0,
            key="generation-progress",
            description=f"Generation of {spec.namespace}: {turn_mode(spec).progress_label}, of {plan.n_prompts}",
        ),
    )
    pending = pending_task(plan.shard_ids, layout, chat, spec)
    stream = finishing.StreamingFinish(plan.shard_ids, layout, chat, spec)
    plan_args = memory_plan.plan_args if memory_plan else []
    generated = _generate(
        settings, spec, layout, chat, plan, pending, stream, progress_id, clock, plan_args, memory_plan
    )
    shard_results, final_stats = generated.shard_results, generated.final_stats
    if generated.plan_args is not None and generated.plan_args != list(plan_args):
        # The fleet found the engine's pools short of the plan and relaunched with it recalibrated (issue 37).
        plan_args = generated.plan_args
    clock.mark("generation")

    note = f"kept by the pilot's side-by-side trial: {kept_why}" if memory_plan and memory_plan.kept_by_trial else None
    tokenized = finish_dataset(
        spec,
        layout,
        chat,
        plan.n_load_rejects,
        shard_results,
        run_id,
        stream,
        plan_args,
        plan_note=note,
        skipped=(plan.n_skipped_published, plan.n_old_rejects_skipped),
    )
    clock.mark("validation + tokenization")
    turn_counts = turn_mode(spec).conversation_counts(*_checkpoints(plan, layout), plan.n_prompts, tokenized.outcomes)
    lineage = manifest_lineage(
        spec,
        chat,
        settings,
        plan,
        tokenized,
        first_attempt=pin_facts(layout.pinned_facts, run_id),  # written by finish_dataset
        engine_version=generated.engine_version,
        hardware={
            "gpu": gpu_description,
            "memory_plan": memory_plan.lineage() if memory_plan else {"skipped": memory_why},
        },
        conversations=turn_counts,
        published={"published": tokenized.conversations, "published_user_turns": tokenized.turns},
    )
    published = publish_dataset(spec, layout, store, lineage, dry_run)
    clock.mark("publish")
    dataset_link = (  # a dry run published nothing: no card to open
        published.uri
        if dry_run
        else report.dataset_link(store, published.uri, settings.s3_console_url, settings.s3_link_expiry_s)
    )
    create_link_artifact(
        link=dataset_link,
        link_text=f"dataset {spec.namespace}: {tokenized.n_rows:,} rows, {report.human_bytes(published.bytes)}",
        key="published-dataset",
        description=f"Where {spec.namespace} was published ({published.uri}); `datagen inspect {spec.namespace}`",
    )
    facts = report.RunFacts(
        namespace=spec.namespace,
        uri=published.uri,
        dry_run=dry_run,
        prompts=plan.n_prompts,
        shards=len(plan.shard_ids),
        rows=tokenized.n_rows,
        rejects=tokenized.n_rejects,
        rejects_by_reason=tokenized.rejects_by_reason,
        output_tokens=sum(r.output_tokens for r in shard_results),
        dataset_bytes=published.bytes,
        servers=len(final_stats.servers) if final_stats else 0,
        generation_s=clock.stages.get("generation", 0.0),
        stages=clock.stages,
        wall_s=clock.elapsed_s,
        shards_reused=sum(1 for n in pending.values() if n == 0),
        generated_tokens=final_stats.output_tokens if final_stats else 0,
        server_s=clock.stages.get("server start", 0.0) + clock.stages.get("generation", 0.0),
        final_stats=final_stats,
        throughput=generated.throughput,
        lengths=report.completion_lengths(Path(r.completions_path) for r in shard_results),
        conversations=turn_counts,
        link=dataset_link,
        skipped_published=plan.n_skipped_published,
        old_rejects_skipped=plan.n_old_rejects_skipped,
        duplicate_rows=tokenized.duplicate_rows,
    )
    create_markdown_artifact(
        markdown=report.run_report(facts),
        key="run-report",
        description=f"Run report of {spec.namespace}: rows, rejects, throughput, GPU-hours, time per stage",
    )
    logger.info("published %s", published.uri)
    return facts.summary()
