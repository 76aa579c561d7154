"""A small pilot run on stand-in servers: its projection, and a main run that reuses its completions (real S3)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datagen.chat import ChatTokenizer
from datagen.checks.quality import ValidationSummary
from datagen.conversation.turn_mode import LastTurn
from datagen.engine.client import sampling_params_for
from datagen.engine.dispatcher import Dispatcher, GenerateJob
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Prompt, Reject
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from flows.expand_dataset import expand_dataset
from flows.pilot import pilot_flow
from tasks.chains import Chain, simulate_chains
from tasks.ordering import LengthSample
from tasks.pilot import (
    PILOT_JSON,
    PILOT_MARKDOWN,
    DecodeModel,
    PilotPopulation,
    PilotSpec,
    ServerReading,
    ThroughputProbe,
    dispatch_order,
    expand_population,
    fit_decode_model,
    project,
    simulate_wall,
)
from tasks.planning import ShardEntry, ShardPlan
from tasks.selection import SelectionReport


def _lines(paths: list[Path]) -> set[bytes]:
    return {line for p in paths if p.exists() for line in p.read_bytes().splitlines() if line.strip()}


@pytest.mark.slow
def test_pilot_projects_the_full_set_and_the_main_run_reuses_its_completions(
    prefect_api: None, pipeline_env: dict[str, str], tmp_path: Path
) -> None:
    sources = []
    for label, n in (("chat", 30), ("code", 10)):
        path = tmp_path / f"{label}.jsonl"
        rows = [
            {"messages": [{"role": "user", "content": f"[{label}] Task {i}: explain."}], "category": label}
            for i in range(n)
        ]
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        sources.append(PromptSource(path=str(path), category_field="category"))
    spec = RunSpec(
        sources=sources,
        model_path=str(ensure_model_dir()),
        namespace="pilot_main_v1",
        turns="last",
        shard_size=8,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(max_reject_rate=0.5, min_median_completion_tokens=16),
    )
    result = pilot_flow(spec, PilotSpec(name="p1", sample_size=8, min_per_source=3, seed=7, project_servers=8))

    # Stratified: 8 of 40 in proportion (6 chat, 2 code), but the small source gets its floor of 3.
    assert result["pilot"]["sample_by_source"] == {"chat": 6, "code": 3}
    assert result["pilot"]["population_by_source"] == {"chat": 30, "code": 10}
    tokens, projection = result["output_tokens"], result["projection"]
    assert set(tokens["by_source"]) == {"chat", "code"}
    assert 0 < tokens["p50"] <= tokens["p90"] <= tokens["p99"] <= tokens["max"] <= 400
    by_source = tokens["by_source"]
    # The total is the per-source means weighted by each source's share of the full set.
    assert tokens["projected_total"] == pytest.approx(
        sum(s["projected_tokens"] for s in by_source.values()), abs=len(by_source)
    )
    assert projection["servers"] == 8 and projection["wall_s"] > 0
    assert projection["gpu_hours"] == pytest.approx(projection["wall_h"] * 8)
    assert projection["wall_h"] == pytest.approx(projection["wall_s"] / 3600, abs=0.05 / 3600)
    assert 0 <= projection["reject_rate"] <= 1 and 0 < projection["rows"] <= 40
    assert result["throughput"]["per_server_tokens_per_s"] > 0
    pilot_root = RunLayout.for_run(tmp_path / "work", "p1").root
    assert json.loads((pilot_root / PILOT_JSON).read_text())["projection"] == projection
    assert "GPU-hours" in (pilot_root / PILOT_MARKDOWN).read_text()
    # No GPU emulated here: the report says why there is no memory plan (tests/e2e/test_memory_plan.py shows one).
    assert result["engine"] == {
        "skipped": "the stand-in emulates no GPU memory (DATAGEN_STANDIN_GPU_MEMORY_BYTES unset)"
    }
    assert "| memory plan | the stand-in emulates no GPU memory" in (pilot_root / PILOT_MARKDOWN).read_text()

    # The main run: every pilot completion lands, byte for byte, in the main run's checkpoints (not regenerated),
    # and dispatch is longest-expected first.
    report = expand_dataset(spec.model_copy(update={"pilot": "p1", "order": "long_first"}))
    assert report["prompts"] == 40 and report["rows"] > 0
    main = RunLayout.for_run(tmp_path / "work", "pilot_main_v1")
    pilot_completions = _lines(sorted(pilot_root.joinpath("shards").glob("*.completions.jsonl")))
    main_completions = _lines(sorted(main.shards_dir.glob("*.completions.jsonl")))
    assert len(pilot_completions) == 9 and pilot_completions <= main_completions
    first_shard = [Prompt.from_json(line) for line in main.shard_prompts(0).read_text().splitlines()]
    model = result["length_model"]
    means = {s: model["by_source"][s]["mean"] for s in model["by_source"]}
    longest = max(means, key=lambda s: means[s])
    assert first_shard[0].source == longest


def test_simulate_chains_of_one_step_reports_when_the_last_request_started() -> None:
    m = DecodeModel(0.002, 0.0005)  # step(1) = 2.5 ms, step(2) = 3 ms
    run = simulate_chains([Chain((n,)) for n in (100, 100, 50)], 1, 2, m)
    # Two run 100 tokens at 3 ms (0.3 s, 200 tokens); the third starts then and runs alone at 2.5 ms.
    assert (run.last_start_s, run.tokens_at_last_start) == (pytest.approx(0.3), pytest.approx(200))
    assert run.wall_s == pytest.approx(0.3 + 50 * 0.0025) == simulate_wall([100, 100, 50], 1, 2, m)


def test_simulate_wall_full_batches_then_a_drain_at_low_batch_speed() -> None:
    m = DecodeModel(step_base_s=0.002, step_per_req_s=0.0005)  # step(B) = 2 ms + 0.5 ms * B
    assert m.tokens_per_s(4) == pytest.approx(4 / 0.004)
    # One full batch of equal lengths: 100 steps at B=4.
    assert simulate_wall([100] * 4, 1, 4, m) == pytest.approx(100 * 0.004)
    # Two servers take eight requests in the same time.
    assert simulate_wall([100] * 8, 2, 4, m) == pytest.approx(100 * 0.004)
    # Drain: 50 tokens at B=2, then the longer one alone for 50 more at single-request speed.
    assert simulate_wall([100, 50], 1, 2, m) == pytest.approx(50 * 0.003 + 50 * 0.0025)
    # A freed slot takes the next request: 10 steps at B=2 (both), then 10 at B=2 (the 20 and the refill 10).
    assert simulate_wall([10, 20, 10], 1, 2, m) == pytest.approx(20 * 0.003)
    assert simulate_wall([], 2, 4, m) == 0.0
    assert simulate_wall([0, 0], 1, 1, m) == 0.0


def test_long_first_order_shortens_the_tail() -> None:
    m = DecodeModel(step_base_s=0.002, step_per_req_s=0.0005)
    items = [(float(n), n) for n in [1000] + [100] * 19]  # (predicted, actual)
    long_first = simulate_wall(dispatch_order(items, "long_first"), 1, 4, m)
    fifo_last = simulate_wall([100] * 19 + [1000], 1, 4, m)  # the long one dispatched last runs alone at the end
    assert dispatch_order(items, "long_first")[0] == 1000
    assert long_first < fifo_last
    # Long-first: the 1000 runs from t=0 at B=4 while 19 x 100 pass through the other 3 slots (~633 steps), then
    # the 1000 finishes alone; total = 1000 tokens of it, bounded below by the work at full batch.
    assert long_first >= 1000 * m.step_s(1)
    assert sorted(dispatch_order(items, "source", seed=1)) == sorted(n for _, n in items)
    with pytest.raises(ValueError):
        dispatch_order(items, "random")


def test_expand_population_keeps_the_total_and_the_sample_mix() -> None:
    samples = [
        (LengthSample(source="s", category=c, prompt_chars=10, output_tokens=n), float(n))
        for c, n in (("a", 100), ("b", 200), ("c", 300))
    ]
    out = expand_population(samples, 10)
    assert len(out) == 10
    assert sorted({n for _, n in out}) == [100, 200, 300]
    assert max(sum(1 for _, n in out if n == k) for k in (100, 200, 300)) == 4
    assert expand_population(samples, 0) == [] and expand_population([], 5) == []


def test_fit_decode_model_recovers_the_step_line_from_finish_time_counters() -> None:
    """Real SGLang's generation_tokens_total grows only when a request finishes; the fit must not depend on it."""
    base, per_req, slots = 0.002, 0.0005, 8
    readings: list[ServerReading] = []
    t, finished_tokens = 0.0, 0.0
    # Saturated for 10 intervals, then a drain through batches 6, 4, 2, 1 (three readings each), 0.25 s apart.
    # The counter moves in lumps (a whole output when a request ends, here every third interval) and not at all
    # in between; gen_throughput is the server's decode-step rate at the batch.
    for i, batch in enumerate([slots] * 11 + [6, 6, 6, 4, 4, 4, 2, 2, 2, 1, 1, 1]):
        if i % 3 == 0:
            finished_tokens += 600.0
        t += 0.25
        readings.append(ServerReading(t, "s0", batch, 0, finished_tokens, batch / (base + per_req * batch)))
    fitted = fit_decode_model(readings, slots)
    assert fitted is not None
    model, saturated, details = fitted
    assert saturated == pytest.approx(slots / (base + per_req * slots))
    assert model.step_base_s == pytest.approx(base)
    assert model.step_per_req_s == pytest.approx(per_req)
    assert details["single_request_tokens_per_s"] == pytest.approx(1 / (base + per_req), rel=1e-3)
    assert fit_decode_model([], slots) is None


