"""The fraction against the stand-in's memory outside the pools, and the pilot's worst-case burst (issue 45).

The stand-in emulates an RTX PRO 6000 whose engine needs CUDA graphs and a prefill activation peak outside its
pools (DATAGEN_STANDIN_ACTIVATION_BYTES, _PREFILL_GRAPH_BYTES, _DECODE_GRAPH_BYTES_PER_BATCH): the memory plan with
the headroom measured for that engine
starts and holds a burst of long prompts filling its batch; a headroom that leaves the activations out gives a
higher fraction whose server dies of CUDA's out-of-memory error in the burst, as SGLang's scheduler does; a fraction
whose graphs do not fit fails at start. Real stand-in processes, real HTTP (`plan_trial.burst`).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datagen.engine import plan_trial
from datagen.engine.headroom import Headroom
from datagen.engine.memory_plan import GpuMemory, ModelShape, plan_memory
from datagen.local.model_fixture import ensure_model_dir
from datagen.standin.testing import StandinStartError, run_standin

_GIB = 1 << 30
GPU_BYTES = 97_887 * 2**20
WEIGHTS = 54_714_000_000
GPU = GpuMemory(GPU_BYTES, GPU_BYTES, WEIGHTS, bandwidth_bytes_per_s=1.792e12)
CHUNK = 8192
ENGINE = Headroom("emulated", 2.89 * _GIB / CHUNK, 2.9 * 2**20, 2.5 * _GIB / CHUNK, _GIB, "the stand-in's knobs")
KNOBS = {
    "DATAGEN_STANDIN_GPU_MEMORY_BYTES": str(GPU_BYTES),
    "DATAGEN_STANDIN_WEIGHTS_BYTES": str(WEIGHTS),
    "DATAGEN_STANDIN_ACTIVATION_BYTES": str(round(ENGINE.activation_bytes_per_token * CHUNK)),
    "DATAGEN_STANDIN_PREFILL_GRAPH_BYTES": str(round(ENGINE.prefill_graph_bytes_per_token * CHUNK)),
    "DATAGEN_STANDIN_DECODE_GRAPH_BYTES_PER_BATCH": str(round(ENGINE.decode_graph_bytes_per_batch)),
    "DATAGEN_STANDIN_LENGTH_MEAN": "20",
    "DATAGEN_STANDIN_LENGTH_MAX": "40",
}
SAMPLING = {"max_new_tokens": 64, "temperature": 0.6, "top_p": 0.95, "top_k": 20}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_model_dir()


@pytest.fixture(scope="module")
def model(model_dir: Path) -> ModelShape:
    return ModelShape.from_config(json.loads((model_dir / "config.json").read_text(encoding="utf-8")))


def _burst(plan_args: list[str], running: int, model_dir: Path, log: Path) -> dict[str, object]:
    arm = plan_trial.Arm("arm", plan_args, [0], running)
    with run_standin(model_dir, args=plan_args, env=KNOBS, log_path=log) as endpoint:
        held = plan_trial.burst(
            [arm], [endpoint], prompt_tokens=7000, sampling=SAMPLING, token_range=(1000, 200_000), timeout_s=120
        )
    return held["arm"]


def test_the_plan_with_the_engines_headroom_holds_the_worst_case(
    model: ModelShape, model_dir: Path, tmp_path: Path
) -> None:
    plan = plan_memory(model, GPU, 712, context_source="test", headroom=ENGINE)
    today = plan_memory(model, GPU, 712, context_source="test")
    assert plan.fraction["value"] > today.fraction["value"] and plan.planned.concurrency > today.planned.concurrency
    result = _burst(plan.plan_args, plan.planned.concurrency, model_dir, tmp_path / "server.log")
    assert result["held"], result
    log = (tmp_path / "server.log").read_text()
    assert "Memory pool end." in log and "out of memory" not in log


def test_a_headroom_without_the_activations_dies_in_the_burst(
    model: ModelShape, model_dir: Path, tmp_path: Path
) -> None:
    blind = Headroom("emulated", ENGINE.prefill_graph_bytes_per_token, ENGINE.decode_graph_bytes_per_batch, 0.0, 0, "x")
    plan = plan_memory(model, GPU, 712, context_source="test", headroom=blind)
    assert plan.fraction["value"] > plan_memory(model, GPU, 712, context_source="t", headroom=ENGINE).fraction["value"]
    result = _burst(plan.plan_args, plan.planned.concurrency, model_dir, tmp_path / "server.log")
    assert not result["held"]
    (server,) = result["servers"]  # type: ignore[misc]
    assert not server["healthy_after"] and server["answered"] < server["requests"]
    assert "did not hold a burst of prompts of 7,000 tokens" in str(result["why"])
    assert "torch.OutOfMemoryError: CUDA out of memory" in (tmp_path / "server.log").read_text()


def test_graphs_that_do_not_fit_fail_the_start(model_dir: Path, tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    args = ["--disable-radix-cache", "--max-running-requests", "8", "--mem-fraction-static", "0.99"]
    with pytest.raises(StandinStartError), run_standin(model_dir, args=args, env=KNOBS, log_path=log, timeout_s=60):
        pass
    assert "capturing prefill CUDA graphs" in log.read_text()
