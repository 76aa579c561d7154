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
from dataclasses import asdict, dataclass
from typing import Any, cast
from uuid import UUID

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_progress_artifact, update_progress_artifact
from prefect.cache_policies import NO_CACHE
from prefect.client.orchestration import get_client
from prefect.client.schemas.objects import FlowRun
from prefect.context import FlowRunContext
from prefect.deployments import run_deployment
from prefect.futures import PrefectFuture, wait
from prefect.states import Crashed
from prefect.task_runners import TaskRunner, ThreadPoolTaskRunner

from datagen.chat import ChatTokenizer
from datagen.checks import CheckResult
from datagen.conversation.turn_mode import turn_mode
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.memory_plan import MemoryPlan, PromptTokens
from datagen.layout import RunLayout
from datagen.operations import alerts, failure
from datagen.operations.report import quiet_per_shard_completions, run_name
from datagen.publishing.storage import ObjectStore
from datagen.runspec import ExchangeSpec, MultiBoxSpec, RunSpec
from datagen.settings import Settings
from flows import skeleton
from flows.skeleton import Generated, Planned, Run
from tasks import generation, pilot
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


@dataclass(frozen=True)
class BoxWork:
    """What every shard this box generates needs beside its lease (one object: the task's parameters stay few)."""

    exchange: ShardExchange
    plan: ShardPlan
    spec: RunSpec
    layout: RunLayout
    dispatcher: Dispatcher
    chat: ChatTokenizer
    sync_interval_s: float
    engine_version: str | None
    memory_plan: dict[str, Any] | None
    pilot_layout: RunLayout | None  # the run's pilot, where it ran on this box: its completions are reused


def _generate_claimed_shard(lease: Lease, work: BoxWork) -> generation.ShardResult:
    shard_id, exchange, layout = lease.shard_id, work.exchange, work.layout
    exchange.fetch_prompts(work.plan, shard_id, layout)
    # Rows other boxes (or this box before a crash) finished are in S3: the ledger skips them.
    known = exchange.restore_checkpoint(shard_id, layout)
    if work.pilot_layout is not None:  # as a one-box run reuses its pilot's completions; uploaded as new rows
        one = work.plan.model_copy(update={"shard_ids": [shard_id]})
        pilot.import_pilot(work.pilot_layout, layout, one, work.spec, work.chat)
    with CheckpointSync(exchange, lease, layout, known, work.sync_interval_s) as sync:
        result = generation.generate_shard(
            shard_id, layout, work.dispatcher, work.chat, work.spec, flush_interval_s=min(2.0, work.sync_interval_s / 2)
        )
    sync.sync_once()  # the rest, now that the shard is complete; raises if S3 refuses
    exchange.mark_done(result, work.engine_version, work.memory_plan)
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
    shard's files as it claims it), for this box's memory plan on its own GPUs, planned as a one-box run plans
    it: where the run's pilot ran on this box, from what it measured (output, steps, the plan its trial kept).
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
    # This box reads the plan from S3, not the sources; the parent holds the namespace's lease.
    with skeleton.open_run(spec, sources=False) as run:
        settings = run.settings
        this_box = settings.box_name or socket.gethostname()
        if box and box != this_box:
            raise BoxMismatch(f"this run is for box {box!r} but reached box {this_box!r} (DATAGEN_BOX_NAME)")
        sx = _exchange(run.store, spec, this_box, exchange.lease_s)
        plan = sx.fetch_plan()
        if sx.done_ids() >= set(plan.shard_ids):
            logger.info("every shard is already done; nothing to start on %s", this_box)
            return {"box": this_box, "shards": [], "output_tokens": 0}
        skeleton.check_environment_task(settings, spec, run.store)
        pilot_layout, projection = _pilot_here(settings, spec)
        memory_plan, memory_why = skeleton.box_memory_plan(
            settings, spec, PromptTokens(**prompt_tokens) if prompt_tokens else None, turns_per_conversation, projection
        )
        with serving(
            settings, spec, run.layout, plan_args=memory_plan.plan_args if memory_plan else [], memory_plan=memory_plan
        ) as served:
            logger.info("box %s: %d servers up, owner token %s", this_box, len(served.fleet), sx.owner)
            work = BoxWork(
                sx,
                plan,
                spec,
                run.layout,
                served.dispatcher,
                run.chat,
                exchange.sync_interval_s,
                served.fleet.engine_version,
                _box_plan(memory_plan, memory_why),
                pilot_layout,
            )
            finished = _claim_until_done(work, exchange, this_box)
    report = {
        "box": this_box,
        "shards": sorted(r.shard_id for r in finished),
        "output_tokens": sum(r.output_tokens for r in finished),
    }
    logger.info("box %s done: %s", this_box, report)
    return report


def _pilot_here(settings: Settings, spec: RunSpec) -> tuple[RunLayout | None, pilot.Projection | None]:
    """The run's pilot where it ran on this box (its layout and projection), else (None, None)."""
    if not spec.pilot:
        return None, None
    try:
        projection = pilot.load_projection(settings.work_dir, spec.pilot)
    except FileNotFoundError:
        get_run_logger().info("pilot %s did not run on this box: planned from the run's prompts alone", spec.pilot)
        return None, None
    return RunLayout.for_run(settings.work_dir, spec.pilot), projection


