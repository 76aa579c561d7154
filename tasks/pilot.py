"""Pilot stage bodies: sample the prompt set, measure throughput while generating, project the full run, reuse.

    plan_pilot(...)          seeded sample stratified by source, planned into the pilot's own shards
    ThroughputProbe(...)     samples the dispatcher's counters while the pilot generates
    project(...)             output tokens, wall time, GPU-hours, reject rate and size for the full set
    import_pilot(...)        copies the pilot's settled requests into a main run's shard checkpoints

The pilot's requests carry the same request keys as the main run's (same prompt ids, sampling, model and
template), so importing them makes the main run's generation ledger skip them: nothing is generated twice.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import Counter, defaultdict
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from datagen.chat import ChatTokenizer
from datagen.engine.dispatcher import Dispatcher
from datagen.layout import RunLayout
from datagen.prompts import iter_prompts
from datagen.quality import ValidationSummary
from datagen.records import Prompt
from datagen.runspec import RunSpec
from tasks.generation import request_key
from tasks.ordering import LengthModel, LengthSample
from tasks.planning import ShardPlan, plan_shards
from tasks.selection import SelectionReport, choose, filtered, stratified_sample

__all__ = [
    "PILOT_JSON",
    "PILOT_MARKDOWN",
    "ImportReport",
    "PilotPopulation",
    "PilotSpec",
    "Projection",
    "ThroughputProbe",
    "ThroughputSample",
    "import_pilot",
    "load_projection",
    "plan_pilot",
    "project",
    "render_projection",
    "write_projection",
]

log = logging.getLogger(__name__)

PILOT_JSON = "pilot.json"
PILOT_MARKDOWN = "pilot.md"
BYTES_PER_TOKEN = 5  # int32 token id + int8 loss-mask value, uncompressed
_PERCENTILES = (50, 90, 99)


class PilotSpec(BaseModel):
    """What the pilot samples and what it projects for."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(
        "pilot",
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$",
        description="Run name on this box (its files live under work_dir/runs/<name>); main runs refer to it.",
    )
    sample_size: int = Field(2000, ge=1, description="Prompts to sample (split across sources by their size).")
    min_per_source: int = Field(20, ge=1, description="At least this many prompts from every source.")
    seed: int = Field(0, description="Seed of the sample.")
    project_servers: int | None = Field(
        None, ge=1, description="Servers to project the full run for; default: DATAGEN_NUM_SERVERS."
    )
    shards: int = Field(8, ge=1, description="Shards the sample is cut into (>= shards in flight keeps servers full).")


class PilotPopulation(BaseModel):
    """The full set the pilot stands for and the sample drawn from it."""

    population_by_source: dict[str, int]
    sample_by_source: dict[str, int]
    selection: SelectionReport


def plan_pilot(
    spec: RunSpec, pilot: PilotSpec, layout: RunLayout, skip: Collection[str], base_dir: Path | None = None
) -> tuple[ShardPlan, PilotPopulation]:
    """Draw the pilot's sample from what the main run would take (same skips and targets) and plan it."""
    selection, report = choose(
        iter_prompts(spec.sources, base_dir), skip, spec.source_targets, spec.category_targets, spec.selection_seed
    )
    sample, population, allocated = stratified_sample(
        iter_prompts(spec.sources, base_dir), selection.keeps, pilot.sample_size, pilot.seed, pilot.min_per_source
    )
    n = len(sample)
    pilot_spec = spec.model_copy(update={"shard_size": max(1, math.ceil(n / pilot.shards))})
    plan = plan_shards(pilot_spec, layout, base_dir, select=filtered(lambda p: p.prompt_id in sample))
    return plan, PilotPopulation(population_by_source=population, sample_by_source=allocated, selection=report)


@dataclass(frozen=True, slots=True)
class ThroughputSample:
    """One reading of the dispatcher's counters."""

    t: float
    output_tokens: int
    completed: int
    queued: int


