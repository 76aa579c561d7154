"""One run, whatever runs it: open, plan, generate, finish and publish (issue 46).

    run_dataset(spec, dry_run, generator)      # expand-dataset: generator = this box's fleet
                                               # expand-dataset-multibox: generator = the boxes, through S3
      open_run      settings, private paths, S3, namespace (`auto` resolved), layout, the namespace's lease
      published?    a namespace an earlier attempt of this run published: its catalog part, and done
      check         the generator's own checks (GPUs here, or S3 for the boxes), another run spec refused
      plan_run      the catalog's skips, filters, targets and order, shards, the load gate, nothing-to-do
      generate      the generator's part: which servers generate which shard
      finish_run    validation, gates, tokenization, dataset card, lineage, publish, catalog, run report

The stages' bodies are plain functions in `tasks/`; this module wraps each once with `task(...)`, where names,
retries and caching are visible together, and every flow module uses these wrappers (no flow imports another).
Tasks pass references (paths, counts, checksums), never the records themselves.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, cast

from prefect import get_run_logger, task
from prefect.artifacts import create_link_artifact, create_markdown_artifact, create_table_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.schemas.objects import State
from prefect.context import FlowRunContext, TaskRunContext
from prefect.futures import as_completed
from prefect.states import Completed

import datagen
from datagen import paths
from datagen.chat import ChatTokenizer
from datagen.checks import CheckResult
from datagen.checks.quality import GateReport, ValidationSummary, check_quality_gate, render_validation_report
from datagen.conversation.turn_mode import turn_mode
from datagen.engine import plan_trial
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.launcher import ServerFleet
from datagen.engine.memory_plan import MemoryPlan, PromptTokens, numerics_flags
from datagen.engine.stats import DispatcherStats
from datagen.identity import KnownPrompts, KnownRejects, generation_cache_key
from datagen.layout import RunLayout
from datagen.operations import diskspace, report
from datagen.publishing import catalog
from datagen.publishing.dataset_card import Lineage, write_dataset_card
from datagen.publishing.pinned import PinnedFacts, pin_facts
from datagen.publishing.run_lease import RunLease, local_lock
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

__all__ = [
    "SHARDS_IN_FLIGHT",
    "Generated",
    "Generator",
    "Planned",
    "Run",
    "box_memory_plan",
    "finish_dataset",
    "generate_shards",
    "hold_namespace",
    "open_run",
    "publish_dataset",
    "published_before",
    "retry_unless_disk_full",
    "run_dataset",
]

log = logging.getLogger(__name__)

# How many shards are in flight at once. Every in-flight shard feeds its requests to the one dispatcher,
# and a shard's worker waits for its slowest (longest) generation before it takes the next shard, so
# shards in flight x shard size must stay well above the box's slots (8 servers x ~76 = ~600) even while
# several shards sit on their last long request; 4 shards drained the servers in the benchmark.
SHARDS_IN_FLIGHT = 32


def retry_unless_disk_full(task: object, task_run: object, state: State[Any]) -> bool:
    """Prefect's retry condition of every retried task: a full disk is not retried (waiting does not free it).

    The run then fails at once and its reason names the path (datagen.operations.failure,
    datagen.operations.diskspace), instead of failing the same way after 70 s of retry delays.
    """
    return not (isinstance(state.data, BaseException) and diskspace.full_disk(state.data) is not None)


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
    dispatcher: Any,
    chat: ChatTokenizer,
) -> generation.ShardResult:
    return generation.generate_shard(shard_id, layout, dispatcher, chat, spec)


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
    gate_report = check_quality_gate(
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
        markdown=render_validation_report(summary, gate_report),
        key="validation-report",
        description=f"Validation of {namespace}: per-sample verdicts, reject reasons with examples, the quality gate",
    )
    gate_report.raise_if_failed()  # inside the task: the gate itself is the red task, its report the message
    return gate_report


check_environment_task = task(name="check environment", cache_policy=NO_CACHE)(_check_environment)
s3_preflight_task = task(name="s3 preflight", cache_policy=NO_CACHE)(s3_preflight)
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


# --- open -------------------------------------------------------------------------------------------


@dataclass
class Run:
    """An opened run: where it writes, what it reads, who it is. `lease`: its hold on the namespace (None: dry)."""

    settings: Settings
    spec: RunSpec
    store: ObjectStore
    layout: RunLayout
    run_id: str | None
    run_name: str | None
    dry_run: bool
    clock: report.StageClock = field(default_factory=report.StageClock)
    lease: RunLease | None = None
    checks: list[CheckResult] = field(default_factory=list)  # the generator's checks, as they passed

    @functools.cached_property
    def chat(self) -> ChatTokenizer:
        """The model's tokenizer and chat template (loaded on first use: after the environment checks)."""
        return ChatTokenizer.shared(self.spec.model_path)


