"""Multi-box runs: a parent flow spreads a run's shards over GPU boxes, one per-box child flow on each box.

    expand-dataset-multibox (anywhere, e.g. a control worker)     generate-on-box (one per box, on its worker)
      plan shards, upload them to S3                                provision this box's servers (its Settings)
      run_deployment(generate-on-box, work_queue=<box>) per box     loop: claim a shard in S3 (lease),
      wait for every shard's done marker in S3                        restore its parts, generate, upload parts,
      collect parts (dedupe by request_key; per conversation        write its done marker
        in `turns: every` mode) -> validate ->
      gate -> tokenize -> gate -> publish                           until every shard is done

S3 (tasks/shard_exchange.py) is the source of truth: claims with leases make the split dynamic (a box
that finishes early claims more; a dead box's leases lapse and another box resumes its shards from the
uploaded parts). Prefect only starts, links and shows the runs.
"""

from __future__ import annotations

import secrets
import socket
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import (
    create_link_artifact,
    create_markdown_artifact,
    create_progress_artifact,
    update_progress_artifact,
)
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment
from prefect.futures import PrefectFuture, wait
from prefect.states import Crashed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from datagen import paths
from datagen.chat import ChatTokenizer
from datagen.conversation.turn_mode import turn_mode
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.memory_plan import MemoryPlan, PromptTokens
from datagen.layout import RunLayout
from datagen.operations import alerts, failure
from datagen.operations.report import dataset_link, quiet_per_shard_completions, run_name
from datagen.publishing.pinned import pin_facts
from datagen.publishing.storage import ObjectStore, s3_preflight
from datagen.runspec import ExchangeSpec, MultiBoxSpec, RunSpec
from datagen.settings import Settings
from flows.expand_dataset import (
    check_environment_task,
    finish_dataset,
    load_gate_task,
    manifest_lineage,
    memory_plan_task,
    plan_task,
    publish_dataset,
    published_before,
)
from tasks import generation, pilot, planning, publishing
from tasks.planning import ShardPlan
from tasks.serving import serving
from tasks.shard_exchange import CheckpointSync, CollectedShard, Lease, ShardExchange, ShardExchangeError

__all__ = ["BoxMismatch", "expand_dataset_multibox", "generate_on_box"]

# A shard that failed this often on one box fails that box's run (another box or a re-run takes it over).
MAX_SHARD_FAILURES_PER_BOX = 3
TERMINAL = {"COMPLETED", "FAILED", "CRASHED", "CANCELLED"}


class BoxMismatch(RuntimeError):
    """A per-box run reached a worker whose box name differs from the one it was sent to."""


def _owner_token() -> str:
    ctx = FlowRunContext.get()
    return ctx.flow_run.id.hex[:12] if ctx and ctx.flow_run else secrets.token_hex(6)


# --- per-box flow ------------------------------------------------------------------------------------


def _generate_claimed_shard(
    lease: Lease,
    exchange: ShardExchange,
    plan: ShardPlan,
    spec: RunSpec,
    layout: RunLayout,
    dispatcher: Dispatcher,
    chat: ChatTokenizer,
    sync_interval_s: float,
    engine_version: str | None,
    memory_plan: dict[str, Any] | None = None,
) -> generation.ShardResult:
    shard_id = lease.shard_id
    exchange.fetch_prompts(plan, shard_id, layout)
    # Rows other boxes (or this box before a crash) finished are in S3: the ledger skips them.
    known = exchange.restore_checkpoint(shard_id, layout)
    with CheckpointSync(exchange, lease, layout, known, sync_interval_s) as sync:
        result = generation.generate_shard(
            shard_id, layout, dispatcher, chat, spec, flush_interval_s=min(2.0, sync_interval_s / 2)
        )
    sync.sync_once()  # the rest, now that the shard is complete; raises if S3 refuses
    exchange.mark_done(result, engine_version, memory_plan)
    return result


generate_claimed_task = task(
    name="generate", task_run_name="generate shard-{lease.shard_id:05d}", cache_policy=NO_CACHE
)(_generate_claimed_shard)


