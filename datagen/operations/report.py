"""What a run tells the people watching it in Prefect: run names, the run report, live progress, text charts.

The flows make thin calls into this module; nothing here changes what a run generates or publishes.
Charts are markdown code blocks of text bars: Prefect's UI renders them in a markdown artifact as they are,
with no image hosting and no plotting dependency.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast
from urllib.parse import urlsplit
from uuid import UUID

from datagen.checkpoint import read_rows
from datagen.conversation.turn_stats import COMPLETE, StepTail, TurnCounts
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.stats import DispatcherStats
from datagen.publishing.dataset_card import CARD_NAME

__all__ = [
    "ProgressReporter",
    "RunFacts",
    "StageClock",
    "bar_chart",
    "completion_lengths",
    "human_bytes",
    "human_duration",
    "is_generated_name",
    "length_histogram",
    "nothing_to_do_report",
    "rename_flow_run",
    "run_name",
    "run_report",
]

log = logging.getLogger(__name__)

# Prefect names a run nobody named with two random words: coolname's "coral-anaconda" (API, schedules, CLI), or
# the run form's prefill, "Fantastic-Goose" (V1 UI, its own word lists) or "Gorgeous-Akita" (V2 UI: one of 17
# product adjectives and an animal of at most 6 letters, read in Prefect 3.9.1's bundle). Only those are ours to
# replace: any other name was typed by a person and is kept as it is.
_UI_V2_ADJECTIVES = frozenset(
    {
        "Awesome", "Rustic", "Small", "Gorgeous", "Fantastic", "Sleek", "Intelligent", "Unbranded", "Refined",
        "Licensed", "Generic", "Practical", "Ergonomic", "Handcrafted", "Tasty", "Handmade", "Incredible",
    }
)  # fmt: skip
_TWO_WORDS = re.compile(r"^([A-Za-z]+)-([A-Za-z ]+)$")
NAME_TAG_SEPARATOR = " · "  # "expand expansion_v2 · coral-anaconda": what it does, then the random words


def _coolname_words() -> frozenset[str]:
    import coolname.data

    config = cast("dict[str, dict[str, Any]]", coolname.data.config)
    return frozenset(word for entry in config.values() if entry.get("type") == "words" for word in entry["words"])


def is_generated_name(name: str) -> bool:
    """Whether Prefect (API, schedule or a UI form's prefill) made this run name up, rather than a person."""
    match = _TWO_WORDS.match(name)
    if not match:
        return False
    first, second = match.groups()
    if first in _UI_V2_ADJECTIVES and len(second) <= 6:
        return True
    words = _coolname_words()
    return first.lower() in words and second.lower() in words and (name.islower() or name.istitle())


# --- run names --------------------------------------------------------------------------------------------


def _param(parameters: Mapping[str, Any], *path: str) -> Any:
    node: Any = parameters
    for part in path:
        node = node.get(part) if isinstance(node, Mapping) else getattr(node, part, None)
        if node is None:
            return None
    return node


def describe_run(flow_name: str, parameters: Mapping[str, Any]) -> str:
    """A run name from the flow and its parameters: what it does to which namespace."""
    namespace = _param(parameters, "spec", "namespace") or "expansion_v1"
    dry = " (dry run)" if _param(parameters, "dry_run") else ""
    if flow_name == "pilot":
        pilot = _param(parameters, "pilot_spec", "name") or "pilot"
        return f"pilot {pilot} for {namespace}"
    if flow_name == "check-environment":
        return f"check environment for {namespace}"
    if flow_name == "generate-on-box":
        return f"{_param(parameters, 'box') or 'box'} share of {namespace}"
    if flow_name == "expand-dataset-multibox":
        return f"expand {namespace} on several boxes{dry}"
    return f"expand {namespace}{dry}"


def run_name(flow_name: str) -> Callable[[], str]:
    """A `flow_run_name` callable: what the run does plus its random words, unless a person named it.

    "expand expansion_v2 · coral-anaconda": runs of the same namespace stay apart in the run list, and the words
    are the ones the UI showed when the run was started. A typed name is never replaced.
    """

    def name() -> str:
        from prefect.context import FlowRunContext
        from prefect.runtime import flow_run

        ctx = FlowRunContext.get()
        current = ctx.flow_run.name if ctx and ctx.flow_run else ""
        if current and not is_generated_name(current):
            return current
        described = describe_run(flow_name, flow_run.parameters)
        return f"{described}{NAME_TAG_SEPARATOR}{current.lower()}" if current else described

    return name


def rename_flow_run(old_part: str, new_part: str) -> None:
    """Replace `old_part` in the current run's name (e.g. 'auto' once the namespace is known); best effort.

    Only in a name `run_name` made (what it does, then the random words): a typed name is never touched.
    """
    from prefect.client.orchestration import get_client
    from prefect.context import FlowRunContext

    ctx = FlowRunContext.get()
    if not ctx or not ctx.flow_run:
        return
    described, sep, words = ctx.flow_run.name.rpartition(NAME_TAG_SEPARATOR)
    if not sep or not is_generated_name(words) or old_part not in described:
        return
    new_name = described.replace(old_part, new_part, 1) + sep + words
    try:
        with get_client(sync_client=True) as client:
            client.set_flow_run_name(ctx.flow_run.id, new_name)
        ctx.flow_run.name = new_name
    except Exception as exc:  # a name is cosmetic: never fail a run over it
        log.warning("could not rename the flow run to %r: %s", new_name, exc)


# --- formatting -------------------------------------------------------------------------------------------


class QuietPerShardCompletions(logging.Filter):
    """Drops Prefect's "Finished in state Completed()" line for per-shard task runs (names with " shard-").

    A 1,000-shard run has two such task runs per shard (generate, validate+tokenize): 2,000 identical lines
    in the flow run's log would bury the progress lines (rates, ETA, rejects so far) and any warning. Only that
    line goes: a per-shard retry, failure or crash is logged as before, and every task run keeps its state in the UI.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno != logging.INFO or " shard-" not in str(getattr(record, "task_run_name", "")):
            return True
        return not str(record.msg).startswith("Finished in state Completed")


def quiet_per_shard_completions() -> None:
    """Install `QuietPerShardCompletions` on Prefect's task-run logger once per process."""
    task_runs = logging.getLogger("prefect.task_runs")
    if not any(isinstance(f, QuietPerShardCompletions) for f in task_runs.filters):
        task_runs.addFilter(QuietPerShardCompletions())


def human_bytes(n: float) -> str:
    """1536 -> '1.5 KiB'."""
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def human_duration(seconds: float) -> str:
    """75 -> '1 min 15 s'."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(round(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def _table(headers: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        return str(v).replace("|", "\\|").replace("\n", " ")

    lines = ["| " + " | ".join(headers) + " |", "|" + "---|" * len(headers)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def bar_chart(rows: Sequence[tuple[str, float]], width: int = 40, unit: str = "") -> str:
    """Horizontal text bars, one row per (label, value), scaled to the largest value."""
    if not rows:
        return "(no data)"
    top = max(v for _, v in rows) or 1.0
    label_w = max(len(label) for label, _ in rows)
    out = []
    for label, value in rows:
        n = round(width * value / top)
        bar = "█" * n if n or value <= 0 else "▏"
        out.append(f"{label.rjust(label_w)} │{bar} {value:,.0f}{unit}")
    return "\n".join(out)


# --- stage timings ----------------------------------------------------------------------------------------


@dataclass
class StageClock:
    """Wall time per stage: `mark(name)` closes the stage that ran since the previous mark."""

    started: float = field(default_factory=time.monotonic)
    stages: dict[str, float] = field(default_factory=dict)
    _last: float = field(default=0.0)

    def __post_init__(self) -> None:
        self._last = self.started

    def mark(self, name: str) -> None:
        """Record the time since the last mark under `name` (added to it when the stage comes back)."""
        now = time.monotonic()
        self.stages[name] = self.stages.get(name, 0.0) + now - self._last
        self._last = now

    @property
    def elapsed_s(self) -> float:
        """Seconds since the clock started."""
        return time.monotonic() - self.started


# --- live progress ----------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ProgressSample:
    """One look at the dispatcher: when, prompts settled so far (run total), output tokens so far (this call)."""

    t_s: float
    settled: int
    output_tokens: int


EARLY_SAMPLES = 12  # the progress reporter's first looks, one a second


class ProgressReporter:
    """A background thread that reads the dispatcher's counters every `interval_s` while generation runs.

    It updates the progress artifact (percent of the run's prompts settled, with prompts, tokens/s and ETA in
    its description) every look, logs a progress line at most every `log_every_s` and only when the counts
    changed (never the same line twice), and keeps
    samples for the throughput chart of the run report. The ETA is from this run's whole prompt count, not
    from what the shards started so far have announced (which made "ETA 0.0 min" appear halfway).
    """

    def __init__(
        self,
        dispatcher: Dispatcher,
        total_prompts: int,
        already_settled: int,
        progress_artifact_id: UUID | None,
        logger: logging.Logger | logging.LoggerAdapter[logging.Logger],
        interval_s: float = 5.0,
        label: str = "",
        log_every_s: float = 60.0,
        turns: StepTail | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.total = total_prompts
        self.already = already_settled
        self.artifact_id = progress_artifact_id
        self.logger = logger
        self.interval_s = interval_s
        self.label = label  # prefix of the artifact's description, e.g. "Generation of expansion_v3: "
        self.log_every_s = log_every_s
        # Every-turn mode: the dispatcher counts steps, so conversations are counted from the checkpoint lines.
        self.turns = turns
        self.last_turns: TurnCounts | None = turns.poll() if turns is not None else None
        # Conversations the checkpoints finished before this call: the ETA's rate is this call's own.
        self._finished_before = self.last_turns.finished if self.last_turns is not None else 0
        self._last_log = float("-inf")
        self.samples: list[ProgressSample] = []
        self.last_stats: DispatcherStats | None = None
        self._last_key: tuple[int, ...] = ()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="datagen-progress", daemon=True)

    def __enter__(self) -> ProgressReporter:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=60)
        try:
            self.tick()  # the final counts, once
        except Exception as exc:  # never hide the exception that ended generation
            self.logger.warning("final progress update failed: %s", exc)

    def _loop(self) -> None:
        # Every second at first, so a short run still gets a throughput chart with a few bars.
        while not self._stop.wait(1.0 if len(self.samples) < EARLY_SAMPLES else self.interval_s):
            try:
                self.tick()
            except Exception as exc:  # progress is for people: a failed look must not stop generation
                self.logger.warning("progress update failed: %s", exc)

    def settled(self, stats: DispatcherStats) -> int:
        """Prompts of the run with a result (completion or reject), this call's and the checkpoints' before it.

        Every-turn mode: conversations finished (their checkpoint lines say so, those of earlier attempts too).
        """
        if self.last_turns is not None:
            return min(self.total, self.last_turns.finished)
        return min(self.total, self.already + stats.completed + stats.rejected)

    def eta_s(self, stats: DispatcherStats) -> float | None:
        """Seconds left at this call's average rate over the run's remaining prompts; None before any result."""
        done_now = stats.completed + stats.rejected
        if self.last_turns is not None:
            done_now = self.last_turns.finished - self._finished_before
        if done_now <= 0 or stats.elapsed_s <= 0:
            return None
        left = self.total - self.settled(stats)
        return left / (done_now / stats.elapsed_s)

    def describe(self, stats: DispatcherStats) -> str:
        """'120 of 294 prompts (41%), 1,234 output tokens/s, ETA 3 min 5 s, 0 failed'."""
        settled = self.settled(stats)
        pct = 100.0 * settled / self.total if self.total else 100.0
        eta = self.eta_s(stats)
        if settled >= self.total:
            eta_text = "all settled"
        elif eta is None:
            eta_text = "ETA unknown until the first result"
        else:
            eta_text = f"ETA {human_duration(eta)}"
        if self.last_turns is not None:
            turns = self.last_turns
            ended = f", {turns.ended_early:,} ended early" if turns.ended_early else ""
            return (
                f"{settled:,} of {self.total:,} conversations finished ({pct:.0f}%){ended}, {turns.steps:,} steps "
                f"({turns.user_turns:,} user turns) generated, {stats.output_tokens_per_s:,.0f} output tokens/s, "
                f"{eta_text}, {stats.failed} failed, {stats.in_flight} in flight"
            )
        return (
            f"{settled:,} of {self.total:,} prompts ({pct:.0f}%), {stats.output_tokens_per_s:,.0f} output tokens/s, "
            f"{eta_text}, {stats.failed} failed, {stats.in_flight} in flight"
        )

    def tick(self) -> None:
        """Look once: sample, update the artifact, log when changed."""
        stats = self.dispatcher.stats()
        self.last_stats = stats
        if self.turns is not None:
            self.last_turns = self.turns.poll()
        settled = self.settled(stats)
        self.samples.append(ProgressSample(stats.elapsed_s, settled, stats.output_tokens))
        text = self.describe(stats)
        if self.artifact_id is not None:
            from prefect.artifacts import update_progress_artifact

            progress = 100.0 * settled / self.total if self.total else 100.0
            update_progress_artifact(artifact_id=self.artifact_id, progress=progress, description=self.label + text)
        # Same counts as the last line: nothing to say (the end of a run used to repeat its last line).
        steps = self.last_turns.steps if self.last_turns is not None else 0
        key = (settled, stats.failed, stats.in_flight, stats.queued, steps)
        due = time.monotonic() - self._last_log >= self.log_every_s or settled >= self.total
        if key != self._last_key and due:
            self._last_key = key
            self._last_log = time.monotonic()
            self.logger.info("generation: %s", text)

    def throughput_series(self, buckets: int = 12) -> list[tuple[str, float]]:
        """Output tokens/s per time bucket across the generation, for a chart."""
        points = [s for s in self.samples if s.t_s > 0]
        if not points:
            return []
        if len(points) == 1:  # over before the second look: one bar, the whole generation's rate
            return [(human_duration(points[0].t_s), points[0].output_tokens / points[0].t_s)]
        end = points[-1].t_s
        width = end / buckets
        series: list[tuple[str, float]] = []
        prev = ProgressSample(0.0, 0, 0)
        edge = width
        for sample in points:
            if sample.t_s + 1e-9 >= edge or sample is points[-1]:
                dt = sample.t_s - prev.t_s
                rate = (sample.output_tokens - prev.output_tokens) / dt if dt > 0 else 0.0
                series.append((human_duration(sample.t_s), rate))
                prev = sample
                while edge <= sample.t_s:
                    edge += width
        return series


# --- lengths ----------------------------------------------------------------------------------------------


def completion_lengths(paths: Iterable[Path]) -> list[int]:
    """completion_tokens of every completion in the shards' checkpoint files."""
    return [int(row["completion_tokens"]) for path in paths for row in read_rows(path)]


def length_histogram(lengths: Sequence[int], bins: int = 10) -> list[tuple[str, float]]:
    """Counts of lengths in `bins` equal-width ranges, labelled 'lo-hi'."""
    if not lengths:
        return []
    lo, hi = min(lengths), max(lengths)
    width = max(1, -(-(hi - lo + 1) // bins))
    counts = [0] * bins
    for n in lengths:
        counts[min(bins - 1, (n - lo) // width)] += 1
    rows = [(f"{lo + i * width}-{lo + (i + 1) * width - 1}", float(c)) for i, c in enumerate(counts)]
    while rows and rows[-1][1] == 0:
        rows.pop()
    return rows


# --- the dataset link -------------------------------------------------------------------------------------


def dataset_link(store: Any, uri: str, console_url: str | None = None, expiry_s: int = 24 * 3600) -> str:
    """A link a browser can open for a published namespace.

    A console URL where one is known: `console_url` is a template with `{bucket}` and `{key}` (e.g. a MinIO or
    SeaweedFS console); AWS S3 (no endpoint, or an amazonaws.com one) gets the AWS console's folder view. An S3
    server on this machine's loopback (a laptop: the browser runs beside it) gets a presigned GET of the dataset
    card, valid `expiry_s`; any other endpoint the s3:// URI.
    """
    prefix = uri.split(f"s3://{store.bucket}/", 1)[-1]
    if console_url:
        return console_url.format(bucket=store.bucket, key=prefix)
    endpoint = store.endpoint_url or ""
    if not endpoint or endpoint.rstrip("/").endswith("amazonaws.com"):
        return f"https://s3.console.aws.amazon.com/s3/buckets/{store.bucket}?prefix={prefix}&region={store.region}"
    if _on_loopback(endpoint):
        return str(store.presigned_get(uri.removeprefix(store.uri()) + CARD_NAME, expiry_s))
    return uri


def _on_loopback(url: str) -> bool:
    host = urlsplit(url).hostname or ""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


# --- the reports ------------------------------------------------------------------------------------------


@dataclass
class RunFacts:
    """Everything the run report shows; filled by the flow from its stage results."""

    namespace: str
    uri: str | None
    dry_run: bool
    prompts: int
    shards: int
    rows: int
    rejects: int
    rejects_by_reason: Mapping[str, int]
    output_tokens: int
    dataset_bytes: int
    servers: int
    generation_s: float
    stages: Mapping[str, float]
    wall_s: float
    shards_reused: int = 0
    generated_tokens: int = 0  # output tokens generated by this call (not the checkpoints' from before)
    server_s: float = 0.0  # how long the servers held their GPUs: start + generation
    final_stats: DispatcherStats | None = None
    throughput: Sequence[tuple[str, float]] = ()
    lengths: Sequence[int] = ()
    # Every-turn mode: conversations and their steps, counted from the checkpoint lines (None: `last` mode).
    conversations: TurnCounts | None = None
    link: str | None = None  # dataset_link's browser link, where it is not the s3:// location itself
    skipped_published: int = 0  # prompts of the sources other namespaces published: skipped
    old_rejects_skipped: int = 0  # rows other namespaces published as load rejects: skipped, not published again
    duplicate_rows: int = 0  # training rows identical to an earlier one (kept: docs/data-quality.md)

    def summary(self) -> dict[str, Any]:
        """The flow's return value (and the CLI's summary): plain JSON."""
        return {
            "uri": self.uri,
            "namespace": self.namespace,
            "rows": self.rows,
            "rejects": self.rejects,
            "rejects_by_reason": dict(self.rejects_by_reason),
            "prompts": self.prompts,
            "shards": self.shards,
            "output_tokens": self.output_tokens,
            "output_tokens_per_s": round(self.generated_tokens / self.generation_s, 1)
            if self.generation_s and self.generated_tokens
            else None,
            "gpu_hours": round(self.servers * self.server_s / 3600, 4),
            "dataset_bytes": self.dataset_bytes,
            "wall_s": round(self.wall_s, 1),
            "dry_run": self.dry_run,
            "skipped_published": self.skipped_published,
            "old_rejects_skipped": self.old_rejects_skipped,
            "duplicate_rows": self.duplicate_rows,
        } | ({"conversations": self.conversations.summary()} if self.conversations is not None else {})


def run_report(facts: RunFacts) -> str:
    """The run report: what was made, how fast, where the time went, and charts."""
    s = facts.summary()
    where = facts.uri or "(nothing published)"
    if facts.dry_run:
        where += " (dry run: nothing written)"
    rate = f"{s['output_tokens_per_s']:,.0f}" if s["output_tokens_per_s"] is not None else "—"
    reject_rate = 100.0 * facts.rejects / (facts.rows + facts.rejects) if facts.rows + facts.rejects else 0.0
    parts = [
        f"# Run report: {facts.namespace}",
        "",
        f"Dataset: `{where}` · {facts.rows:,} rows · {human_bytes(facts.dataset_bytes)} · "
        + (f"[open it in the browser]({facts.link}) · " if facts.link and facts.link != facts.uri else "")
        + f"`datagen inspect {facts.namespace}` shows what it holds.",
        "",
        _table(
            ["what", "value"],
            [
                *_conversation_rows(facts),
                ("prompts planned", f"{facts.prompts:,} in {facts.shards} shards"),
                ("shards reused from checkpoints / cache", facts.shards_reused),
                ("training rows", f"{facts.rows:,}"),
                ("rows identical to an earlier row (kept)", f"{facts.duplicate_rows:,}"),
                ("rejects", f"{facts.rejects:,} ({reject_rate:.1f}%)"),
                ("prompts skipped as published before", f"{facts.skipped_published:,}"),
                ("old rejects skipped (published before, not again)", f"{facts.old_rejects_skipped:,}"),
                ("output tokens (all rows)", f"{facts.output_tokens:,}"),
                ("output tokens generated by this run", f"{facts.generated_tokens:,}"),
                ("output tokens/s (this run's generation stage)", rate),
                ("servers (one per GPU)", facts.servers),
                ("GPU-hours (servers × their start + generation time)", f"{s['gpu_hours']:.3f}"),
                ("dataset size", human_bytes(facts.dataset_bytes)),
                ("wall time", human_duration(facts.wall_s)),
            ],
        ),
    ]
    if facts.conversations is not None and facts.conversations.outcomes:
        finished = facts.conversations.finished
        parts += [
            "",
            "## Conversations by outcome",
            "",
            _table(
                ["outcome", "conversations", "share"],
                [(k, f"{n:,}", f"{100.0 * n / finished:.1f}%") for k, n in facts.conversations.outcomes.items()],
            ),
        ]
    if facts.rejects_by_reason:
        parts += [
            "",
            "## Rejects by reason",
            "",
            _table(["stage/reason", "rows"], sorted(facts.rejects_by_reason.items(), key=lambda kv: (-kv[1], kv[0]))),
        ]
    if facts.final_stats is not None and facts.final_stats.servers:
        parts += [
            "",
            "## Per server",
            "",
            _table(
                [
                    "server",
                    "state",
                    "requests done",
                    "output tokens",
                    "output tokens/s (generation average)",
                    "output tokens/s (last minute)",
                    "last error",
                ],
                [
                    (
                        sv.name,
                        sv.state,
                        f"{sv.completed:,}",
                        f"{sv.output_tokens:,}",
                        f"{sv.output_tokens / facts.generation_s:,.0f}" if facts.generation_s else "—",
                        f"{sv.tokens_per_s:,.0f}",
                        sv.last_error or "—",
                    )
                    for sv in facts.final_stats.servers
                ],
            ),
            "",
            f"Dispatcher: {facts.final_stats.retries} retries, {facts.final_stats.requeued} requeued, "
            f"{facts.final_stats.failed} failed requests.",
        ]
    if facts.stages:
        parts += [
            "",
            "## Time per stage",
            "",
            _table(
                ["stage", "wall time", "share"],
                [
                    (name, human_duration(sec), f"{100.0 * sec / facts.wall_s:.0f}%" if facts.wall_s else "—")
                    for name, sec in facts.stages.items()
                ],
            ),
        ]
    if facts.throughput:
        parts += ["", "## Output tokens/s over the generation", "", "```", bar_chart(facts.throughput), "```"]
    if facts.lengths:
        ordered = sorted(facts.lengths)
        median = ordered[len(ordered) // 2]
        what = "Step" if facts.conversations is not None else "Completion"
        parts += [
            "",
            f"## {what} lengths (tokens; median {median:,}, max {ordered[-1]:,})",
            "",
            "```",
            bar_chart(length_histogram(facts.lengths), unit=f" {what.lower()}s"),
            "```",
        ]
    return "\n".join(parts) + "\n"


def _conversation_rows(facts: RunFacts) -> list[tuple[str, str]]:
    """The run report's first rows in every-turn mode: conversations and the steps that answered them."""
    turns = facts.conversations
    if turns is None:
        return []
    early = turns.ended_early
    return [
        ("conversations planned", f"{turns.planned:,}"),
        (
            "conversations finished",
            f"{turns.finished:,} ({turns.outcomes.get(COMPLETE, 0):,} complete, {early:,} ended early)",
        ),
        ("steps generated (one generation each)", f"{turns.steps:,}"),
        ("user turns answered (their first step)", f"{turns.user_turns:,}"),
    ]


def nothing_to_do_report(
    namespace: str,
    sources: Sequence[str],
    n_skipped_ids: int,
    published_namespaces: Sequence[str],
    n_load_rejects: int,
    skip_published: bool,
    selection: Mapping[str, Any] | None = None,
    n_rows_in_sources: int | None = None,
    n_old_rejects: int = 0,
) -> tuple[str, str]:
    """(markdown, one-line state message) for a run that planned no prompts and so publishes nothing."""
    why: list[str] = []
    if n_rows_in_sources == 0:
        # Said first: with earlier runs in the catalog, "every prompt is already published" would hide it.
        why.append("the sources are empty: 0 rows read from " + ", ".join(f"`{s}`" for s in sources) + ".")
    elif skip_published and n_skipped_ids:
        shown = ", ".join(f"`{n}`" for n in published_namespaces[:8])
        more = f" and {len(published_namespaces) - 8} more" if len(published_namespaces) > 8 else ""
        why.append(
            f"`skip_published` is on and {n_skipped_ids:,} prompt ids are already published in "
            f"earlier namespaces ({shown}{more}): every prompt the sources hold is one of them."
        )
    if n_old_rejects:
        why.append(
            f"{n_old_rejects:,} old rejects skipped: source rows an earlier namespace already published as load "
            "rejects (not counted or published again)."
        )
    if n_load_rejects:
        why.append(f"{n_load_rejects:,} source rows were rejected while loading (malformed or empty).")
    if selection and selection.get("over_target_by_source"):
        why.append(f"source/category targets left prompts for later: {selection['over_target_by_source']}.")
    if not why:
        why.append("the sources hold no prompts.")
    message = f"Nothing new to generate for {namespace}: 0 prompts planned, nothing published. " + why[0].replace(
        "`", ""
    )
    if n_old_rejects:
        message += f" {n_old_rejects:,} old rejects skipped (published before, not again)."
    markdown = "\n".join(
        [
            f"# Run report: {namespace}: nothing to do",
            "",
            "**0 prompts planned: no servers were started and nothing was published.** "
            "For a scheduled expansion with no new prompts this is the expected outcome.",
            "",
            "Why:",
            "",
            *[f"- {w}" for w in why],
            "",
            _table(
                ["what", "value"],
                [
                    ("sources", ", ".join(f"`{s}`" for s in sources)),
                    ("rows in the sources", "—" if n_rows_in_sources is None else f"{n_rows_in_sources:,}"),
                    ("prompts skipped as already published (catalog)", f"{n_skipped_ids:,}"),
                    ("old rejects skipped (published before)", f"{n_old_rejects:,}"),
                    ("namespaces that published them", len(published_namespaces)),
                    ("rows rejected while loading", n_load_rejects),
                ],
            ),
            "",
            "To generate anyway: add new prompts to the sources, or run with `skip_published: false` "
            "(the same prompts again, into a new namespace).",
        ]
    )
    return markdown + "\n", message