def _flow_run() -> tuple[str | None, str | None, str]:
    ctx = FlowRunContext.get()
    if ctx and ctx.flow_run:
        return str(ctx.flow_run.id), ctx.flow_run.name, ctx.flow.name if ctx.flow else ""
    return None, None, ""


@contextmanager
def open_run(spec: RunSpec, *, layout_name: str | None = None, sources: bool = True) -> Iterator[Run]:
    """The run opened, its work dir locked against another run on this box (flock) until the block ends.

    `layout_name`: the work dir's run folder when it is not the namespace's (a pilot's: `auto` kept as it is).
    `sources`: whether this process reads the prompt sources (a box of a multi-box run reads the plan from S3).
    """
    logger = get_run_logger()
    settings = Settings()
    paths.secure_run(settings, spec, sources=sources)  # run paths under the box's roots, a private work dir
    store = ObjectStore.from_settings(settings)
    if spec.namespace == AUTO_NAMESPACE and layout_name is None:
        spec = spec.model_copy(update={"namespace": catalog.next_expansion_namespace(store)})
        logger.info("namespace 'auto' -> %s", spec.namespace)
        report.rename_flow_run(AUTO_NAMESPACE, spec.namespace)
    # One work dir per (S3 target, namespace): a namespace of that name under another prefix is another run.
    layout = (
        RunLayout.for_run(settings.work_dir, layout_name)
        if layout_name is not None
        else RunLayout.for_target(settings.work_dir, spec.namespace, settings.s3_target)
    )
    run_id, run_name, flow_name = _flow_run()
    with local_lock(layout.root, f"{flow_name} {run_name or ''} {run_id or ''}".strip()):
        yield Run(settings, spec, store, layout, run_id, run_name, dry_run=False)


@contextmanager
def hold_namespace(run: Run) -> Iterator[None]:
    """The namespace's lease in S3 for the block (none for a dry run, which writes nothing there)."""
    if run.dry_run:
        yield
        return
    _, _, flow_name = _flow_run()
    owner = (run.run_id or secrets.token_hex(8)).replace("-", "")
    lease = RunLease(
        run.store,
        run.spec.namespace,
        owner,
        run_name=run.run_name or "",
        flow=flow_name,
        lease_s=run.settings.run_lease_s,
    )
    with lease:
        run.lease = lease
        try:
            yield
        finally:
            run.lease = None


def published_before(run: Run) -> dict[str, Any] | None:
    """The summary of a run whose earlier attempt already published it (killed after its manifest), else None.

    Its catalog part is written if it is missing; nothing else is done (no servers, no generation). Staged files
    are shared by every run of the namespace on this box, so a namespace another run spec published is refused
    (PublishError naming that run) before they are compared. Without staged files it touches nothing.
    """
    spec, store, layout = run.spec, run.store, run.layout
    if run.dry_run or not layout.staging_dir.is_dir():
        return None
    publishing.refuse_other_run(store, spec.namespace, spec.model_dump(mode="json"))
    manifest = publishing.published_as_staged(store, spec.namespace, layout.staging_dir)
    message = f"{spec.namespace} was published by an earlier attempt of this run; its catalog part is in place"
    if manifest is None and (claim := publishing.claimed_as_staged(store, spec.namespace, layout.staging_dir)):
        # Killed in its publish: finish it from the files it claimed (issue 47: the claim's bytes, whatever code).
        publish_dataset(run, claim.get("lineage") or {})
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


# --- plan -------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Planned:
    """What the run generates: the shard plan and what planning learned (prompt lengths, turns, the pilot)."""

    plan: planning.ShardPlan
    prompt_tokens: PromptTokens | None
    recorded_turns: float
    projection: pilot.Projection | None


def published_skips(run: Run) -> tuple[KnownPrompts, KnownRejects]:
    """Prompt ids and load-reject keys other namespaces published (after repairing the catalog), or none."""
    spec, store = run.spec, run.store
    if not spec.skip_published:
        return KnownPrompts(), KnownRejects()
    # Repaired first: a namespace whose run was killed between manifest and part would be generated again.
    for repaired in catalog.repair(store):
        get_run_logger().warning("catalog: namespace %s was published without its catalog part; backfilled", repaired)
    exclude = set() if spec.namespace == AUTO_NAMESPACE else {spec.namespace}
    skip = catalog.published_prompt_ids(store, exclude=exclude, retry=spec.retry_rejected)
    # Rows another namespace published as load rejects: skipped like published prompts, neither judged by the
    # gates nor published again (a source's permanent broken rows must not fail every later expansion).
    return skip, catalog.published_load_rejects(store, exclude=exclude)