@flow(
    name="generate-on-box",
    task_runner=cast("TaskRunner[PrefectFuture[Any]]", ThreadPoolTaskRunner(max_workers=64)),
    log_prints=True,
    flow_run_name=run_name("generate-on-box"),
    on_failure=[alerts.announce_failure],
)
def generate_on_box(
    spec: RunSpec = RunSpec(),  # noqa: B008
    box: str = "",
    exchange: ExchangeSpec = ExchangeSpec(),  # noqa: B008
    prompt_tokens: dict[str, Any] | None = None,
    turns_per_conversation: float = 1.0,
) -> dict[str, Any]:
    """Start this box's servers and generate claimed shards until every shard of the run is done.

    `prompt_tokens`/`turns_per_conversation`: the run's prompts as the parent planned them (this box fetches each
    shard's files as it claims it), for this box's memory plan on its own GPUs; the turns are the recording's
    count, replaced by the steps of the run's pilot where that pilot ran on this box.
    """
    return failure.reported(_generate_on_box, spec, box, exchange, prompt_tokens, turns_per_conversation)


def _generate_on_box(
    spec: RunSpec,
    box: str,
    exchange: ExchangeSpec,
    prompt_tokens: dict[str, Any] | None,
    turns_per_conversation: float,
) -> dict[str, Any]:
    logger = get_run_logger()
    quiet_per_shard_completions()  # no line per shard task run: the progress lines stay readable
    settings = Settings()
    paths.secure_run(settings, spec, sources=False)  # this box reads the plan from S3, not the sources
    this_box = settings.box_name or socket.gethostname()
    if box and box != this_box:
        raise BoxMismatch(f"this run is for box {box!r} but reached box {this_box!r} (DATAGEN_BOX_NAME)")
    store = ObjectStore.from_settings(settings)
    sx = _exchange(store, spec, this_box, exchange.lease_s)
    plan = sx.fetch_plan()
    if sx.done_ids() >= set(plan.shard_ids):
        logger.info("every shard is already done; nothing to start on %s", this_box)
        return {"box": this_box, "shards": [], "output_tokens": 0}

    check_environment_task(settings, spec, store)
    memory_plan, memory_why = _box_memory_plan(
        settings, spec, PromptTokens(**prompt_tokens) if prompt_tokens else None, turns_per_conversation
    )
    logger.info("box %s memory plan: %s", this_box, memory_why)
    plan_args = memory_plan.plan_args if memory_plan else []
    box_plan = _box_plan(memory_plan, memory_why)
    layout = RunLayout.for_target(settings.work_dir, spec.namespace, settings.s3_target)
    layout.root.mkdir(parents=True, exist_ok=True)
    chat = ChatTokenizer.shared(spec.model_path)
    finished: list[generation.ShardResult] = []
    failures: Counter[int] = Counter()
    with serving(settings, spec, layout, plan_args=plan_args, memory_plan=memory_plan) as served:
        dispatcher, fleet = served.dispatcher, served.fleet
        logger.info("box %s: %d servers up, owner token %s", this_box, len(fleet), sx.owner)
        inflight: dict[PrefectFuture[generation.ShardResult], int] = {}
        while True:
            while len(inflight) < exchange.shards_in_flight:
                lease = sx.claim_next(plan.shard_ids, exclude=set(inflight.values()))
                if lease is None:
                    break
                logger.info("box %s claimed shard %d (claim %d)", this_box, lease.shard_id, lease.seq)
                future = generate_claimed_task.submit(
                    lease,
                    sx,
                    plan,
                    spec,
                    layout,
                    dispatcher,
                    chat,
                    exchange.sync_interval_s,
                    fleet.engine_version,
                    box_plan,
                )
                inflight[future] = lease.shard_id
            if not inflight:
                if sx.done_ids() >= set(plan.shard_ids):
                    break
                # Every open shard is leased by a live box: wait, and take over any lease that lapses.
                time.sleep(min(exchange.sync_interval_s, exchange.lease_s / 4))
                continue
            done, _ = wait(list(inflight), timeout=exchange.sync_interval_s)
            for future in done:
                shard_id = inflight.pop(future)
                state = future.state
                if state.is_completed():
                    finished.append(future.result())
                    continue
                failures[shard_id] += 1
                logger.warning("shard %d failed on %s (%d times): %s", shard_id, this_box, failures[shard_id], state)
                if failures[shard_id] >= MAX_SHARD_FAILURES_PER_BOX:
                    future.result()  # raises the shard's error; its lease lapses and another box takes it
    report = {
        "box": this_box,
        "shards": sorted(r.shard_id for r in finished),
        "output_tokens": sum(r.output_tokens for r in finished),
    }
    logger.info("box %s done: %s", this_box, report)
    return report