def test_probe_measures_decode_speed_on_a_server_that_counts_tokens_at_finish() -> None:
    """A stand-in with a known step time (its /metrics counters move only when requests finish, as SGLang's):
    the probe's saturated rate is the configured B / step_s(B), not the lumpy finish-time counter."""
    step_ms, slots = 40.0, 8
    env = {
        "DATAGEN_STANDIN_LOAD_S": "0",
        "DATAGEN_STANDIN_STEP_BASE_MS": str(step_ms),
        "DATAGEN_STANDIN_TOKENS_PER_STEP": "4",
        "DATAGEN_STANDIN_LENGTH_MEAN": "150",
        "DATAGEN_STANDIN_LENGTH_MAX": "300",
    }
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    sampling = sampling_params_for(SamplingSpec(max_new_tokens=1024))
    args = ["--max-running-requests", str(slots), "--enable-metrics", "--skip-server-warmup"]
    with run_standin(chat.model_dir, args=args, env=env) as ep, Dispatcher([ep], stall_timeout_s=300.0) as d:
        assert d.wait_ready(60)
        with ThroughputProbe(d, [ep], interval_s=0.25) as probe:
            prompts = [chat.prompt_ids([{"role": "user", "content": f"Item {i}: explain."}], True) for i in range(40)]
            futures = [d.submit(GenerateJob(ids, sampling, label=str(i))) for i, ids in enumerate(prompts)]
            results = [f.result(timeout=600) for f in futures]
        measured = probe.measure()
    assert all(r.completion_tokens > 0 for r in results)
    assert measured["counters"] == "metrics" and measured["method"].startswith("saturated")
    ideal = slots / (step_ms / 1000.0)  # 200 tok/s: every running request advances one token per step
    # The stand-in's clock catches up after a starved moment, never runs ahead: allow a loaded machine's lag.
    assert 0.6 * ideal <= measured["aggregate_tokens_per_s"] <= 1.05 * ideal, measured