def plan_run(run: Run) -> Planned | dict[str, Any]:
    """The shards of what is new (filters, targets, order), gated on load rejects; a summary when nothing is."""
    logger = get_run_logger()
    spec, layout, settings = run.spec, run.layout, run.settings
    skip, old_rejects = published_skips(run)
    projection = pilot.load_projection(settings.work_dir, spec.pilot) if spec.pilot else None
    select, selection = ordering.run_filter(
        spec, skip, layout.root / "sort-spill", projection.length_model if projection else None
    )
    run.clock.mark("environment checks, tokenizer, catalog")
    plan = plan_task(spec, layout, select=select, published=skip, old_rejects=old_rejects)
    run.clock.mark("planning")
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
        return _nothing_to_do(run, plan, bool(skip), selection.model_dump() if selection is not None else None)
    return Planned(
        plan, planning.prompt_tokens(plan, layout, spec), planning.conversation_turns(plan, layout), projection
    )


def _nothing_to_do(
    run: Run, plan: planning.ShardPlan, skipping: bool, selection: dict[str, Any] | None
) -> dict[str, Any]:
    spec = run.spec
    markdown, message = report.nothing_to_do_report(
        spec.namespace,
        [src.path for src in spec.sources],
        plan.n_skipped_published,
        [n for n in catalog.catalog_namespaces(run.store) if n != spec.namespace] if skipping else [],
        plan.n_load_rejects,
        spec.skip_published,
        selection,
        plan.n_rows_in_sources,
        n_old_rejects=plan.n_old_rejects_skipped,
    )
    create_markdown_artifact(
        markdown=markdown, key="run-report", description=f"Run report of {spec.namespace}: nothing to do"
    )
    get_run_logger().warning("%s", message)
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


def box_memory_plan(
    settings: Settings,
    spec: RunSpec,
    prompt_tokens: PromptTokens | None,
    recorded_turns: float,
    projection: pilot.Projection | None,
) -> tuple[MemoryPlan | None, str]:
    """The memory plan of this box's GPUs, from the run's prompts and, where its pilot ran here, what it measured
    (output lengths, steps per conversation, the plan its trial kept)."""
    turns, turns_source = pilot.plan_turns(projection, recorded_turns)
    plan, why = memory_plan_task(
        settings,
        spec,
        None,
        float(projection.output_tokens["mean"]) if projection else None,
        prompt_tokens,
        turns_per_conversation=turns,
        turns_source=turns_source,
        **plan_trial.kept_plan(projection.engine if projection else None),
    )
    get_run_logger().info("memory plan: %s", why)
    if plan is not None and plan.radix_cache.get("why"):
        radix = plan.radix_cache
        get_run_logger().info("radix cache %s: %s", "kept" if radix["kept"] else "off", radix["why"])
    return plan, why


# --- generate ---------------------------------------------------------------------------------------


@dataclass
class Generated:
    """What generation left for finishing: the shards' checkpoints and what the run report and lineage say of it.

    `stream`: shards validated and tokenized while generating (None: every shard is finished afterwards).
    `hardware`: the lineage's record of the GPUs and memory plans, `plan_args` (or `plan_args_by_box`) and
    `plan_note` the dataset card's; `published_extra`: counts for the lineage's conversations block;
    `report_extra`: the flow's summary beyond the run report's.
    """

    shard_results: list[generation.ShardResult]
    hardware: dict[str, Any]
    stream: finishing.StreamingFinish | None = None
    engine_version: str | None = None
    plan_args: list[str] = field(default_factory=list)
    plan_args_by_box: dict[str, list[str]] = field(default_factory=dict)
    plan_note: str | None = None
    final_stats: DispatcherStats | None = None
    throughput: list[tuple[str, float]] = field(default_factory=list)
    shards_reused: int = 0
    published_extra: dict[str, int] = field(default_factory=dict)
    report_extra: dict[str, Any] = field(default_factory=dict)