class ThroughputProbe:
    """Reads dispatcher.stats() every `interval_s` in a thread while generation runs."""

    def __init__(self, dispatcher: Dispatcher, interval_s: float = 0.5) -> None:
        self._dispatcher = dispatcher
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pilot-throughput", daemon=True)
        self.samples: list[ThroughputSample] = []
        self.servers = 0
        self.slots = 0
        self.started = 0.0
        self.ended = 0.0

    def _read(self) -> None:
        s = self._dispatcher.stats()
        self.samples.append(ThroughputSample(time.monotonic(), s.output_tokens, s.completed + s.rejected, s.queued))
        up = [srv for srv in s.servers if srv.state == "up"]
        self.servers = max(self.servers, len(up))
        self.slots = max(self.slots, sum(srv.capacity for srv in up))

    def _run(self) -> None:
        while not self._stop.wait(self._interval_s):
            self._read()

    def __enter__(self) -> ThroughputProbe:
        self.started = time.monotonic()
        self._read()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._read()
        self.ended = time.monotonic()

    def measure(self) -> dict[str, Any]:
        """Aggregate tokens/s while every slot was busy (queue non-empty, after one turnover of the slots).

        Counting tokens as requests complete under-counts at the start (nothing has finished yet) and over-counts
        in the drain; the window between skips both. Too short a window falls back to the whole run.
        """
        wall = max(self.ended - self.started, 1e-9)
        total = self.samples[-1].output_tokens - self.samples[0].output_tokens if self.samples else 0
        full = [s for s in self.samples if s.queued > 0 and s.completed >= self.slots]
        method = "saturated"
        if len(full) >= 4 and full[-1].t - full[0].t >= 0.1 * wall and full[-1].output_tokens > full[0].output_tokens:
            rate = (full[-1].output_tokens - full[0].output_tokens) / (full[-1].t - full[0].t)
        else:
            method = "whole_run (the sample never kept every slot busy long enough)"
            rate = total / wall
        return {
            "method": method,
            "aggregate_tokens_per_s": rate,
            "servers": self.servers,
            "slots": self.slots,
            "pilot_wall_s": wall,
            "pilot_output_tokens": total,
            # Ramp-up and drain: what the pilot took beyond its tokens at the saturated rate.
            "overhead_s": max(0.0, wall - total / rate) if rate > 0 else 0.0,
        }


def _percentile(sorted_values: list[int], q: float) -> int:
    if not sorted_values:
        return 0
    rank = max(1, math.ceil(q / 100 * len(sorted_values)))
    return sorted_values[rank - 1]


def _dist(values: list[int]) -> dict[str, float]:
    v = sorted(values)
    out: dict[str, float] = {"n": len(v), "mean": round(sum(v) / len(v), 1) if v else 0.0}
    out.update({f"p{q}": _percentile(v, q) for q in _PERCENTILES})
    out["max"] = v[-1] if v else 0
    return out


def _jsonl(path: Path) -> Iterator[dict[str, Any]]:
    if path.exists():
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip():
                    yield json.loads(line)


class Projection(BaseModel):
    """The pilot's measurements and what they project for the full set."""

    pilot: dict[str, Any]
    output_tokens: dict[str, Any]
    throughput: dict[str, Any]
    projection: dict[str, Any]
    length_model: LengthModel


