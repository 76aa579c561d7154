"""The memory plan: its choices (pure logic), the launcher's argv, the environment report, and the stand-in's
capacity for the plan's flags vs SGLang's defaults over HTTP (real processes).

That the sizing is SGLang 0.5.23's own is tested in tests/conformance/test_memory_plan_conformance.py.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from datagen.checks.tuning import ServerArgsError
from datagen.engine.launcher import launch_flags
from datagen.engine.memory_plan import (
    NUMERICS_FLAGS,
    GpuMemory,
    ModelShape,
    PrefixReuse,
    PromptTokens,
    choose_prefix_reuse,
    decode_roofline,
    expected_context,
    plan_memory,
)
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import RunSpec
from datagen.settings import Settings
from datagen.standin.testing import run_standin
from tasks import environment

CONFIG_27B = Path(__file__).parents[1] / "fixtures" / "qwen3.6-27b-config.json"
GPU_BYTES = 97_887 * 2**20  # one RTX PRO 6000 as the driver reports it (97,887 MiB)
WEIGHTS = 54_714_000_000  # Qwen3.6-27B BF16 (estimate, see the conformance test)
GPU = GpuMemory(GPU_BYTES, GPU_BYTES, WEIGHTS, bandwidth_bytes_per_s=1.792e12)
STANDIN_GPU = {"DATAGEN_STANDIN_GPU_MEMORY_BYTES": str(GPU_BYTES), "DATAGEN_STANDIN_WEIGHTS_BYTES": str(WEIGHTS)}


@pytest.fixture(scope="module")
def model() -> ModelShape:
    return ModelShape.from_config(json.loads(CONFIG_27B.read_text(encoding="utf-8")))


def test_config_numbers_give_the_27b_state_and_kv_sizes(model: ModelShape) -> None:
    """48 GDN layers x (conv 10240x3 BF16 + SSM 48x128x128 FP32); 16 attention layers x 4 heads x 256 x K,V BF16."""
    assert (model.linear_layers, model.full_attention_layers) == (48, 16)
    assert model.state_bytes_per_slot == 48 * (10240 * 3 * 2 + 48 * 128 * 128 * 4) == 153_944_064
    assert model.kv_bytes_per_token == 16 * 4 * 256 * 2 * 2 == 65_536
    # The fixture model directory carries the same text numbers (SGLang refuses it without them).
    fixture = ModelShape.from_model_dir(ensure_model_dir())
    assert fixture.state_bytes_per_slot == model.state_bytes_per_slot
    assert fixture.kv_bytes_per_token == model.kv_bytes_per_token


@pytest.mark.parametrize("context", [2048, 4096, 8192, 16384])
def test_single_turn_plan_turns_the_radix_cache_off_and_beats_the_defaults(model: ModelShape, context: int) -> None:
    plan = plan_memory(model, GPU, context, context_source="test")
    assert "--disable-radix-cache" in plan.plan_args
    assert plan.planned.concurrency == max(c.concurrency for c in plan.candidates)
    assert plan.planned.concurrency > plan.default.concurrency
    assert plan.launched is not None and plan.launched.concurrency(context) == plan.planned.concurrency
    # The KV pool holds the planned requests at this context, and one more state slot would not fit one more.
    assert plan.launched.max_total_num_tokens >= plan.planned.concurrency * context
    assert not any(a in NUMERICS_FLAGS for a in plan.plan_args)
    assert plan.lineage()["running_requests_per_gpu"] == plan.planned.concurrency


def test_explicit_server_args_win_and_numerics_are_recorded_not_chosen(model: ModelShape) -> None:
    args = ["--max-running-requests", "40", "--mamba-ssm-dtype", "bfloat16", "--kv-cache-dtype=fp8_e4m3"]
    plan = plan_memory(model, GPU, 4096, context_source="test", server_args=args)
    assert "--max-running-requests" not in plan.plan_args
    assert plan.overridden == ["--max-running-requests"]
    assert plan.numerics == ["--mamba-ssm-dtype", "bfloat16", "--kv-cache-dtype=fp8_e4m3"]
    assert plan.launched is not None and plan.launched.max_running_requests == 40
    summary = plan.summary()
    assert "server_args win for --max-running-requests" in summary
    assert "--mamba-ssm-dtype bfloat16" in summary
    # The BF16 SSM state halves the slot: the defaults' count with it is what the plan compares against.
    plain = plan_memory(model, GPU, 4096, context_source="test")
    assert plan.default.concurrency > plain.default.concurrency


def test_prefix_reuse_weighs_re_prefill_against_fewer_running_requests(model: ModelShape) -> None:
    cheap_history = PrefixReuse(
        history_tokens=200,
        new_tokens=500,
        output_tokens=2000,
        prefill_tokens_per_s=8000,
        decode_steps_per_s=20,
        cached_share=1.0,
    )
    long_history = PrefixReuse(
        history_tokens=60_000,
        new_tokens=500,
        output_tokens=500,
        prefill_tokens_per_s=4000,
        decode_steps_per_s=20,
        cached_share=1.0,
    )
    keep, why = choose_prefix_reuse(cheap_history, with_radix=14, without_radix=50)
    assert not keep and "200 history tokens" in why
    keep, _ = choose_prefix_reuse(long_history, with_radix=14, without_radix=50)
    assert keep
    # Wired into the plan: a radix-on candidate with balanced pools, chosen only when re-prefill costs more.
    plan = plan_memory(model, GPU, 4096, context_source="test", prefix_reuse=long_history)
    assert plan.chosen == "radix-balanced" and "--disable-radix-cache" not in plan.plan_args
    assert plan.planned.concurrency > plan.default.concurrency  # balanced pools beat the 0.9 split
    plan = plan_memory(model, GPU, 4096, context_source="test", prefix_reuse=cheap_history)
    assert plan.chosen == "no-radix-balanced"


def test_roofline_grows_with_the_batch_and_context_defaults(model: ModelShape) -> None:
    one, many = decode_roofline(model, GPU, 1, 4096), decode_roofline(model, GPU, 51, 4096)
    assert one is not None and many is not None and 30 < one < many < 51 * one
    assert decode_roofline(model, GpuMemory(GPU_BYTES, GPU_BYTES, WEIGHTS), 8, 4096) is None
    assert expected_context(300, 1700.4, 8192) == (2001, "prompt + pilot-measured output")
    assert expected_context(300, None, 8192)[0] == 300 + 4096


def test_launcher_puts_plan_flags_before_the_spec_s_own(tmp_path: Path) -> None:
    settings = Settings(engine="standin", work_dir=tmp_path, allowed_compute_capabilities=["12.0"])
    spec = RunSpec(model_path=str(ensure_model_dir()), server_args=["--max-running-requests", "40"])
    key = tmp_path / "key.yaml"  # command lines only name the key file
    argv = launch_flags(
        settings, spec, 30000, key, plan_args=["--disable-radix-cache", "--mem-fraction-static", "0.786"]
    )
    assert argv[-5:] == ["--disable-radix-cache", "--mem-fraction-static", "0.786", "--max-running-requests", "40"]
    assert launch_flags(settings, spec, 30000, key)[-2:] == ["--max-running-requests", "40"]
    # The plan's flags pass the same tuning allow-list as the spec's: a plan naming a managed flag starts nothing.
    with pytest.raises(ServerArgsError, match="--host"):
        launch_flags(settings, spec, 30000, key, plan_args=["--host", "0.0.0.0"])


def test_environment_report_prints_the_plan(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings(engine="standin", work_dir=tmp_path)
    spec = RunSpec(model_path=str(ensure_model_dir()))
    monkeypatch.delenv("DATAGEN_STANDIN_GPU_MEMORY_BYTES", raising=False)
    rows = {r.name: r for r in environment.run_checks(settings, spec)}
    assert rows[environment.MEMORY_PLAN_CHECK].status == "skipped"
    for k, v in STANDIN_GPU.items():
        monkeypatch.setenv(k, v)
    row = {r.name: r for r in environment.run_checks(settings, spec)}[environment.MEMORY_PLAN_CHECK]
    assert row.status == "pass"
    # max_new_tokens 8192 and no pilot: 512 + 4096 tokens of context; defaults 15 (conformance tier's figure).
    assert "at 4,608 tokens of context" in row.detail and "SGLang defaults: 15" in row.detail
    assert "--disable-radix-cache" in row.detail
    assert environment.MEMORY_PLAN_CHECK in environment.format_report([row])
    plan, _ = environment.memory_plan_for(settings, spec, mean_output_tokens=1500.0)
    assert plan is not None and plan.context_tokens == 2012 and plan.context_source.endswith("pilot-measured output")


def _peak_running(url: str, n_requests: int, cap: int) -> int:
    """Send `n_requests` long generations at once; the most /v1/loads ever shows running together."""
    headers = {"Authorization": "Bearer test-key"}
    body = {"text": "Tell me a long story.", "sampling_params": {"max_new_tokens": 4000, "temperature": 0}}
    peak = 0
    with httpx.Client(base_url=url, headers=headers, timeout=300) as client, ThreadPoolExecutor(n_requests) as pool:
        futures = [pool.submit(client.post, "/generate", json={**body, "rid": f"r{i}"}) for i in range(n_requests)]
        deadline = time.monotonic() + 120  # generous: a loaded box admits slowly; the check is not timed
        while time.monotonic() < deadline and peak < min(cap, n_requests):
            loads = client.get("/v1/loads").json()["loads"][0]
            peak = max(peak, int(loads["num_running_reqs"]))
            time.sleep(0.05)
        client.post("/abort_request", json={"abort_all": True})
        for f in futures:
            f.exception()  # aborted generations end with an error status: fine here
    return peak


def test_standin_runs_more_requests_with_the_plan_than_with_defaults(model: ModelShape, tmp_path: Path) -> None:
    """The stand-in sizes its cap with SGLang's sizing for its flags; the plan's flags run more at once."""
    plan = plan_memory(model, GPU, 4096, context_source="test")
    env = {
        **STANDIN_GPU,
        "DATAGEN_STANDIN_LOAD_S": "0",
        "DATAGEN_STANDIN_WARMUP_S": "0",
        "DATAGEN_STANDIN_STEP_BASE_MS": "20",  # requests stay running for seconds
        "DATAGEN_STANDIN_LENGTH_MEAN": "3000",
        "DATAGEN_STANDIN_LENGTH_SIGMA": "0",
        "DATAGEN_STANDIN_LENGTH_MAX": "4000",
    }
    caps, peaks = {}, {}
    for name, args in (("defaults", []), ("plan", plan.plan_args)):
        log = tmp_path / f"{name}.log"
        with run_standin(ensure_model_dir(), args=["--skip-server-warmup", *args], env=env, log_path=log) as ep:
            caps[name] = ep.max_running_requests
            peaks[name] = _peak_running(ep.url, plan.planned.concurrency + 5, ep.max_running_requests)
        text = log.read_text(encoding="utf-8")
        assert "Mamba Cache is allocated. max_mamba_cache_size:" in text
    assert caps == {"defaults": plan.default.sizing.max_running_requests, "plan": plan.planned.concurrency}
    assert "max_running_requests is capped to 15 by the mamba state cache" in (tmp_path / "defaults.log").read_text()
    assert peaks["defaults"] == caps["defaults"] < peaks["plan"] == caps["plan"]


def test_pilot_report_shows_the_plan_and_its_roofline_beside_the_measurement(model: ModelShape) -> None:
    from tasks.pilot import _engine_rows, engine_section

    before = plan_memory(model, GPU, 4608, context_source="prompt + max_new_tokens/2 (no pilot yet)")
    after = plan_memory(model, GPU, 2012, context_source="prompt + pilot-measured output")
    rows = "\n".join(_engine_rows(engine_section(before, after, "")))
    assert f"({before.planned.concurrency} running per GPU)" in rows
    assert f"main run's plan at 2,012 tokens of context | {' '.join(after.plan_args)}" in rows
    assert f"SGLang defaults: {after.default.concurrency}" in rows
    assert after.roofline_tokens_per_s is not None and f"{after.roofline_tokens_per_s:,.0f} |" in rows
    assert _engine_rows(engine_section(None, None, "no GPU probe")) == ["| memory plan | no GPU probe |"]


def test_real_box_configuration_plans_from_the_probe_and_the_checkpoint(tmp_path: Path) -> None:
    """8x RTX PRO 6000 as the GPU probe reports them, the checkpoint's own size: the check row datagen prints."""
    probe = json.loads((Path(__file__).parents[1] / "fixtures" / "gpu_probe_8x_sm120.json").read_text(encoding="utf-8"))
    model_dir = tmp_path / "Qwen3.6-27B"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(CONFIG_27B.read_text(encoding="utf-8"), encoding="utf-8")
    index = {"metadata": {"total_size": WEIGHTS}, "weight_map": {}}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps(index), encoding="utf-8")
    settings = Settings(engine="sglang", engine_python="/opt/sglang/.venv/bin/python", work_dir=tmp_path)
    spec = RunSpec(model_path=str(model_dir), sampling={"max_new_tokens": 4096})
    plan, line = environment.memory_plan_for(settings, spec, probe)
    assert plan is not None and plan.context_tokens == 512 + 2048
    smallest_free = min(d["free_memory_bytes"] for d in probe["devices"])
    expected = plan_memory(
        ModelShape.from_config(json.loads(CONFIG_27B.read_text(encoding="utf-8"))),
        GpuMemory(probe["devices"][0]["total_memory_bytes"], smallest_free, WEIGHTS, 1.792e12),
        2560,
        context_source="x",
    )
    assert plan.plan_args == expected.plan_args and plan.planned.concurrency == expected.planned.concurrency
    assert line.startswith(f"{plan.planned.concurrency} running requests per GPU at 2,560 tokens of context")
    assert plan.roofline_tokens_per_s is not None  # the card's bandwidth is known by its name
    no_weights = RunSpec(model_path=str(ensure_model_dir()))
    assert environment.memory_plan_for(settings, no_weights, probe)[1].endswith("no safetensors weights to size")


