"""Pilot stage bodies: sample the prompt set, measure throughput while generating, project the full run, reuse.

    plan_pilot(...)          seeded sample stratified by source, planned into the pilot's own shards
    ThroughputProbe(...)     samples the dispatcher's counters while the pilot generates
    project(...)             output tokens, wall time, GPU-hours, reject rate and size for the full set
    import_pilot(...)        copies the pilot's settled requests into a main run's shard checkpoints

The pilot's requests carry the same request keys as the main run's (same prompt ids, sampling, model and
template), so importing them makes the main run's generation ledger skip them: nothing is generated twice.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import threading
import time
from collections import defaultdict
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import httpx
from pydantic import BaseModel, ConfigDict, Field

from datagen.chat import ChatTokenizer
from datagen.checkpoint import CheckpointLine, append_lines, read_lines, settled_keys
from datagen.checks.quality import ValidationSummary
from datagen.conversation.turn_mode import TurnMode, turn_mode
from datagen.conversation.turn_stats import distribution
from datagen.engine import plan_trial
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.memory_plan import MemoryPlan
from datagen.engine.plan_trial import TrialChoice
from datagen.identity import PromptIdentity, RequestKeys
from datagen.layout import RunLayout
from datagen.operations.form_schema import optional_fields_as_plain_inputs
from datagen.runspec import RunSpec
from datagen.sources.prompts import iter_prompts
from tasks import pilot_turns
from tasks.chains import DecodeModel, simulate_wall
from tasks.generation import read_prompts
from tasks.ordering import LengthModel, LengthSample, StepModel
from tasks.planning import ShardPlan, plan_shards
from tasks.selection import SelectionReport, choose, filtered, stratified_sample

__all__ = [
    "PILOT_JSON",
    "PILOT_MARKDOWN",
    "DecodeModel",
    "ImportReport",
    "PilotPopulation",
    "PilotSpec",
    "Projection",
    "ServerReading",
    "ThroughputProbe",
    "ThroughputSample",
    "dispatch_order",
    "expand_population",
    "fit_decode_model",
    "import_pilot",
    "load_projection",
    "plan_pilot",
    "project",
    "render_projection",
    "simulate_wall",
    "write_projection",
]

log = logging.getLogger(__name__)

DispatchOrder = Literal["source", "long_first"]  # RunSpec.order's values
PILOT_JSON = "pilot.json"
PILOT_MARKDOWN = "pilot.md"
BYTES_PER_TOKEN = 5  # int32 token id + int8 loss-mask value, uncompressed


class PilotSpec(BaseModel):
    """What the pilot samples and what it projects for."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=optional_fields_as_plain_inputs)

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
    plan_trial: TrialChoice = Field(
        "auto",
        description="Run candidate memory plans side by side on different servers and keep the fastest for the main "
        "run (datagen.engine.plan_trial). auto: on with two or more launched servers and a memory plan.",
    )


class PilotPopulation(BaseModel):
    """The full set the pilot stands for and the sample drawn from it."""

    population_by_source: dict[str, int]
    sample_by_source: dict[str, int]
    selection: SelectionReport


def plan_pilot(
    spec: RunSpec, pilot: PilotSpec, layout: RunLayout, skip: Collection[str], base_dir: Path | None = None
) -> tuple[ShardPlan, PilotPopulation]:
    """Draw the pilot's sample from what the main run would take (same skips and targets) and plan it."""
    identity = PromptIdentity.for_spec(spec)  # the main run's ids, so its plan finds the pilot's completions
    selection, report = choose(
        iter_prompts(spec.sources, base_dir, identity),
        skip,
        spec.source_target_counts,
        spec.category_target_counts,
        spec.selection_seed,
    )
    sample, population, allocated = stratified_sample(
        iter_prompts(spec.sources, base_dir, identity),
        selection.keeps,
        pilot.sample_size,
        pilot.seed,
        pilot.min_per_source,
    )
    n = len(sample)
    pilot_spec = spec.model_copy(update={"shard_size": max(1, math.ceil(n / pilot.shards))})
    # By either id: a pilot dir planned under the legacy ids (tasks.planning.id_scheme) takes the same sample.
    plan = plan_shards(
        pilot_spec, layout, base_dir, select=filtered(lambda p: p.prompt_id in sample or p.alias in sample)
    )
    return plan, PilotPopulation(population_by_source=population, sample_by_source=allocated, selection=report)


