"""The memory plan against the real allocator (issue 37): SGLang's logged memory in, the same pools out.

A real SGLang 0.5.17 on a lent H100 80 GB (2026-12-05, shared/reference/real-sglang-on-lent-h200.md) had 1.17 GiB
less before the weights than the plan assumed, so the plan's own flags left it a 2,700-token KV pool where the
plan predicted 26,279. Here: the pools a server logs are parsed (`LoggedPools`), the plan recalibrated from them
predicts what the engine allocates for other flags (`calibrated_gpu`), and the launcher checks every launched
server's logged pools against the plan, relaunching once with the recalibrated plan (stand-in processes over
HTTP, with the stand-in taking the 0.5.17 reservation that the plan does not know of).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from datagen.engine.launcher import PoolShortError, ServerFleet
from datagen.engine.memory_plan import (
    EngineFlags,
    GpuMemory,
    LoggedPools,
    ModelShape,
    calibrated_gpu,
    for_engine,
    plan_memory,
    pool_shortfall,
    sglang_sizing,
)
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.settings import Settings
from tasks import environment
from tests.e2e.test_generation import FAST, SPEC

GIB = 1 << 30
H100_BYTES = 81_559 * 2**20  # NVIDIA H100 80GB HBM3 as nvidia-smi reports it
PROBE_FREE = round(78.66 * GIB)  # the probe's free memory on that card
WEIGHTS = 54_714_000_000
KEY = SecretStr("test-key-pools")

# What SGLang 0.5.17 logged on the lent H100 at 32K context (reference file above; the line formats are
# model_runner.py's "Load weight begin/end", engine.py's server_args, memory_pool.py's "Mamba Cache is allocated"
# and scheduler.py's summary line).
DEFAULTS_LOG = """\
[2026-12-05 10:01:02] server_args=ServerArgs(model_path='/tmp/sgl/model', mem_fraction_static=0.767555, \
max_running_requests=None, disable_radix_cache=False)
[2026-12-05 10:01:30 TP0] Load weight begin. avail mem=76.99 GB
[2026-12-05 10:01:31 TP0] Load weight end. elapsed=0.80 s, type=Qwen3_5ForConditionalGeneration, \
avail mem=25.74 GB, mem usage=51.25 GB.
[2026-12-05 10:01:31 TP0] Mamba Cache is allocated. max_mamba_cache_size: 24, conv_state size: 0.07GB, \
ssm_state size: 3.52GB
[2026-12-05 10:01:31 TP0] KV Cache is allocated. #tokens: 69173, K size: 2.11 GB, V size: 2.11 GB
[2026-12-05 10:02:40 TP0] max_total_num_tokens=69173, chunked_prefill_size=8192, max_prefill_tokens=16384, \
max_running_requests=4, context_len=32768, available_gpu_mem=14.89 GB
"""
PLAN_FLAGS = ["--disable-radix-cache", "--max-running-requests", "52", "--mem-fraction-static", "0.767"]
PLAN_LOGGED_SLOTS, PLAN_LOGGED_TOKENS = 52, 2_700  # what the plan's flags got on the same card


@pytest.fixture(scope="module")
def model() -> ModelShape:
    return ModelShape.from_model_dir(ensure_model_dir())


def kv_rounding_bound(model: ModelShape, logged: LoggedPools) -> int:
    """KV tokens the log's two-decimal GiB figures leave open: the memory before the weights, times the slack share."""
    return int(LoggedPools.ROUNDING_BYTES * (1 - logged.mem_fraction_static) // model.kv_bytes_per_token) + 1


def test_the_pools_are_read_from_the_engine_log() -> None:
    logged = LoggedPools.parse(DEFAULTS_LOG)
    assert logged is not None
    assert logged.pre_model_load_bytes == round(76.99 * GIB)
    assert logged.post_model_load_bytes == round(25.74 * GIB)
    assert logged.mem_fraction_static == 0.767555
    assert (logged.max_mamba_cache_size, logged.max_total_num_tokens, logged.max_running_requests) == (24, 69_173, 4)
    # A restarted server appends to the same log: the last start's figures count.
    again = LoggedPools.parse(DEFAULTS_LOG + DEFAULTS_LOG.replace("69173", "70000"))
    assert again is not None and again.max_total_num_tokens == 70_000
    # Until the scheduler's summary line is written there are no pools to check.
    assert LoggedPools.parse(DEFAULTS_LOG.rsplit("[", 1)[0]) is None


def test_the_plan_recalibrated_from_one_launch_predicts_what_sglang_gave_another(model: ModelShape) -> None:
    logged = LoggedPools.parse(DEFAULTS_LOG)
    assert logged is not None
    probed = GpuMemory(H100_BYTES, PROBE_FREE, WEIGHTS, 3.35e12)
    gpu = calibrated_gpu(model, for_engine(probed, "0.5.17"), EngineFlags(), logged)
    bound = kv_rounding_bound(model, logged)
    # The launch it was calibrated from: the same pools.
    again = sglang_sizing(model, gpu, EngineFlags())
    assert (again.max_mamba_cache_size, again.max_running_requests) == (24, 4)
    assert abs(again.max_total_num_tokens - 69_173) <= bound
    # Another launch on the same card (the plan's flags): predicted from the calibration, as SGLang allocated it.
    planned = sglang_sizing(model, gpu, EngineFlags.from_args(PLAN_FLAGS))
    assert planned.max_mamba_cache_size == PLAN_LOGGED_SLOTS
    assert abs(planned.max_total_num_tokens - PLAN_LOGGED_TOKENS) <= bound
    # What the plan predicted before, from the probe (free - 512 MiB, the 0.5.23 reservations): several times the pool.
    before = sglang_sizing(model, probed, EngineFlags.from_args(PLAN_FLAGS))
    assert before.max_total_num_tokens > 5 * PLAN_LOGGED_TOKENS
    logged_plan = replace(
        logged, max_total_num_tokens=PLAN_LOGGED_TOKENS, max_mamba_cache_size=52, max_running_requests=52
    )
    assert pool_shortfall(before, logged_plan) is not None
    assert pool_shortfall(planned, logged_plan) is None


def test_a_recalibrated_plan_never_chooses_flags_whose_kv_pool_is_below_its_prediction(model: ModelShape) -> None:
    logged = LoggedPools.parse(DEFAULTS_LOG)
    assert logged is not None
    probed = GpuMemory(H100_BYTES, PROBE_FREE, WEIGHTS, 3.35e12)
    for context in (456, 4_096, 32_768):
        plan = plan_memory(model, probed, context, context_source="test")
        new = plan.recalibrated(logged, [])
        assert new.gpu is not None and new.launched is not None
        # The engine's allocation for the chosen flags, from the engine's memory: what the plan predicts.
        real = sglang_sizing(model, new.gpu, EngineFlags.from_args(new.plan_args))
        assert real.max_total_num_tokens >= new.launched.max_total_num_tokens
        assert real.max_running_requests >= new.launched.max_running_requests
        # And the requests it counts on fit in that KV pool.
        assert new.launched.concurrency(context) * context <= real.max_total_num_tokens
        assert any("recalibrated from the engine's log" in r for r in new.reasons)


# --- the launcher's pool check against stand-in servers (real processes over HTTP) ---------------------------


def settings_for(tmp_path: Path) -> Settings:
    return Settings(
        engine="standin",
        num_servers=2,
        base_port=0,
        server_start_timeout_s=120,
        work_dir=tmp_path / "work",
        sglang_api_key=KEY,
    )


@pytest.fixture
def reserving_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    """Stand-ins on an emulated H100 that take 0.5.17's 1 GiB multimodal pool before measuring free memory."""
    for name, value in FAST.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DATAGEN_STANDIN_GPU_ARCH", raising=False)
    monkeypatch.setenv("DATAGEN_STANDIN_GPU_MEMORY_BYTES", str(H100_BYTES))
    monkeypatch.setenv("DATAGEN_STANDIN_WEIGHTS_BYTES", str(WEIGHTS))
    monkeypatch.setenv("DATAGEN_STANDIN_ENGINE_RESERVED_BYTES", str(GIB))


def server_info(fleet: ServerFleet, name: str) -> dict[str, object]:
    endpoint = fleet.endpoint(name)
    resp = httpx.get(endpoint.url + "/server_info", headers={"Authorization": f"Bearer {KEY.get_secret_value()}"})
    resp.raise_for_status()
    info = resp.json()
    assert isinstance(info, dict)
    return info


@pytest.mark.usefixtures("reserving_standin")
def test_a_server_short_of_the_plan_is_relaunched_with_the_plan_recalibrated_from_its_log(tmp_path: Path) -> None:
    settings = settings_for(tmp_path)
    spec = SPEC.model_copy(update={"model_path": str(ensure_model_dir()), "context_length": 32_768})
    plan, _ = environment.memory_plan_for(settings, spec)
    assert plan is not None and plan.launched is not None
    layout = RunLayout.for_run(settings.work_dir, "pools")
    with ServerFleet(settings, spec, layout, KEY, memory_plan=plan) as fleet:
        new = fleet.memory_plan
        assert new is not None and new is not plan and new.launched is not None
        assert fleet.plan_args == new.plan_args != plan.plan_args
        for i, name in enumerate(("gpu0", "gpu1")):
            log = (layout.logs_dir / f"server-{i}.log").read_text()
            assert "relaunching (recalibrated memory plan)" in log
            info = server_info(fleet, name)
            # The relaunched server's pools: at least what the recalibrated plan predicted, as the log says.
            logged = LoggedPools.parse(log)
            assert logged is not None
            assert logged.max_total_num_tokens == info["max_total_num_tokens"]
            assert logged.max_total_num_tokens >= new.launched.max_total_num_tokens * 0.98
            assert logged.max_running_requests >= new.launched.max_running_requests
            assert pool_shortfall(plan.launched, logged) is not None  # the first plan was short on this engine


@pytest.mark.usefixtures("reserving_standin")
def test_a_server_still_short_after_recalibration_fails_with_the_numbers(tmp_path: Path) -> None:
    settings = settings_for(tmp_path).model_copy(update={"num_servers": 1})
    spec = SPEC.model_copy(update={"model_path": str(ensure_model_dir()), "context_length": 32_768})
    plan, _ = environment.memory_plan_for(settings, spec)
    assert plan is not None
    layout = RunLayout.for_run(settings.work_dir, "pools-short")
    # A plan that cannot be recalibrated (it does not record its model) stands for a second shortfall.
    fleet = ServerFleet(settings, spec, layout, KEY, memory_plan=replace(plan, model=None))
    with pytest.raises(PoolShortError) as caught:
        fleet.start()
    message = str(caught.value)
    assert "memory pools short of the plan" in message
    assert "KV pool" in message and "where the plan predicted" in message
    assert fleet.pids() == {}  # nothing left running


def test_the_plan_takes_what_the_probed_engine_reserves(tmp_path: Path, model: ModelShape) -> None:
    """The probe names SGLang 0.5.17: the plan sizes with its 1 GiB multimodal pool and its VLM cache outside."""
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": WEIGHTS}}))
    settings = Settings(engine="sglang", work_dir=tmp_path / "work")
    device = {"name": "NVIDIA H100 80GB HBM3", "total_memory_bytes": H100_BYTES, "free_memory_bytes": PROBE_FREE}
    for version, reserved in (("0.5.17", GIB), ("0.5.23", 0), ("0.5.20", 0)):
        probe = {"devices": [device], "packages": {"sglang": version}}
        gpu = environment._planned_gpu(settings, probe, model_dir)
        assert isinstance(gpu, GpuMemory)
        assert gpu.engine_reserved_bytes == reserved
        assert gpu.vlm_cache_in_pools is (version != "0.5.17")
        assert gpu.pre_model_load_bytes == PROBE_FREE - 512 * 2**20 - reserved


def test_the_fixture_config_has_what_a_real_0_5_17_needs() -> None:
    """Without rope_parameters SGLang 0.5.17 fails at model build (KeyError 'rope_theta'); without a dtype it runs
    float16 and the GDN conv kernel fails to compile (both seen on the lent H100)."""
    config = json.loads((ensure_model_dir() / "config.json").read_text(encoding="utf-8"))
    text = config["text_config"]
    assert text["rope_parameters"]["rope_theta"] == 10_000_000
    assert text["rope_parameters"]["partial_rotary_factor"] == 0.25
    assert text["dtype"] == text["torch_dtype"] == config["torch_dtype"] == "bfloat16"


REAL = Path(__file__).parents[2] / "benchmarks" / "results" / "real-engine-h100-80gb-hbm3"


def test_the_real_engines_logs_calibrate_the_plan_to_the_pools_it_allocated(model: ModelShape) -> None:
    """The logs SGLang 0.5.17 wrote on a lent H100 (2026-12-06): calibrated from the defaults' log, the plan predicts
    the pools of the server started with the plan's flags, as that server's log gives them."""
    defaults = LoggedPools.parse((REAL / "defaults.log").read_text(encoding="utf-8"))
    planned = LoggedPools.parse((REAL / "plan-456.log").read_text(encoding="utf-8"))
    assert defaults is not None and planned is not None
    assert (defaults.max_mamba_cache_size, defaults.max_total_num_tokens, defaults.max_running_requests) == (
        23,
        65_092,
        4,
    )
    probed = GpuMemory(85_017_493_504, 84_465_090_560, WEIGHTS, 3.35e12)  # torch's total and free there
    gpu = calibrated_gpu(model, for_engine(probed, "0.5.17"), EngineFlags(), defaults)
    flags = ["--disable-radix-cache", "--max-running-requests", "41", "--mem-fraction-static", "0.766"]
    predicted = sglang_sizing(model, gpu, EngineFlags.from_args(flags))
    assert predicted.max_mamba_cache_size == planned.max_mamba_cache_size == 41
    assert predicted.max_running_requests == planned.max_running_requests == 41
    assert abs(predicted.max_total_num_tokens - planned.max_total_num_tokens) <= kv_rounding_bound(model, defaults)
    assert pool_shortfall(predicted, planned) is None
    # The probe alone (as for 0.5.23) would have promised more than the engine gave at its defaults.
    assert pool_shortfall(sglang_sizing(model, probed, EngineFlags()), defaults) is not None