def _checkpoint_line(source: str, row: int, prompt_tokens: int, completion_tokens: int) -> str:
    """One completion row as the shard checkpoint holds it (every field a Completion writes)."""
    record = {
        "prompt_id": f"{source}-{row}",
        "source": source,
        "row": row,
        "messages": [{"role": "user", "content": "q" * (10 + row)}],
        "request_key": f"key-{source}-{row}",
        "prompt_tokens": prompt_tokens,
        "output_ids": [1] * completion_tokens,
        "text": "",
        "finish_reason": "stop",
        "completion_tokens": completion_tokens,
        "server": "gpu0",
        "latency_s": 1.0,
        "category": source,
        "meta": {},
        "location": None,
    }
    return json.dumps(record) + "\n"


def _hand_case(tmp_path: Path) -> tuple[RunLayout, ShardPlan, PilotPopulation, ValidationSummary]:
    """Source a: 100 prompts, sampled 5 (4 completed with 10/20/30/40 tokens, prompts of 5; 1 rejected while
    generating). Source b: 50 prompts, sampled 2 (100/200 tokens, prompts of 10); validation rejects 1."""
    layout = RunLayout(tmp_path)
    layout.shard_completions(0).parent.mkdir(parents=True, exist_ok=True)
    rows = [("a", i, 5, n) for i, n in enumerate((10, 20, 30, 40))] + [("b", 0, 10, 100), ("b", 1, 10, 200)]
    layout.shard_completions(0).write_text("".join(_checkpoint_line(*r) for r in rows))
    reject = Reject(stage="generate", reason="server_rejected", detail="400", source="a", row=9)
    layout.shard_rejects(0).write_text(reject.to_json() + "\n")
    plan = ShardPlan(
        shard_size=7, shard_ids=[0], shards=[ShardEntry(shard_id=0, n_prompts=7, sha256="0" * 64)], n_rows=7,
        n_prompts=7, n_load_rejects=0, prompts_by_source={"a": 5, "b": 2}, load_rejects_by_source={},
        load_rejects_by_reason={}, prompts_by_category={"a": 5, "b": 2}, n_uncategorized=0,
        load_rejects_sha256="0" * 64, plan_sha256="0" * 64,
    )  # fmt: skip
    population = PilotPopulation(
        population_by_source={"a": 100, "b": 50}, sample_by_source={"a": 5, "b": 2}, selection=SelectionReport()
    )
    return layout, plan, population, ValidationSummary(rejected_by_source={"b": 1})