class Generator(Protocol):
    """Who generates which shard: this box's fleet, or the boxes of a multi-box run."""

    def check(self, run: Run) -> list[CheckResult]:
        """What must hold before planning (GPUs and S3 here; S3 for a parent of boxes)."""
        ...

    def generate(self, run: Run, planned: Planned) -> Generated:
        """Every shard of the plan generated, checkpoints local to `run.layout`."""
        ...


def generate_shards(
    plan: planning.ShardPlan, run: Run, dispatcher: Dispatcher | None, stream: finishing.StreamingFinish | None
) -> list[generation.ShardResult]:
    """One generate task per shard; with a `stream`, each shard is validated and tokenized once it and those before
    it are done (while later shards generate)."""
    futures = [
        generate_shard_task.with_options(result_storage=run.layout.root / "task-results").submit(
            shard_id, plan.plan_sha256, run.chat.fingerprint, run.spec, run.layout, dispatcher, run.chat
        )
        for shard_id in plan.shard_ids
    ]
    results: list[generation.ShardResult] = []
    for future in as_completed(futures):
        results.append(future.result())
        if stream is not None:
            for ready in stream.ready(results[-1]):
                finish_shard_task(stream, ready)
    return sorted(results, key=lambda r: r.shard_id)


# --- finish -----------------------------------------------------------------------------------------


def finish_dataset(run: Run, plan: planning.ShardPlan, generated: Generated) -> tokenization.TokenizationSummary:
    """Gate what the stream validated, close tokenization, gate again and write the dataset card."""
    spec, layout, chat = run.spec, run.layout, run.chat
    shard_results = generated.shard_results
    stream = generated.stream
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
    final = gate_task(
        summary,
        spec.quality_gate,
        upstream_reasons,
        list(tokenized.reject_files),
        # Every tokenize reject by its reason: "tokenize=3" said nothing a person could act on.
        {k: v for k, v in tokenized.rejects_by_reason.items() if k.startswith("tokenize/")},
        namespace=spec.namespace,
        published_before=plan.n_skipped_published,
    )
    pinned = pin_facts(layout.pinned_facts, run.run_id, run.run_name)
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
            memory_plan=list(generated.plan_args),
            memory_plan_by_box={box: list(args) for box, args in generated.plan_args_by_box.items()},
            memory_plan_note=generated.plan_note,
            # The first attempt's: a re-run must publish the README.md its interrupted attempt claimed.
            run_id=pinned.run_id,
            created_at=pinned.created_at,
            skipped_published=plan.n_skipped_published,
            old_rejects_skipped=plan.n_old_rejects_skipped,
        ),
        sizes=tokenized.sizes(),
    )
    return tokenized