def _claim_until_done(work: BoxWork, exchange: ExchangeSpec, this_box: str) -> list[generation.ShardResult]:
    """Keep `shards_in_flight` claimed shards generating until every shard of the run is done (by any box)."""
    logger = get_run_logger()
    sx, shard_ids = work.exchange, work.plan.shard_ids
    finished: list[generation.ShardResult] = []
    failures: Counter[int] = Counter()
    inflight: dict[PrefectFuture[generation.ShardResult], int] = {}
    while True:
        while len(inflight) < exchange.shards_in_flight:
            lease = sx.claim_next(shard_ids, exclude=set(inflight.values()))
            if lease is None:
                break
            logger.info("box %s claimed shard %d (claim %d)", this_box, lease.shard_id, lease.seq)
            inflight[generate_claimed_task.submit(lease, work)] = lease.shard_id
        if not inflight:
            if sx.done_ids() >= set(shard_ids):
                return finished
            # Every open shard is leased by a live box: wait, and take over any lease that lapses.
            time.sleep(min(exchange.sync_interval_s, exchange.lease_s / 4))
            continue
        done, _ = wait(list(inflight), timeout=exchange.sync_interval_s)
        for future in done:
            shard_id = inflight.pop(future)
            if future.state.is_completed():
                finished.append(future.result())
                continue
            failures[shard_id] += 1
            logger.warning("shard %d failed on %s (%d times): %s", shard_id, this_box, failures[shard_id], future.state)
            if failures[shard_id] >= MAX_SHARD_FAILURES_PER_BOX:
                future.result()  # raises the shard's error; its lease lapses and another box takes it


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


@dataclass(frozen=True)
class Boxes:
    """The boxes generate: each its own fleet and memory plan, claiming shards through S3 (tasks/shard_exchange.py);
    this process plans, uploads the plan, starts one `generate-on-box` per box and collects their rows."""

    boxes: MultiBoxSpec

    def check(self, run: Run) -> list[CheckResult]:
        results = skeleton.s3_preflight_task(run.store, run.spec.namespace, resume=True)
        failed = [r for r in results if r.failed]
        if failed:
            raise ShardExchangeError("S3 checks failed:\n" + "\n".join(f"- {r.name}: {r.detail}" for r in failed))
        return list(results)

    def generate(self, run: Run, planned: Planned) -> Generated:
        spec, layout, plan = run.spec, run.layout, planned.plan
        exchange = _exchange(run.store, spec, "parent", self.boxes.exchange.lease_s)
        publish_plan_task(exchange, plan, layout)
        get_run_logger().info("%d shards for boxes %s", len(plan.shard_ids), self.boxes.boxes)
        children = _launch_boxes(spec, self.boxes, planned.prompt_tokens, planned.recorded_turns)
        _wait_for_shards(exchange, plan, children, self.boxes)
        collected = collect_task(exchange, plan, layout, spec, run.chat)
        rows_by_box: Counter[str] = Counter()
        for c in collected:
            rows_by_box.update(c.rows_by_box)
        markers = [exchange.done_marker(s) for s in plan.shard_ids]
        shards_by_box = dict(Counter(str(m["box"]) for m in markers))
        box_plans = plans_by_box(markers)
        return Generated(
            [c.result for c in collected],
            {"boxes": {"shards": shards_by_box, "rows": dict(rows_by_box)}, "memory_plan": {"by_box": box_plans}},
            engine_version=", ".join(sorted({str(m["engine_version"]) for m in markers if m.get("engine_version")}))
            or None,
            plan_args_by_box={box: list(p.get("plan_args", [])) for box, p in box_plans.items()},
            # Conversations two owners generated differently (a lease taken over mid-conversation): one kept.
            published_extra={"generated_twice": sum(len(c.conflicts) for c in collected)},
            report_extra={
                "shards_by_box": shards_by_box,
                "rows_by_box": dict(rows_by_box),
                "duplicates_dropped": sum(c.duplicates_dropped for c in collected),
            },
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
    """Spread a run's shards over several GPU boxes, then validate, tokenize and publish (never overwriting).

    The same run as `expand-dataset` on more GPUs: every run-spec field means what it means there (namespace
    `auto`, skip of published prompts and old rejects, targets, order, both turn modes, gates) and a spec publishes
    the same rows; each box plans its own servers from its own GPUs and settings. A `pilot` is read where it ran:
    its plan and projection on this (the parent's) host, its completions on the box that holds them
    (docs/multi-box.md, "What a multi-box run honours").

    Args:
        spec: What this run does: prompt sources, model, sampling, sharding and the output namespace.
        boxes: The boxes' work queues (one `generate-on-box` run each) and how shards are exchanged through S3.
        dry_run: Generate on the boxes, validate and tokenize, publish nothing into the namespace (the boxes still
            exchange shards under `_runs/<namespace>/`, their only channel).
    """
    return failure.reported(skeleton.run_dataset, spec, dry_run, Boxes(boxes))