@dataclass(frozen=True, slots=True)
class ThroughputSample:
    """One reading of the dispatcher's counters."""

    t: float
    output_tokens: int
    completed: int
    queued: int


@dataclass(frozen=True, slots=True)
class ServerReading:
    """One reading of a server's own decode state: `/metrics` (with --enable-metrics) or `/v1/loads`."""

    t: float
    server: str
    running: int
    waiting: int
    generation_tokens: float | None  # sglang:generation_tokens_total; None when only /v1/loads answered
    gen_throughput: float  # the server's own recent tokens/s


def _parse_prometheus(text: str) -> dict[str, float]:
    """Metric name -> value summed over label sets (dp/tp ranks)."""
    out: dict[str, float] = defaultdict(float)
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name_labels, _, value = line.rpartition(" ")
        try:
            out[name_labels.split("{", 1)[0]] += float(value)
        except ValueError:
            continue
    return out


def fit_decode_model(
    readings: list[ServerReading], slots_per_server: int
) -> tuple[DecodeModel, float, dict[str, Any]] | None:
    """Fit step_s(B) from the servers' own counters; returns (model, saturated tokens/s per server, details).

    Each pair of consecutive readings of one server at the same running batch B gives a point (B, gen_throughput):
    the server's own decode-step rate. The saturated rate is measured over intervals where the server ran a full
    batch; the slope of the step time in B comes from a least-squares line over per-batch medians (the pilot's
    drain supplies the low batches). The line is anchored at the measured saturated rate. None when the servers
    never reported a running batch.

    Why gen_throughput and not deltas of sglang:generation_tokens_total: real SGLang adds a request's tokens to
    that counter when the request FINISHES (TokenizerMetricsCollector.observe_one_finished_request), so over the
    probe's sub-second intervals a delta is either 0 or whole outputs at once, and it follows finishes, not the
    decode speed at batch B (it would read 0 tok/s while 64 requests decode). gen_throughput is what SGLang's
    scheduler measures per decode step (tokens generated over its last --decode-log-interval of 40 steps), in
    /metrics and /v1/loads alike, so both paths read the same quantity. The finish-time counter (and the
    client's own completion counts) only give a whole-run average, reported beside the fit by `measure`.
    """
    by_server: dict[str, list[ServerReading]] = defaultdict(list)
    for r in readings:
        by_server[r.server].append(r)
    points: dict[int, list[float]] = defaultdict(list)  # batch -> step seconds
    sat_tokens = sat_time = 0.0
    for rs in by_server.values():
        rs.sort(key=lambda r: r.t)
        for a, b in itertools.pairwise(rs):
            dt = b.t - a.t
            if dt <= 0:
                continue
            if a.running <= 0 or b.running != a.running:
                continue  # a batch change inside the interval mixes two rates
            tokens, rate, batch = b.gen_throughput * dt, b.gen_throughput, b.running
            if rate <= 0:
                continue
            points[batch].append(batch / rate)
            if batch >= slots_per_server:
                sat_tokens += tokens
                sat_time += dt
    if not points:
        return None
    xs = sorted(points)
    ys = [sorted(points[x])[len(points[x]) // 2] for x in xs]  # median step per batch: robust to a starved poll
    slope = 0.0
    if len(xs) >= 2 and xs[-1] - xs[0] >= max(2, slots_per_server // 4):
        x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
        sxx = sum((x - x_mean) ** 2 for x in xs)
        slope = max(0.0, sum((x - x_mean) * (y - y_mean) for x, y in zip(xs, ys, strict=True)) / sxx)
    if sat_time > 0 and sat_tokens > 0:
        saturated = sat_tokens / sat_time
        method = "saturated (server gen_throughput at full batch)"
    else:  # never a full batch: extrapolate the line to it
        x_mean, y_mean = sum(xs) / len(xs), sum(ys) / len(ys)
        step_full = max(y_mean + slope * (slots_per_server - x_mean), 1e-9)
        saturated = slots_per_server / step_full
        method = "extrapolated to a full batch (the servers never ran one)"
    step_full = slots_per_server / saturated
    base = step_full - slope * slots_per_server
    if base <= 0:  # a noisy slope steeper than the whole step: keep the measured saturated rate, flatten the line
        slope, base = 0.0, step_full
    model = DecodeModel(step_base_s=base, step_per_req_s=slope)
    details = {
        "method": method,
        "batches_observed": [xs[0], xs[-1]],
        "saturated_seconds_observed": round(sat_time, 2),
        "single_request_tokens_per_s": round(model.tokens_per_s(1), 1),
    }
    return model, saturated, details


class ThroughputProbe:
    """Reads dispatcher.stats() and every server's own decode counters every `interval_s` while generation runs.

    `endpoints`: the servers to poll (`/metrics` when the server runs with --enable-metrics, else `/v1/loads`).
    Without endpoints only the dispatcher's completion-time counters are read (a cruder whole-run rate).
    """

    def __init__(
        self, dispatcher: Dispatcher, endpoints: Sequence[ServerEndpoint] = (), interval_s: float = 0.25
    ) -> None:
        self._dispatcher = dispatcher
        self._endpoints = list(endpoints)
        self._interval_s = interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pilot-throughput", daemon=True)
        self._http = httpx.Client(timeout=2.0)
        self._use_metrics: dict[str, bool] = {}
        self.samples: list[ThroughputSample] = []
        self.server_readings: list[ServerReading] = []
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
        for e in self._endpoints:
            try:
                self.server_readings.append(self._read_server(e))
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
                log.debug("pilot probe: %s unreadable: %s", e.name, exc)

    def _read_server(self, e: ServerEndpoint) -> ServerReading:
        headers = {"Authorization": f"Bearer {e.api_key.get_secret_value()}"} if e.api_key else {}
        base = e.url.rstrip("/")
        if self._use_metrics.get(e.name, True):
            resp = self._http.get(f"{base}/metrics", headers=headers)
            if resp.status_code == 200 and "sglang:generation_tokens_total" in resp.text:
                t = time.monotonic()
                m = _parse_prometheus(resp.text)
                return ServerReading(
                    t,
                    e.name,
                    int(m["sglang:num_running_reqs"]),
                    int(m.get("sglang:num_queue_reqs", 0)),
                    m["sglang:generation_tokens_total"],
                    m.get("sglang:gen_throughput", 0.0),
                )
            self._use_metrics[e.name] = False  # metrics off: /v1/loads answers without --enable-metrics
        resp = self._http.get(f"{base}/v1/loads", headers=headers)
        resp.raise_for_status()
        t = time.monotonic()
        loads = resp.json()["loads"]
        return ServerReading(
            t,
            e.name,
            sum(int(x["num_running_reqs"]) for x in loads),
            sum(int(x["num_waiting_reqs"]) for x in loads),
            None,
            sum(float(x["gen_throughput"]) for x in loads),
        )

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
        self._http.close()
        self.ended = time.monotonic()

    def measure(self) -> dict[str, Any]:
        """Per-server decode model and saturated tokens/s from the servers' counters (see fit_decode_model).

        Falls back to the dispatcher's completion-time counters (whole-run rate, no batch model) when no server
        answered. `ramp_s`: from the start until the first server reported a running request.
        """
        wall = max(self.ended - self.started, 1e-9)
        total = self.samples[-1].output_tokens - self.samples[0].output_tokens if self.samples else 0
        servers = max(1, self.servers)
        slots_per_server = max(1, round(self.slots / servers)) if self.slots else 1
        busy = [r.t for r in self.server_readings if r.running > 0]
        ramp = max(0.0, min(busy) - self.started) if busy else 0.0
        out: dict[str, Any] = {
            "servers": self.servers,
            "slots": self.slots,
            "slots_per_server": slots_per_server,
            "pilot_wall_s": wall,
            "pilot_output_tokens": total,
            # Whole-run average from the completions the client received: a cross-check of the fit, not its input.
            "whole_run_tokens_per_s": total / wall,
            "ramp_s": round(ramp, 3),
            "server_readings": len(self.server_readings),
            "counters": "metrics"
            if any(r.generation_tokens is not None for r in self.server_readings)
            else ("loads" if self.server_readings else "dispatcher"),
        }
        fitted = fit_decode_model(self.server_readings, slots_per_server)
        if fitted is not None:
            model, saturated, details = fitted
            return (
                out
                | details
                | {
                    "aggregate_tokens_per_s": saturated * servers,
                    "step_base_s": model.step_base_s,
                    "step_per_req_s": model.step_per_req_s,
                }
            )
        rate = total / wall
        return out | {
            "method": "whole_run (no server counters; completion-time rate, no batch model)",
            "aggregate_tokens_per_s": rate,
            "overhead_s": 0.0,
        }


def expand_population(samples: list[tuple[LengthSample, float]], target: int) -> list[tuple[float, int]]:
    """`target` (predicted, actual) lengths standing for a population: each sample repeated by its weight.

    Largest-remainder rounding keeps the total exact; the caller orders the result.
    """
    counts = pilot_turns.repeat_counts(len(samples), target)
    return [(pred, s.output_tokens) for (s, pred), c in zip(samples, counts, strict=True) for _ in range(c)]


def dispatch_order(items: list[tuple[float, int]], order: DispatchOrder, seed: int = 0) -> list[int]:
    """Actual lengths in dispatch order: RunSpec.order's "source" (a seeded shuffle) or "long_first" (predicted)."""
    shuffled = list(items)
    random.Random(seed).shuffle(shuffled)  # file order mixes the strata; ties of long-first keep it
    if order == "long_first":
        shuffled.sort(key=lambda x: -x[0])
    elif order != "source":
        raise ValueError(f"unknown order {order!r}")
    return [n for _, n in shuffled]


def _dist(values: list[int]) -> dict[str, float]:
    return distribution(values, mean_digits=1)  # pilot.json's figures, as they always were


class Projection(BaseModel):
    """The pilot's measurements and what they project for the full set."""

    pilot: dict[str, Any]
    output_tokens: dict[str, Any]
    throughput: dict[str, Any]
    projection: dict[str, Any]
    length_model: LengthModel
    engine: dict[str, Any] = Field(
        default_factory=dict, description="The memory plans (pilot's servers, main run) and the decode roofline."
    )
    conversations: dict[str, Any] | None = Field(
        None, description="Every-turn mode: per step, per user turn and per conversation (tasks.pilot_turns)."
    )
    step_model: StepModel | None = Field(
        None, description="Every-turn mode: mean step length per category and kind (first turn, later, tool round)."
    )


def project(
    layout: RunLayout,
    plan: ShardPlan,
    population: PilotPopulation,
    summary: ValidationSummary,
    throughput: dict[str, Any],
    servers: int,
    pilot: PilotSpec,
    *,
    turns: TurnMode,
) -> Projection:
    """Project output tokens, wall time, GPU-hours, reject rate and dataset size for the full set.

    Per-source means weigh each source by its share of the full set (a stratified estimate), so a source the
    sample over-represents (min_per_source) does not skew the totals.
    """
    # A sample is a prompt in `last` mode and a whole conversation in every-turn mode (tasks.pilot_turns).
    measured = pilot_turns.measure(layout, plan, turns, summary.reject_paths)
    tokens, row_tokens, gen_rejects, samples = (
        measured.tokens,
        measured.row_tokens,
        measured.gen_rejects,
        measured.samples,
    )
    if not samples:
        raise RuntimeError(f"pilot {pilot.name!r}: no completions to project from (every request was rejected)")

    pop = population.population_by_source
    n_full = sum(pop.values())
    by_source: dict[str, Any] = {}
    total_tokens = total_rows = total_row_tokens = 0.0
    total_rejects = total_judged = total_steps = 0.0
    for source, n_pop in pop.items():
        t = tokens.get(source, [])
        sampled = len(t) + gen_rejects[source]
        if sampled == 0:
            continue
        per_prompt = sum(t) / sampled  # generation rejects cost no output tokens
        if measured.rows is not None and measured.segments is not None and measured.steps is not None:
            # Every-turn mode: rows are user-turn segments; a reject is a segment reached that made no row.
            judged = measured.segments[source] / sampled
            accept = measured.rows[source] / sampled  # rows per conversation
            rejected_per = judged - accept
            mean_row = sum(row_tokens[source]) / len(row_tokens[source]) if row_tokens[source] else 0.0
            total_steps += measured.steps[source] / sampled * n_pop
        else:
            judged = 1.0
            rejected_per = (gen_rejects[source] + summary.rejected_by_source.get(source, 0)) / sampled
            accept = 1 - rejected_per
            mean_row = sum(row_tokens[source]) / len(t) if t else 0.0
        by_source[source] = {
            **_dist(t),
            "population": n_pop,
            "sampled": sampled,
            "reject_rate": round(rejected_per / judged, 4),
            "projected_tokens": round(per_prompt * n_pop),
        }
        total_tokens += per_prompt * n_pop
        total_rejects += rejected_per * n_pop
        total_judged += judged * n_pop
        total_rows += accept * n_pop
        total_row_tokens += accept * n_pop * mean_row
    all_tokens = [v for t in tokens.values() for v in t]
    pilot_tokens = sum(all_tokens)

    length_model = LengthModel.fit(samples)
    step_means = pilot_turns.step_model(measured)
    rate = float(throughput["aggregate_tokens_per_s"])
    per_server = rate / max(1, int(throughput["servers"]))
    remaining = max(0.0, total_tokens - pilot_tokens)
    walls: dict[str, float] = {}
    if "step_base_s" in throughput:
        model = DecodeModel(float(throughput["step_base_s"]), float(throughput["step_per_req_s"]))
        slots = int(throughput["slots_per_server"])
        ramp = float(throughput.get("ramp_s", 0.0))
        if measured.chains is not None:  # every turn: conversations as chains of steps, as the driver ranks them
            simulated = pilot_turns.chain_walls(
                measured, pop, population.sample_by_source, length_model, step_means, servers, slots, model, pilot.seed
            )
            method = "simulated: server decode model, the pilot's conversations as chains, most work left first"
        else:
            simulated = _request_walls(samples, gen_rejects, population, length_model, servers, slots, model, pilot)
            method = "simulated: server decode model, pilot lengths in dispatch order"
        walls = {key: ramp + s for key, s in simulated.items()}
    else:  # no batch model: tokens at the whole-run rate of the pilot
        walls["wall_s"] = walls["wall_s_source"] = total_tokens / (per_server * servers) if per_server > 0 else math.inf
        walls["wall_s_reusing_pilot"] = remaining / (per_server * servers) if per_server > 0 else math.inf
        method = "tokens / whole-run rate (no server counters)"
    wall = walls["wall_s"]
    bound = total_tokens / (per_server * servers) if per_server > 0 else math.inf
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
            **_dist(measured.request_tokens),  # per request (a step in every-turn mode): the memory plan's figure
            "mean_per_prompt_projected": round(total_tokens / n_full, 1) if n_full else 0.0,
            "projected_total": round(total_tokens),
            "pilot_total": pilot_tokens,
            "by_source": by_source,
        },
        throughput={**throughput, "per_server_tokens_per_s": round(per_server, 1)},
        projection={
            "servers": servers,
            "order": "long_first",
            "method": method,
            "wall_s": round(wall, 1),
            "wall_h": wall / 3600,
            "gpu_hours": wall / 3600 * servers,
            "wall_s_source": round(walls["wall_s_source"], 1),
            "wall_s_reusing_pilot": round(walls["wall_s_reusing_pilot"], 1),
            "wall_s_saturated_bound": round(bound, 1),
            "tail_s": round(wall - bound, 1),
            "reject_rate": round(total_rejects / total_judged, 4) if total_judged else 0.0,
            "rows": round(total_rows),
            "dataset_tokens": round(total_row_tokens),
            "dataset_bytes_uncompressed": round(total_row_tokens * BYTES_PER_TOKEN),
        }
        | ({"steps": round(total_steps), "policy": "expected_work_left"} if measured.conversations is not None else {}),
        length_model=length_model,
        conversations=measured.conversations,
        step_model=step_means,
    )


def _request_walls(
    samples: list[LengthSample],
    gen_rejects: Mapping[str, int],
    population: PilotPopulation,
    length_model: LengthModel,
    servers: int,
    slots: int,
    model: DecodeModel,
    pilot: PilotSpec,
) -> dict[str, float]:
    """Simulated seconds of a `last` mode run: the full set (and its part the pilot did not sample) as requests.

    Each source's samples stand for its population (each repeated by its weight; a generation reject takes no
    decode time), dispatched long-first by the length model's prediction (`wall_s`, `wall_s_reusing_pilot`) or in
    a seeded shuffle (`wall_s_source`).
    """
    by_src: dict[str, list[tuple[LengthSample, float]]] = defaultdict(list)
    for smp in samples:
        by_src[smp.source].append((smp, length_model.predict_features(smp.source, smp.category, smp.prompt_chars)))
    full_items: list[tuple[float, int]] = []
    rest_items: list[tuple[float, int]] = []
    for source, n_pop in population.population_by_source.items():
        src_samples = by_src.get(source, [])
        sampled = len(src_samples) + gen_rejects.get(source, 0)
        if not src_samples:
            continue
        completing = len(src_samples) / sampled  # generation rejects take no decode time
        full_items += expand_population(src_samples, round(n_pop * completing))
        rest = max(0, n_pop - population.sample_by_source.get(source, sampled))
        rest_items += expand_population(src_samples, round(rest * completing))
    orders: tuple[tuple[str, list[tuple[float, int]], DispatchOrder], ...] = (
        ("wall_s", full_items, "long_first"),
        ("wall_s_source", full_items, "source"),
        ("wall_s_reusing_pilot", rest_items, "long_first"),
    )
    return {
        key: simulate_wall(dispatch_order(items, order, pilot.seed), servers, slots, model)
        for key, items, order in orders
    }


def engine_section(pilot_plan: MemoryPlan | None, main_plan: MemoryPlan | None, why: str) -> dict[str, Any]:
    """What the pilot's servers ran with and the plan for the main run at the measured context, with its roofline."""
    if main_plan is None:
        return {"skipped": why}
    launched = main_plan.launched or main_plan.planned.sizing
    return {
        "pilot_plan_args": pilot_plan.plan_args if pilot_plan else [],
        "pilot_running_requests": (
            pilot_plan.launched.concurrency(pilot_plan.context_tokens) if pilot_plan and pilot_plan.launched else None
        ),
        "main_plan": main_plan.lineage(),
        "main_running_requests": launched.concurrency(main_plan.context_tokens),
        "roofline_tokens_per_s": round(main_plan.roofline_tokens_per_s, 1) if main_plan.roofline_tokens_per_s else None,
    }


RECORDED_TURNS = "recorded: 1 + the prompts' assistant turns, no step measured"


def plan_turns(projection: Projection | None, recorded: float) -> tuple[float, str]:
    """Turns per conversation for the memory plan's radix-cache choice (`turns_per_conversation`), and their source.

    The radix cache pays when a conversation's requests extend each other: every step does (a user turn's first, and
    each tool round after it). An every-turn pilot measured them: its steps, projected over the full set per
    conversation. Without one (no pilot, or a `last` mode pilot) the recording's count, `recorded`
    (`tasks.planning.conversation_turns`).
    """
    conv = projection.conversations if projection is not None else None
    steps = projection.projection.get("steps") if projection is not None else None
    population = projection.pilot.get("population") if projection is not None else None
    if projection is None or not conv or not steps or not population:
        return recorded, RECORDED_TURNS
    user_turns, per_turn = conv["user_turns_per_conversation"]["mean"], conv["steps_per_user_turn"]["mean"]
    return round(steps / population, 3), (
        f"measured by pilot {projection.pilot['name']}: {conv['conversations']:,} conversations, "
        f"{user_turns:g} user turns each and {per_turn:g} steps per user turn (tool rounds included), "
        f"projected over {population:,}; the recording said {recorded:.3g}"
    )


def render_projection(p: Projection) -> str:
    """The pilot report as markdown (the Prefect artifact and pilot.md)."""
    pr, ot, th = p.projection, p.output_tokens, p.throughput
    what, request = ("conversations", "step") if p.conversations else ("prompts", "completion")
    # Every turn: the plan is long-first, and the driver sends the ready step with the most expected work left.
    dispatch = "long-first, ready steps by expected work left" if pr.get("policy") else "long-first dispatch"
    lines = [
        f"# Pilot `{p.pilot['name']}`: projection for {p.pilot['population']:,} {what} on {pr['servers']} servers",
        "",
        f"Sample: {p.pilot['sampled']:,} {what} (seed {p.pilot['seed']}), stratified by source.",
        "",
        "| measure | value |",
        "|---|---:|",
        f"| output tokens, total (projected) | {ot['projected_total']:,} |",
        f"| output tokens per {request}: mean / p50 / p90 / p99 | "
        f"{ot['mean']:,} / {ot['p50']:,} / {ot['p90']:,} / {ot['p99']:,} |",
        f"| throughput per server (measured, {th['method']}) | {th['per_server_tokens_per_s']:,} tok/s |",
        *_engine_rows(p.engine),
        f"| wall time ({dispatch}) | {pr['wall_h']:,.3f} h ({pr['wall_s']:,} s) |",
        f"| of which beyond the saturated rate (ramp, drain) | {pr.get('tail_s', 0.0):,} s |",
        # "wall_s_fifo": the key before the order was named as RunSpec.order names it (pilots written then).
        f"| wall time in source order | {pr.get('wall_s_source', pr.get('wall_s_fifo', pr['wall_s'])):,} s |",
        f"| wall time reusing the pilot's completions | {pr['wall_s_reusing_pilot']:,} s |",
        f"| GPU-hours | {pr['gpu_hours']:,.3f} |",
        f"| reject rate | {pr['reject_rate']:.1%} |",
        f"| dataset rows / tokens | {pr['rows']:,} / {pr['dataset_tokens']:,} |",
        f"| dataset size (uncompressed ids + mask) | {pr['dataset_bytes_uncompressed'] / 1e9:,.2f} GB |",
        "",
        *(["Per source, output tokens per conversation (its steps summed):", ""] if p.conversations else []),
        "| source | population | sampled | mean | p50 | p90 | p99 | reject rate | projected tokens |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for source, s in ot["by_source"].items():
        lines.append(
            f"| {source} | {s['population']:,} | {s['sampled']:,} | {s['mean']:,} | {s['p50']:,} | {s['p90']:,} "
            f"| {s['p99']:,} | {s['reject_rate']:.1%} | {s['projected_tokens']:,} |"
        )
    lines += pilot_turns.turn_report(p.conversations, pr)
    return "\n".join(lines) + "\n"


def _engine_rows(engine: dict[str, Any]) -> list[str]:
    """Pilot report rows: the plan's running requests and its memory-bandwidth roofline beside the measurement."""
    if not engine or "main_plan" not in engine:
        return [f"| memory plan | {engine.get('skipped', 'not computed')} |"] if engine else []
    plan = engine["main_plan"]
    roofline = engine["roofline_tokens_per_s"]
    return [
        f"| pilot servers' flags (plan before measuring) | {' '.join(engine['pilot_plan_args']) or 'SGLang defaults'} "
        f"({engine['pilot_running_requests']} running per GPU) |",
        f"| main run's plan at {plan['context_tokens']:,} tokens of context | {' '.join(plan['plan_args']) or '-'} "
        f"({engine['main_running_requests']} running per GPU; SGLang defaults: "
        f"{plan['default_running_requests_per_gpu']}) |",
        f"| expected output tok/s per GPU (memory-bandwidth roofline at that batch) | "
        f"{f'{roofline:,.0f}' if roofline else 'unknown card bandwidth'} |",
        *_radix_row(plan.get("radix_cache")),
        *_fraction_row(plan.get("mem_fraction_static")),
        *plan_trial.report_rows(engine),
    ]


def _fraction_row(fraction: dict[str, Any] | None) -> list[str]:
    """The main run's --mem-fraction-static, where it came from and its evidence (none in old pilots)."""
    if not fraction:
        return []
    why = str(fraction.get("why") or "-").replace("|", "/")
    return [f"| --mem-fraction-static for the main run | {fraction['value']:g} ({fraction['source']}): {why} |"]


def _radix_row(radix: dict[str, Any] | None) -> list[str]:
    """The main run's radix-cache choice (prefix reuse vs state slots) and why, from the plan (none in old pilots)."""
    if not radix:
        return []
    why = str(radix.get("why") or "-").replace("|", "/")
    return [
        f"| radix cache for the main run (prefix reuse vs state slots) | {'kept' if radix['kept'] else 'off'}: {why} |"
    ]


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
    other_mode: int = Field(0, description="Pilot requests of the other turns mode (steps or single completions).")


def _index(paths: list[Path]) -> dict[str, CheckpointLine]:
    """request_key -> its committed line, over the given checkpoint files (later files win)."""
    index: dict[str, CheckpointLine] = {}
    for path in paths:
        for line in read_lines(path):
            key = line.row(path).get("request_key")
            if isinstance(key, str):
                index[key] = line
    return index


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
    key_of = RequestKeys(spec.sampling, chat)
    # Every-turn mode: a conversation's steps carry `<its key>:step-N` and go together. A conversation the main
    # run holds any step of is not touched: a pilot step conditioned on another history would not continue it.
    steps = pilot_turns.keys_by_conversation([*completions, *rejects])
    mode = turn_mode(spec)
    for shard_id in plan.shard_ids:
        comp_path, rej_path = layout.shard_completions(shard_id), layout.shard_rejects(shard_id)
        settled = settled_keys(comp_path, "completion") | settled_keys(rej_path, "reject")
        wanted_c: list[CheckpointLine] = []
        wanted_r: list[CheckpointLine] = []
        for prompt in read_prompts(layout.shard_prompts(shard_id)):
            keys = steps.get(key_of(prompt.prompt_id), [])
            if any(mode.split_key(key) is None for key in keys):
                # A pilot of the other mode: its lines are not what this run's engine writes or continues.
                report.other_mode += len(keys)
                continue
            present = sum(key in settled for key in keys)
            if present:
                report.already_present += present
                continue
            for key in keys:
                if key in completions:
                    wanted_c.append(completions[key])
                elif key in rejects:
                    wanted_r.append(rejects[key])
                settled.add(key)
        # append_lines cuts a torn tail off first (the checkpoint policy), so a crashed shard is no obstacle.
        report.imported_completions += append_lines(comp_path, wanted_c)
        report.imported_rejects += append_lines(rej_path, wanted_r)
    log.info(
        "reused %d completions and %d rejects of the pilot (%d already present)",
        report.imported_completions,
        report.imported_rejects,
        report.already_present,
    )
    if report.other_mode:
        log.warning(
            "%d requests of the pilot were made with the other turns mode than this run's (%s): not reused",
            report.other_mode,
            mode.name,
        )
    return report


def write_projection(layout: RunLayout, projection: Projection) -> Path:
    """Write pilot.json and pilot.md into the pilot's run directory; returns the JSON path."""
    layout.root.mkdir(parents=True, exist_ok=True)
    (layout.root / PILOT_MARKDOWN).write_text(render_projection(projection), encoding="utf-8")
    path = layout.root / PILOT_JSON
    tmp = path.with_suffix(".json.tmp")
    tmp.write_text(projection.model_dump_json(indent=2), encoding="utf-8")
    os.replace(tmp, path)
    return path