def manifest_lineage(
    run: Run,
    plan: planning.ShardPlan,
    tokenized: tokenization.TokenizationSummary,
    generated: Generated,
    first_attempt: PinnedFacts,
) -> dict[str, Any]:
    """The manifest's lineage: the spec, the model, the engine, the hardware and memory plans, the counts.

    `first_attempt`: the run id and name of the run's first attempt, named when another run spec targets this
    namespace (publishing.refuse_other_run); like the card's, so a re-run publishes the bytes its interrupted
    attempt claimed.
    """
    spec, chat = run.spec, run.chat
    turn_counts = _turn_counts(run, plan, generated, tokenized)
    lineage = {
        "run_spec": spec.model_dump(mode="json"),
        "run_id": first_attempt.run_id,
        "run_name": first_attempt.run_name,
        "model_path": spec.model_path,
        "model_fingerprint": chat.fingerprint,
        "chat_template_hash": chat.template_hash,
        "engine": run.settings.engine,
        "engine_version": generated.engine_version,
        **generated.hardware,
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
    if turn_counts is None:
        return lineage
    published = {"published": tokenized.conversations, "published_user_turns": tokenized.turns}
    return lineage | {"conversations": turn_counts.summary() | published | generated.published_extra}


def _turn_counts(
    run: Run, plan: planning.ShardPlan, generated: Generated, tokenized: tokenization.TokenizationSummary
) -> Any:
    """An every-turn run's conversation counts from its checkpoint lines and what was published (None: `last`)."""
    results = generated.shard_results
    return turn_mode(run.spec).conversation_counts(
        [Path(r.completions_path) for r in results],
        [Path(r.rejects_path) for r in results],
        plan.n_prompts,
        tokenized.outcomes,
    )


def publish_dataset(run: Run, lineage: dict[str, Any]) -> publishing.PublishResult:
    """Publish the staged dataset, then its catalog part (every flow that publishes goes through here)."""
    spec, layout, store = run.spec, run.layout, run.store
    if run.lease is not None:
        run.lease.check()  # a run that lost its namespace to another writes nothing more
    created_at = pin_facts(layout.pinned_facts, None).created_at  # the first attempt's, like the card's
    published = publish_task(
        layout.staging_dir, spec.namespace, store, lineage, dry_run=run.dry_run, created_at=created_at
    )
    if not run.dry_run:
        # After the manifest: a crash in between leaves a published namespace without a part, which
        # catalog.repair recovers before the next plan; the reverse would skip prompts never published.
        catalog_task(store, spec.namespace, layout.staging_dir)
    return published


def finish_run(run: Run, planned: Planned, generated: Generated) -> dict[str, Any]:
    """Validate, tokenize, gate, publish and report what generation left; the flow's summary."""
    plan, spec, settings, store = planned.plan, run.spec, run.settings, run.store
    tokenized = finish_dataset(run, plan, generated)
    run.clock.mark("validation + tokenization")
    lineage = manifest_lineage(run, plan, tokenized, generated, pin_facts(run.layout.pinned_facts, run.run_id))
    published = publish_dataset(run, lineage)
    run.clock.mark("publish")
    link = (  # a dry run published nothing: no card to open
        published.uri
        if run.dry_run
        else report.dataset_link(store, published.uri, settings.s3_console_url, settings.s3_link_expiry_s)
    )
    create_link_artifact(
        link=link,
        link_text=f"dataset {spec.namespace}: {tokenized.n_rows:,} rows, {report.human_bytes(published.bytes)}",
        key="published-dataset",
        description=f"Where {spec.namespace} was published ({published.uri}); `datagen inspect {spec.namespace}`",
    )
    facts = _run_facts(run, planned, generated, tokenized, published, link)
    create_markdown_artifact(
        markdown=report.run_report(facts),
        key="run-report",
        description=f"Run report of {spec.namespace}: rows, rejects, throughput, GPU-hours, time per stage",
    )
    get_run_logger().info("published %s", published.uri)
    return facts.summary() | generated.report_extra


def _run_facts(
    run: Run,
    planned: Planned,
    generated: Generated,
    tokenized: tokenization.TokenizationSummary,
    published: publishing.PublishResult,
    link: str,
) -> report.RunFacts:
    plan, clock, stats, results = planned.plan, run.clock, generated.final_stats, generated.shard_results
    return report.RunFacts(
        namespace=run.spec.namespace,
        uri=published.uri,
        dry_run=run.dry_run,
        prompts=plan.n_prompts,
        shards=len(plan.shard_ids),
        rows=tokenized.n_rows,
        rejects=tokenized.n_rejects,
        rejects_by_reason=tokenized.rejects_by_reason,
        output_tokens=sum(r.output_tokens for r in results),
        dataset_bytes=published.bytes,
        servers=len(stats.servers) if stats else 0,
        generation_s=clock.stages.get("generation", 0.0),
        stages=clock.stages,
        wall_s=clock.elapsed_s,
        shards_reused=generated.shards_reused,
        generated_tokens=stats.output_tokens if stats else 0,
        server_s=clock.stages.get("server start", 0.0) + clock.stages.get("generation", 0.0),
        final_stats=stats,
        throughput=generated.throughput,
        lengths=report.completion_lengths(Path(r.completions_path) for r in results),
        conversations=_turn_counts(run, plan, generated, tokenized),
        link=link,
        skipped_published=plan.n_skipped_published,
        old_rejects_skipped=plan.n_old_rejects_skipped,
        duplicate_rows=tokenized.duplicate_rows,
    )


# --- the skeleton -----------------------------------------------------------------------------------


def run_dataset(spec: RunSpec, dry_run: bool, generator: Generator) -> dict[str, Any]:
    """One run: open, the generator's checks, plan, generate, finish and publish."""
    report.quiet_per_shard_completions()  # no line per shard task run: the progress lines stay readable
    with open_run(spec) as run:
        run.dry_run = dry_run
        if (done := published_before(run)) is not None:  # an earlier attempt of this run published it: done
            return done
        # What must hold (GPUs, S3) before the namespace is taken: a check that fails says so in its own row.
        run.checks = generator.check(run)
        with hold_namespace(run):
            spec = run.spec
            publishing.refuse_other_run(run.store, spec.namespace, spec.model_dump(mode="json"))  # before any work
            planned = plan_run(run)
            if not isinstance(planned, Planned):
                return planned
            generated = generator.generate(run, planned)
            run.clock.mark("generation")
            return finish_run(run, planned, generated)
