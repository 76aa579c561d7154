"""A small pilot run on stand-in servers: its projection, and a main run that reuses its completions (real S3)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest
from prefect.testing.utilities import prefect_test_harness

from datagen.layout import RunLayout
from datagen.localstack import LocalS3
from datagen.model_fixture import ensure_model_dir
from datagen.records import Prompt
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from flows.expand_dataset import expand_dataset
from flows.pilot import pilot_flow
from tasks.pilot import PILOT_JSON, PILOT_MARKDOWN, PilotSpec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def prefect_api() -> Iterator[None]:
    with prefect_test_harness(server_startup_timeout=120):
        yield


@pytest.fixture
def pipeline_env(monkeypatch: pytest.MonkeyPatch, local_s3: LocalS3, tmp_path: Path) -> dict[str, str]:
    env = {
        **local_s3.env(),
        "DATAGEN_S3_PREFIX": f"pilot-{tmp_path.name}/",
        "DATAGEN_ENGINE": "standin",
        "DATAGEN_NUM_SERVERS": "2",
        "DATAGEN_BASE_PORT": "0",
        "DATAGEN_SKIP_GPU_CHECKS": "true",
        "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
        "DATAGEN_WORK_DIR": str(tmp_path / "work"),
        "DATAGEN_SERVER_START_TIMEOUT_S": "120",
        "DATAGEN_STANDIN_LENGTH_MEAN": "120",
        "DATAGEN_STANDIN_LENGTH_MAX": "400",
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _lines(paths: list[Path]) -> set[bytes]:
    return {line for p in paths if p.exists() for line in p.read_bytes().splitlines() if line.strip()}


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