def project(
    layout: RunLayout,
    plan: ShardPlan,
    population: PilotPopulation,
    summary: ValidationSummary,
    throughput: dict[str, Any],
    servers: int,
    pilot: PilotSpec,
) -> Projection:
    """Project output tokens, wall time, GPU-hours, reject rate and dataset size for the full set.

    Per-source means weigh each source by its share of the full set (a stratified estimate), so a source the
    sample over-represents (min_per_source) does not skew the totals.
    """
    tokens: dict[str, list[int]] = defaultdict(list)
    row_tokens: dict[str, list[int]] = defaultdict(list)  # prompt + completion, for the dataset size
    gen_rejects: Counter[str] = Counter()
    samples: list[LengthSample] = []
    for shard_id in plan.shard_ids:
        for c in _jsonl(layout.shard_completions(shard_id)):
            tokens[c["source"]].append(int(c["completion_tokens"]))
            row_tokens[c["source"]].append(int(c["prompt_tokens"]) + int(c["completion_tokens"]))
            chars = sum(len(m["content"]) for m in c["messages"])
            samples.append(
                LengthSample(
                    source=c["source"],
                    category=c["category"],
                    prompt_chars=chars,
                    output_tokens=int(c["completion_tokens"]),
                )
            )
        for r in _jsonl(layout.shard_rejects(shard_id)):
            gen_rejects[r["source"]] += 1
    if not samples:
        raise RuntimeError(f"pilot {pilot.name!r}: no completions to project from (every request was rejected)")

    pop = population.population_by_source
    n_full = sum(pop.values())
    by_source: dict[str, Any] = {}
    total_tokens = total_rows = total_row_tokens = 0.0
    total_rejects = 0.0
    for source, n_pop in pop.items():
        t = tokens.get(source, [])
        sampled = len(t) + gen_rejects[source]
        if sampled == 0:
            continue
        rejected = gen_rejects[source] + summary.rejected_by_source.get(source, 0)
        per_prompt = sum(t) / sampled  # generation rejects cost no output tokens
        accept = 1 - rejected / sampled
        mean_row = sum(row_tokens[source]) / len(t) if t else 0.0
        by_source[source] = {
            **_dist(t),
            "population": n_pop,
            "sampled": sampled,
            "reject_rate": round(rejected / sampled, 4),
            "projected_tokens": round(per_prompt * n_pop),
        }
        total_tokens += per_prompt * n_pop
        total_rejects += rejected / sampled * n_pop
        total_rows += accept * n_pop
        total_row_tokens += accept * n_pop * mean_row
    all_tokens = [v for t in tokens.values() for v in t]
    pilot_tokens = sum(all_tokens)

    rate = float(throughput["aggregate_tokens_per_s"])
    per_server = rate / max(1, int(throughput["servers"]))
    overhead = float(throughput["overhead_s"])
    wall = total_tokens / (per_server * servers) + overhead if per_server > 0 else math.inf
    remaining = max(0.0, total_tokens - pilot_tokens)
    wall_after_pilot = remaining / (per_server * servers) + overhead if per_server > 0 else math.inf
    return Projection(
        pilot={
            "name": pilot.name,
            "seed": pilot.seed,
            "sampled": sum(population.sample_by_source.values()),
            "sample_by_source": population.sample_by_source,
            "population": n_full,
            "population_by_source": pop,
            "selection": population.selection.model_dump(),
        },
        output_tokens={
            **_dist(all_tokens),
            "mean_per_prompt_projected": round(total_tokens / n_full, 1) if n_full else 0.0,
            "projected_total": round(total_tokens),
            "pilot_total": pilot_tokens,
            "by_source": by_source,
        },
        throughput={**throughput, "per_server_tokens_per_s": round(per_server, 1)},
        projection={
            "servers": servers,
            "wall_s": round(wall, 1),
            "wall_h": wall / 3600,
            "gpu_hours": wall / 3600 * servers,
            "wall_s_reusing_pilot": round(wall_after_pilot, 1),
            "reject_rate": round(total_rejects / n_full, 4) if n_full else 0.0,
            "rows": round(total_rows),
            "dataset_tokens": round(total_row_tokens),
            "dataset_bytes_uncompressed": round(total_row_tokens * BYTES_PER_TOKEN),
        },
        length_model=LengthModel.fit(samples),
    )