def _box_memory_plan(
    settings: Settings, spec: RunSpec, prompt_tokens: PromptTokens | None, recorded_turns: float
) -> tuple[MemoryPlan | None, str]:
    """This box's memory plan for its own GPUs; the radix cache's trade from the pilot's steps if it ran here.

    Only the turns come from the pilot: the output is still planned at max_new_tokens, not the pilot's measured
    mean that a single-box run uses.
    """
    turns, turns_source = pilot.plan_turns_on_box(settings.work_dir, spec.pilot, recorded_turns)
    return memory_plan_task(
        settings, spec, None, None, prompt_tokens, turns_per_conversation=turns, turns_source=turns_source
    )


def _box_plan(plan: MemoryPlan | None, why: str) -> dict[str, Any]:
    """What a box's done markers say about its memory plan (the parent's lineage and card read it)."""
    if plan is None:
        return {"plan_args": [], "skipped": why}
    lineage = plan.lineage()
    keys = ("plan_args", "chosen", "running_requests_per_gpu", "default_running_requests_per_gpu", "context_tokens")
    return {k: lineage[k] for k in keys} | {"summary": why}


def plans_by_box(markers: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each box's memory plan, from the done markers of the shards it finished (the latest marker wins)."""
    out: dict[str, dict[str, Any]] = {}
    for marker in sorted(markers, key=lambda m: str(m.get("finished_at", ""))):
        if isinstance(marker.get("memory_plan"), dict):
            out[str(marker["box"])] = marker["memory_plan"]
    return out


# --- parent flow -------------------------------------------------------------------------------------


def _preflight(store: ObjectStore, namespace: str) -> None:
    failed = [r for r in s3_preflight(store, namespace, resume=True) if r.failed]
    if failed:
        raise ShardExchangeError("S3 checks failed:\n" + "\n".join(f"- {r.name}: {r.detail}" for r in failed))


def _exchange(store: ObjectStore, spec: RunSpec, box: str, lease_s: float) -> ShardExchange:
    """This process's handle on the run state; rows merge as the run's turn mode says (`TurnMode.merge_unit`)."""
    return ShardExchange(
        store,
        spec.namespace,
        box,
        _owner_token(),
        lease_s=lease_s,
        mode=turn_mode(spec),
        enable_thinking=spec.sampling.enable_thinking,
    )


def _collect(
    exchange: ShardExchange, plan: ShardPlan, layout: RunLayout, spec: RunSpec, chat: ChatTokenizer
) -> list[CollectedShard]:
    """Every shard's rows from S3 into the local layout: each request exactly once, or an error."""
    return [
        exchange.collect_shard(shard_id, layout, generation.conversation_keys(layout, shard_id, chat, spec))
        for shard_id in plan.shard_ids
    ]


preflight_task = task(name="s3 preflight", cache_policy=NO_CACHE)(_preflight)
publish_plan_task = task(name="upload plan", cache_policy=NO_CACHE)(ShardExchange.publish_plan)
collect_task = task(name="collect shards", cache_policy=NO_CACHE)(_collect)


def _launch_boxes(
    spec: RunSpec, boxes: MultiBoxSpec, prompt_tokens: PromptTokens | None, turns: float
) -> dict[str, UUID]:
    runs: dict[str, UUID] = {}
    for box in boxes.boxes:
        # timeout=0: the parent watches the shards in S3, not the child states (a dead box's run never ends).
        child = run_deployment(
            name=boxes.deployment,
            parameters={
                "spec": spec.model_dump(mode="json"),
                "box": box,
                "exchange": boxes.exchange.model_dump(mode="json"),
                "prompt_tokens": asdict(prompt_tokens) if prompt_tokens else None,
                "turns_per_conversation": turns,
            },
            work_queue_name=box,
            flow_run_name=f"{spec.namespace}-{box}",
            as_subflow=True,
            timeout=0,
        )
        runs[box] = cast(FlowRun, child).id
    return runs


def _wait_for_shards(exchange: ShardExchange, plan: ShardPlan, children: dict[str, UUID], boxes: MultiBoxSpec) -> None:
    """Block until every shard is done; fail when every child ended first. Then settle the children's states."""
    logger = get_run_logger()
    progress_id = cast(
        UUID,
        create_progress_artifact(progress=0.0, key="multibox-progress", description="Shards done across the boxes (%)"),
    )
    wanted = set(plan.shard_ids)
    last = -1
    with get_client(sync_client=True) as client:

        def states() -> dict[str, tuple[str, str]]:
            """Box -> (state type, state message) of its run."""
            out = {}
            for box, run_id in children.items():
                state = client.read_flow_run(run_id).state
                out[box] = (state.type.value, state.message or "") if state else ("PENDING", "")
            return out

        while True:
            done = exchange.done_ids() & wanted
            if len(done) != last:
                last = len(done)
                update_progress_artifact(artifact_id=progress_id, progress=100.0 * last / len(wanted))
                logger.info("%d of %d shards done", last, len(wanted))
            if done == wanted:
                break
            current = states()
            if all(s in TERMINAL for s, _ in current.values()):
                ended = "; ".join(f"{b} {s}" + (f" ({m})" if m else "") for b, (s, m) in current.items())
                raise ShardExchangeError(
                    f"every box run ended with shards {sorted(wanted - done)} not done: {ended}; run again with "
                    "the same namespace to resume (done shards and uploaded checkpoint parts are kept)"
                )
            time.sleep(boxes.poll_s)

        # A live box ends on its own once it sees every done marker; one that died never reports again.
        deadline = time.monotonic() + boxes.child_exit_grace_s
        while (
            pending := {b: s for b, (s, _) in states().items() if s not in TERMINAL}
        ) and time.monotonic() < deadline:
            time.sleep(boxes.poll_s)
        for box in pending:
            logger.warning(
                "box %s did not end %.0f s after all shards were done: marking it Crashed",
                box,
                boxes.child_exit_grace_s,
            )
            client.set_flow_run_state(
                children[box],
                Crashed(message=f"box {box} stopped reporting; every shard was finished by the other boxes"),
                force=True,
            )


@flow(
    name="expand-dataset-multibox",
    log_prints=True,
    flow_run_name=run_name("expand-dataset-multibox"),
    on_failure=[alerts.announce_failure],
)
def expand_dataset_multibox(
    spec: RunSpec = RunSpec(),  # noqa: B008
    boxes: MultiBoxSpec = MultiBoxSpec(),  # noqa: B008
    dry_run: bool = False,
) -> dict[str, Any]:
    """Spread a run's shards over several GPU boxes, then validate, tokenize and publish (never overwriting)."""
    return failure.reported(_expand_dataset_multibox, spec, boxes, dry_run)


def _expand_dataset_multibox(spec: RunSpec, boxes: MultiBoxSpec, dry_run: bool) -> dict[str, Any]:
    logger = get_run_logger()
    quiet_per_shard_completions()  # no line per shard task run: the progress lines stay readable
    started = time.monotonic()
    settings = Settings()
    paths.secure_run(settings, spec)  # run paths under the box's roots, a private work dir: before anything
    layout = RunLayout.for_target(settings.work_dir, spec.namespace, settings.s3_target)
    layout.root.mkdir(parents=True, exist_ok=True)
    store = ObjectStore.from_settings(settings)
    exchange = _exchange(store, spec, "parent", boxes.exchange.lease_s)
    ctx = FlowRunContext.get()
    run_id = str(ctx.flow_run.id) if ctx and ctx.flow_run else None
    if not dry_run and (done := published_before(store, spec, layout)) is not None:
        return done

    preflight_task(store, spec.namespace)
    publishing.refuse_other_run(store, spec.namespace, spec.model_dump(mode="json"))  # before any box starts
    chat = ChatTokenizer.shared(spec.model_path)
    plan = plan_task(spec, layout)
    load_gate_task(plan, spec.quality_gate, layout)  # bad input fails here, before any box starts a server
    publish_plan_task(exchange, plan, layout)
    logger.info("planned %d prompts in %d shards for boxes %s", plan.n_prompts, len(plan.shard_ids), boxes.boxes)

    prompt_tokens = planning.prompt_tokens(plan, layout, spec)  # each box plans its own GPUs for these prompts
    children = _launch_boxes(spec, boxes, prompt_tokens, planning.conversation_turns(plan, layout))
    _wait_for_shards(exchange, plan, children, boxes)
    collected = collect_task(exchange, plan, layout, spec, chat)
    shard_results = [c.result for c in collected]
    rows_by_box: Counter[str] = Counter()
    for c in collected:
        rows_by_box.update(c.rows_by_box)
    markers = [exchange.done_marker(s) for s in plan.shard_ids]
    shards_by_box = Counter(str(m["box"]) for m in markers)
    engine_versions = sorted({str(m["engine_version"]) for m in markers if m.get("engine_version")})

    box_plans = plans_by_box(markers)
    tokenized = finish_dataset(
        spec,
        layout,
        chat,
        plan.n_load_rejects,
        shard_results,
        run_id,
        plan_args_by_box={box: p.get("plan_args", []) for box, p in box_plans.items()},
        skipped=(plan.n_skipped_published, plan.n_old_rejects_skipped),
    )
    # Conversations and steps counted from the collected checkpoint lines (None in `last` mode: no such block).
    turn_counts = turn_mode(spec).conversation_counts(
        [Path(r.completions_path) for r in shard_results],
        [Path(r.rejects_path) for r in shard_results],
        plan.n_prompts,
        tokenized.outcomes,
    )
    lineage = manifest_lineage(
        spec,
        chat,
        settings,
        plan,
        tokenized,
        first_attempt=pin_facts(layout.pinned_facts, run_id),  # written by finish_dataset
        engine_version=", ".join(engine_versions) or None,
        hardware={
            "boxes": {"shards": dict(shards_by_box), "rows": dict(rows_by_box)},
            "memory_plan": {"by_box": box_plans},
        },
        conversations=turn_counts,
        published={
            "published": tokenized.conversations,
            "published_user_turns": tokenized.turns,
            # Conversations two owners generated differently (a lease taken over mid-conversation): one kept.
            "generated_twice": sum(len(c.conflicts) for c in collected),
        },
    )
    published = publish_dataset(spec, layout, store, lineage, dry_run)
    create_link_artifact(
        link=published.uri  # a dry run published nothing: no card to open
        if dry_run
        else dataset_link(store, published.uri, settings.s3_console_url, settings.s3_link_expiry_s),
        link_text=f"dataset {spec.namespace}: {tokenized.n_rows:,} rows",
        key="published-dataset",
        description=f"Where {spec.namespace} was published ({published.uri}); `datagen inspect {spec.namespace}`",
    )
    report = {
        "uri": published.uri,
        "rows": tokenized.n_rows,
        "rejects": tokenized.n_rejects,
        "prompts": plan.n_prompts,
        "shards": len(plan.shard_ids),
        "shards_by_box": dict(shards_by_box),
        "rows_by_box": dict(rows_by_box),
        "duplicates_dropped": sum(c.duplicates_dropped for c in collected),
        "output_tokens": sum(r.output_tokens for r in shard_results),
        "wall_s": round(time.monotonic() - started, 1),
        "dry_run": dry_run,
    } | ({"conversations": lineage["conversations"]} if "conversations" in lineage else {})
    create_markdown_artifact(
        markdown="# Run report\n\n" + "\n".join(f"- **{k}**: {v}" for k, v in report.items()),
        key="run-report",
        description=f"Run report of {spec.namespace} (several boxes)",
    )
    logger.info("published %s", published.uri)
    return report