def test_projection_of_a_hand_computed_case_at_the_pilots_whole_run_rate(tmp_path: Path) -> None:
    layout, plan, population, summary = _hand_case(tmp_path)
    p = project(
        layout,
        plan,
        population,
        summary,
        {"aggregate_tokens_per_s": 100.0, "servers": 2},
        4,
        PilotSpec(),
        turns=LastTurn(),
    )
    # a: 100 tokens over 5 sampled = 20 per prompt -> 2,000; accept 4/5; rows of 5+25 tokens on average = 30.
    # b: 300 tokens over 2 = 150 per prompt -> 7,500; accept 1/2 (validation); rows of 10+150 = 160.
    out, pr = p.output_tokens, p.projection
    assert out["by_source"]["a"]["projected_tokens"] == 2000 and out["by_source"]["b"]["projected_tokens"] == 7500
    assert out["by_source"]["a"]["reject_rate"] == 0.2 and out["by_source"]["b"]["reject_rate"] == 0.5
    assert out["projected_total"] == 9500 and out["pilot_total"] == 400
    assert out["mean_per_prompt_projected"] == 63.3  # 9,500 / 150
    assert pr["reject_rate"] == 0.3  # (0.2 x 100 + 0.5 x 50) / 150
    assert pr["rows"] == 105  # 0.8 x 100 + 0.5 x 50
    assert pr["dataset_tokens"] == 6400  # 80 x 30 + 25 x 160
    assert pr["dataset_bytes_uncompressed"] == 6400 * 5
    # 100 tok/s over 2 servers = 50 per server; 4 servers: 9,500 / 200 = 47.5 s; reusing the pilot 9,100 / 200.
    assert p.throughput["per_server_tokens_per_s"] == 50.0
    assert (pr["wall_s"], pr["wall_s_source"], pr["wall_s_reusing_pilot"]) == (47.5, 47.5, 45.5)
    assert pr["wall_s_saturated_bound"] == 47.5 and pr["tail_s"] == 0.0
    assert pr["gpu_hours"] == pytest.approx(47.5 / 3600 * 4)


def test_projection_of_a_hand_computed_case_with_the_decode_model(tmp_path: Path) -> None:
    layout, plan, population, summary = _hand_case(tmp_path)
    # One server, one slot, 10 ms per token at any batch: the wall is every token of the set one after another.
    throughput = {
        "aggregate_tokens_per_s": 100.0, "servers": 1, "step_base_s": 0.01, "step_per_req_s": 0.0,
        "slots_per_server": 1, "ramp_s": 2.0,
    }  # fmt: skip
    p = project(layout, plan, population, summary, throughput, 1, PilotSpec(), turns=LastTurn())
    pr = p.projection
    # Completing prompts of the full set: a 100 x 4/5 = 80 (each sample 20 times: 2,000 tokens), b 50 (7,500).
    assert pr["wall_s"] == pytest.approx(2.0 + 95.0) and pr["wall_s_source"] == pytest.approx(2.0 + 95.0)
    # Not sampled yet: a 95 x 4/5 = 76 (19 each: 1,900 tokens), b 48 (24 each: 7,200) -> 91 s.
    assert pr["wall_s_reusing_pilot"] == pytest.approx(2.0 + 91.0)
    assert pr["wall_s_saturated_bound"] == 95.0 and pr["tail_s"] == pytest.approx(2.0)
    assert pr["method"].startswith("simulated")