def render_projection(p: Projection) -> str:
    """The pilot report as markdown (the Prefect artifact and pilot.md)."""
    pr, ot, th = p.projection, p.output_tokens, p.throughput
    lines = [
        f"# Pilot `{p.pilot['name']}`: projection for {p.pilot['population']:,} prompts on {pr['servers']} servers",
        "",
        f"Sample: {p.pilot['sampled']:,} prompts (seed {p.pilot['seed']}), stratified by source.",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| output tokens, total (projected) | {ot['projected_total']:,} |",
        f"| output tokens per completion: mean / p50 / p90 / p99 | "
        f"{ot['mean']:,} / {ot['p50']:,} / {ot['p90']:,} / {ot['p99']:,} |",
        f"| throughput per server (measured, {th['method']}) | {th['per_server_tokens_per_s']:,} tok/s |",
        f"| wall time | {pr['wall_h']:,.3f} h ({pr['wall_s']:,} s) |",
        f"| wall time reusing the pilot's completions | {pr['wall_s_reusing_pilot']:,} s |",
        f"| GPU-hours | {pr['gpu_hours']:,.3f} |",
        f"| reject rate | {pr['reject_rate']:.1%} |",
        f"| dataset rows / tokens | {pr['rows']:,} / {pr['dataset_tokens']:,} |",
        f"| dataset size (uncompressed ids + mask) | {pr['dataset_bytes_uncompressed'] / 1e9:,.2f} GB |",
        "",
        "| source | population | sampled | mean | p50 | p90 | p99 | reject rate | projected tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for source, s in ot["by_source"].items():
        lines.append(
            f"| {source} | {s['population']:,} | {s['sampled']:,} | {s['mean']:,} | {s['p50']:,} | {s['p90']:,} "
            f"| {s['p99']:,} | {s['reject_rate']:.1%} | {s['projected_tokens']:,} |"
        )
    return "\n".join(lines) + "\n"


def load_projection(work_dir: Path, pilot_name: str) -> Projection:
    """The projection a finished pilot wrote (raises FileNotFoundError naming the path when there is none)."""
    path = RunLayout.for_run(work_dir, pilot_name).root / PILOT_JSON
    if not path.is_file():
        raise FileNotFoundError(f"{path}: no finished pilot named {pilot_name!r} on this box (run the pilot flow)")
    return Projection.model_validate_json(path.read_text(encoding="utf-8"))


class ImportReport(BaseModel):
    """What import_pilot copied into the main run's checkpoints."""

    pilot_requests: int = Field(description="Settled requests the pilot holds.")
    imported_completions: int
    imported_rejects: int
    already_present: int = Field(description="Pilot requests the main run's checkpoints already held.")
    shards_skipped: list[int] = Field(default_factory=list, description="Shards left alone (torn checkpoint line).")


def _index(paths: list[Path]) -> dict[str, tuple[Path, int, int]]:
    """request_key -> (file, offset, length) of every settled request in the given checkpoint files."""
    index: dict[str, tuple[Path, int, int]] = {}
    for path in paths:
        if not path.exists():
            continue
        offset = 0
        with open(path, "rb") as f:
            for raw in f:
                if raw.endswith(b"\n") and raw.strip():
                    key = json.loads(raw).get("request_key")
                    if isinstance(key, str):
                        index[key] = (path, offset, len(raw))
                offset += len(raw)
    return index


def _settled_keys(path: Path) -> set[str] | None:
    """Request keys in a checkpoint file; None when its last line is torn (generation repairs it, not us)."""
    if not path.exists():
        return set()
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        return None
    return {json.loads(line)["request_key"] for line in data.splitlines() if line.strip()}


def import_pilot(
    pilot_layout: RunLayout, layout: RunLayout, plan: ShardPlan, spec: RunSpec, chat: ChatTokenizer
) -> ImportReport:
    """Append the pilot's settled requests to the main run's shard checkpoints, under the same request keys.

    Only requests whose key the main shard produces are copied (a pilot with other sampling or another model
    contributes nothing). Idempotent: keys already in a checkpoint are not copied again.
    """
    shard_files = sorted(pilot_layout.shards_dir.glob("shard-*.completions.jsonl"))
    completions = _index(shard_files)
    rejects = _index(sorted(pilot_layout.shards_dir.glob("shard-*.rejects.jsonl")))
    # A generation reject of the pilot that a pilot retry later completed is not settled as a reject.
    for key in completions:
        rejects.pop(key, None)
    report = ImportReport(
        pilot_requests=len(completions) + len(rejects), imported_completions=0, imported_rejects=0, already_present=0
    )
    for shard_id in plan.shard_ids:
        comp_path, rej_path = layout.shard_completions(shard_id), layout.shard_rejects(shard_id)
        done_c, done_r = _settled_keys(comp_path), _settled_keys(rej_path)
        if done_c is None or done_r is None:
            report.shards_skipped.append(shard_id)
            continue
        settled = done_c | done_r
        wanted_c: list[tuple[Path, int, int]] = []
        wanted_r: list[tuple[Path, int, int]] = []
        with open(layout.shard_prompts(shard_id), encoding="utf-8") as f:
            for line in f:
                if not line.strip():
                    continue
                prompt = Prompt.from_json(line)
                key = request_key(prompt.prompt_id, spec.sampling, chat.fingerprint, chat.template_hash)
                if key in settled:
                    report.already_present += key in completions or key in rejects
                    continue
                if key in completions:
                    wanted_c.append(completions[key])
                elif key in rejects:
                    wanted_r.append(rejects[key])
                settled.add(key)
        report.imported_completions += _append(comp_path, wanted_c)
        report.imported_rejects += _append(rej_path, wanted_r)
    log.info(
        "reused %d completions and %d rejects of the pilot (%d already present)",
        report.imported_completions,
        report.imported_rejects,
        report.already_present,
    )
    return report


def _append(target: Path, lines: list[tuple[Path, int, int]]) -> int:
    if not lines:
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target, "ab") as out:
        for source, offset, length in lines:
            with open(source, "rb") as f:
                f.seek(offset)
                out.write(f.read(length))
        out.flush()
        os.fsync(out.fileno())
    return len(lines)


def write_projection(layout: RunLayout, projection: Projection) -> Path:
    """Write pilot.json and pilot.md into the pilot's run directory; returns the JSON path."""
    layout.root.mkdir(parents=True, exist_ok=True)
    (layout.root / PILOT_MARKDOWN).write_text(render_projection(projection), encoding="utf-8")
    path = layout.root / PILOT_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(projection.model_dump_json(indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path