def test_speculative_or_malformed_server_args_never_crash_the_check(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    for k, v in STANDIN_GPU.items():
        monkeypatch.setenv(k, v)
    settings = Settings(engine="standin", work_dir=tmp_path)
    spec = RunSpec(model_path=str(ensure_model_dir()), server_args=["--speculative-algorithm", "NEXTN"])
    plan, why = environment.memory_plan_for(settings, spec)
    assert plan is None and why.startswith("speculative decoding chosen in server_args")
    bad = RunSpec(model_path=str(ensure_model_dir()), server_args=["--max-running-requests", "many"])
    row = {r.name: r for r in environment.run_checks(settings, bad)}[environment.MEMORY_PLAN_CHECK]
    assert row.status == "fail" and "--max-running-requests: invalid int value: 'many'" in row.detail


def test_planning_measures_prompt_tokens_from_its_render_and_the_plan_sizes_for_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's context is the rendered prompts' mean (not an assumed 512) + the output; the longest prompt
    + max_new_tokens must fit a candidate's KV pool alone."""
    from datagen.chat import ChatTokenizer
    from datagen.layout import RunLayout
    from datagen.runspec import PromptSource
    from tasks import planning

    path = tmp_path / "prompts.jsonl"
    texts = [f"Summarize text {i}. {'word ' * (40 * (i % 5 + 1))}" for i in range(30)]
    path.write_text("\n".join(json.dumps({"messages": [{"role": "user", "content": t}]}) for t in texts) + "\n")
    spec = RunSpec(
        sources=[PromptSource(path=str(path))],
        model_path=str(ensure_model_dir()),
        shard_size=7,
        sampling={"max_new_tokens": 2048},
    )
    layout = RunLayout.for_run(tmp_path / "work", "measure")
    plan = planning.plan_shards(spec, layout)
    measured = planning.prompt_tokens(plan, layout, spec)
    chat = ChatTokenizer.shared(spec.model_path)
    expected = sorted(
        len(chat.prompt_ids([{"role": "user", "content": t}], spec.sampling.enable_thinking)) for t in texts
    )
    assert measured is not None and measured.n == 30 and measured.max == expected[-1]
    assert measured.mean == pytest.approx(sum(expected) / 30) and measured.p99 == expected[-1]
    by_python = PromptTokens.measured(expected, measured.source)  # the same definitions, in Arrow and in Python
    assert (by_python.n, by_python.p99, by_python.max) == (measured.n, measured.p99, measured.max)
    assert PromptTokens.measured(list(range(1, 201)), "x").p99 == 199  # index ceil(0.99 x 199) = 198 holds 199
    assert "5 of 5 shards" in measured.source
    assert planning.conversation_turns(plan, layout) == 1.0

    for k, v in STANDIN_GPU.items():
        monkeypatch.setenv(k, v)
    settings = Settings(engine="standin", work_dir=tmp_path)
    memory, line = environment.memory_plan_for(settings, spec, None, None, measured)
    assert memory is not None
    assert memory.context_tokens == math.ceil(measured.mean + 1024)
    assert memory.context_source.startswith(f"prompt mean {measured.mean:,.0f} / p99 {measured.p99:,} / max")
    assert "measured at planning" in line
    unmeasured, _ = environment.memory_plan_for(settings, spec)
    assert unmeasured is not None and unmeasured.context_tokens == 512 + 1024
    assert "assumed: the prompts are not rendered yet" in unmeasured.context_source


def test_a_candidate_whose_kv_pool_cannot_hold_the_longest_request_is_not_chosen(model: ModelShape) -> None:
    free = plan_memory(model, GPU, 2048, context_source="test")
    planned_kv = free.planned.sizing.max_total_num_tokens
    plan = plan_memory(model, GPU, 2048, context_source="test", longest_request_tokens=planned_kv + 1)
    assert plan.chosen != free.chosen and plan.planned.sizing.max_total_num_tokens > planned_kv
    assert any(f"KV pool too small for the longest request ({planned_kv + 1:,}" in r for r in plan.reasons)
    huge = plan_memory(model, GPU, 2048, context_source="test", longest_request_tokens=10**7)
    assert huge.chosen == max(huge.candidates, key=lambda c: c.sizing.max_total_num_tokens).name
    assert any("no candidate's KV pool holds the longest request" in r for r in huge.reasons)


def test_turns_every_weighs_the_radix_cache_and_turns_last_drops_it(model: ModelShape) -> None:
    long_history = plan_memory(
        model, GPU, 16384, context_source="test", turns="every", turns_per_conversation=8, output_tokens=300
    )
    assert long_history.chosen == "radix-balanced" and "--disable-radix-cache" not in long_history.plan_args
    assert "--max-mamba-cache-size" in long_history.plan_args  # pools balanced at 5 slots per running request
    why = next(r for r in long_history.reasons if r.startswith("turns extend a prefix"))
    assert "8 turns per conversation; 5 state slots per request with the radix cache, 1 without); keep" in why
    short = plan_memory(model, GPU, 4096, context_source="test", turns="every", turns_per_conversation=2)
    assert short.chosen == "no-radix-balanced" and "drop the radix cache" in " ".join(short.reasons)
    last = plan_memory(model, GPU, 16384, context_source="test", turns="last", turns_per_conversation=8)
    assert last.chosen == "no-radix-balanced"
    assert any(r.startswith("single-turn requests (turns: last)") for r in last.reasons)
    one = plan_memory(model, GPU, 16384, context_source="test", turns="every", turns_per_conversation=1)
    assert any(r.startswith("single-turn requests (one turn per conversation)") for r in one.reasons)
    unknown_card = GpuMemory(GPU_BYTES, GPU_BYTES, WEIGHTS)  # no bandwidth, no FLOPs: no estimate
    blind = plan_memory(
        model, unknown_card, 16384, context_source="test", turns="every", turns_per_conversation=8, output_tokens=300
    )
    assert blind.chosen == "no-radix-balanced" and any(
        "no estimate of the multi-turn trade" in r for r in blind.reasons
    )


def test_the_radix_choice_and_its_reason_are_in_the_lineage_and_the_pilot_report(model: ModelShape) -> None:
    from tasks.pilot import _engine_rows, engine_section

    measured = "measured by pilot p1: 40 conversations, 4 user turns each and 2 steps per user turn"
    kept = plan_memory(
        model,
        GPU,
        16384,
        context_source="test",
        turns="every",
        turns_per_conversation=8,
        turns_source=measured,
        output_tokens=300,
    )
    radix = kept.lineage()["radix_cache"]
    assert radix["kept"] is True and radix["turns_per_conversation"] == 8 and radix["turns_source"] == measured
    assert radix["why"].startswith(f"turns extend a prefix (8 turns per conversation ({measured}); 5 state slots")
    assert "keep the radix cache" in radix["why"]
    assert kept.inputs["turns_source"] == measured  # a recalibrated plan says the same
    rows = "\n".join(_engine_rows(engine_section(None, kept, "")))
    assert f"| radix cache for the main run (prefix reuse vs state slots) | kept: {radix['why']} |" in rows
    short = plan_memory(model, GPU, 4096, context_source="test", turns="every", turns_per_conversation=2)
    assert short.radix_cache["kept"] is False and "drop the radix cache" in short.radix_cache["why"]
    last = plan_memory(model, GPU, 4096, context_source="test", turns="last")
    assert last.radix_cache["kept"] is False and last.radix_cache["why"].startswith("single-turn requests")
