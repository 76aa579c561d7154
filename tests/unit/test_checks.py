"""Environment checks over recorded GPU probes, real model directories, real `--help` output and real processes."""

from __future__ import annotations

import copy
import json
import struct
import sys
from pathlib import Path
from typing import Any

import pytest

from datagen.checks import CheckResult
from datagen.checks.gpu import (
    GpuProbeError,
    arch_for,
    check_arch_list,
    check_gpus_free,
    check_sglang_version,
    gpu_checks,
    parse_version,
    run_probe,
)
from datagen.checks.model_dir import (
    check_architecture,
    check_chat_template,
    check_free_ram,
    check_free_space,
    check_processor,
    check_tmpfs,
    check_weights,
    filesystem_of,
    mem_available_bytes,
    model_dir_checks,
    safetensors_expected_size,
)
from datagen.checks.server_flags import (
    check_attention_backend,
    run_flag_probe,
    server_flag_checks,
)
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import RunSpec
from datagen.settings import Settings
from tasks.environment import format_report, report_rows, run_checks

FIXTURES = Path(__file__).parents[1] / "fixtures"
DEFAULT_ALLOWED = Settings().allowed_compute_capabilities


def probe(name: str) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((FIXTURES / f"gpu_probe_{name}.json").read_text())
    return data


def by_name(results: list[CheckResult]) -> dict[str, CheckResult]:
    return {r.name: r for r in results}


# --- GPU checks over recorded probes -----------------------------------------------------------


def test_recorded_h200_fails_the_default_sm120_requirement_with_clear_reasons() -> None:
    assert DEFAULT_ALLOWED == ["12.0"]
    r = by_name(gpu_checks(probe("h200"), expected_devices=8, allowed=DEFAULT_ALLOWED))
    assert r["gpu.count"].status == "fail"
    assert "1 GPU(s) visible < 8" in r["gpu.count"].detail
    assert r["gpu.compute_capability"].status == "fail"
    assert "GPU 0: NVIDIA H200 is 9.0" in r["gpu.compute_capability"].detail
    assert "allowed: 12.0" in r["gpu.compute_capability"].detail
    assert r["engine.sglang_version"].status == "fail"
    assert "pip install 'sglang>=0.5.10'" in r["engine.sglang_version"].detail
    # The H200's torch (2.11 cu130) does carry sm_120 and sm_90 kernels, and the GPU is idle.
    assert r["gpu.torch_arch"].status == "pass"
    assert "sm_120" in r["gpu.torch_arch"].detail
    assert r["gpu.free"].status == "pass"
    assert r["engine.flashinfer"].status == "skipped"


def test_recorded_h200_passes_hardware_checks_when_hopper_is_allowed() -> None:
    r = by_name(gpu_checks(probe("h200"), expected_devices=1, allowed=["9.0"]))
    assert [r[n].status for n in ("gpu.count", "gpu.compute_capability", "gpu.torch_arch", "gpu.free")] == ["pass"] * 4
    assert r["engine.sglang_version"].status == "fail"  # still not installed there


def test_synthetic_8x_sm120_box_passes_every_check() -> None:
    results = gpu_checks(probe("8x_sm120"), expected_devices=8, allowed=DEFAULT_ALLOWED)
    assert {r.name: r.status for r in results} == {
        "gpu.count": "pass",
        "gpu.compute_capability": "pass",
        "gpu.torch_arch": "pass",
        "gpu.free": "pass",
        "engine.sglang_version": "pass",
        "engine.flashinfer": "pass",
    }


@pytest.mark.parametrize("name", ["h200_busy", "h200_busy_smi"])
def test_recorded_busy_gpu_fails_naming_pid_and_command_line(name: str) -> None:
    p = probe(name)
    assert p["process_source"] == ("pynvml" if name == "h200_busy" else "nvidia-smi")
    result = check_gpus_free(p)
    assert result.status == "fail"
    assert "GPU 0: 40.6 GB held by PID 440 (python3 /tmp/train.py --gib 40)" in result.detail


def test_memory_held_by_an_invisible_process_is_busy_too() -> None:
    p = copy.deepcopy(probe("8x_sm120"))
    p["devices"][3]["used_memory_bytes"] = 30 * 1024**3
    result = check_gpus_free(p)
    assert result.status == "fail"
    assert "GPU 3: 30.0 GB in use by processes not visible here" in result.detail


def test_unlisted_processes_cannot_pass_as_free() -> None:
    p = copy.deepcopy(probe("8x_sm120"))
    p["process_source"] = None
    assert check_gpus_free(p).status == "fail"


def test_torch_without_sm120_fails_naming_the_arch() -> None:
    p = copy.deepcopy(probe("8x_sm120"))
    p["torch"]["arch_list"] = ["sm_80", "sm_90"]
    result = check_arch_list(p, DEFAULT_ALLOWED)
    assert result.status == "fail"
    assert "lacks sm_120" in result.detail


@pytest.mark.parametrize(("version", "status"), [("0.5.9", "fail"), ("0.5.10", "pass"), ("0.5.23.post1", "pass")])
def test_sglang_version_floor(version: str, status: str) -> None:
    p = copy.deepcopy(probe("8x_sm120"))
    p["packages"]["sglang"] = version
    assert check_sglang_version(p).status == status


def test_version_and_arch_parsing() -> None:
    assert parse_version("0.5.10.post1") == (0, 5, 10)
    assert parse_version("0.5.9") < parse_version("0.5.10")
    assert arch_for("12.0") == "sm_120"
    assert arch_for("9.0") == "sm_90"
    with pytest.raises(ValueError, match="not a version"):
        parse_version("dev")


def test_probe_script_runs_for_real_under_an_interpreter_without_torch() -> None:
    doc = run_probe(sys.executable)
    assert doc["probe_version"] == 1
    assert doc["executable"] == sys.executable
    assert "sglang" in doc["packages"]
    if doc["torch"] is None:  # this environment (CI, laptops): the checks must say so, not pass
        result = check_arch_list(doc, DEFAULT_ALLOWED)
        assert result.status == "fail"
        assert "torch is not importable" in result.detail


def test_probe_under_a_missing_interpreter_is_an_actionable_error() -> None:
    with pytest.raises(GpuProbeError, match="DATAGEN_ENGINE_PYTHON"):
        run_probe("/nonexistent/python3")


# --- model directory ---------------------------------------------------------------------------------


def write_safetensors(path: Path, tensors: dict[str, int]) -> int:
    """Write a real safetensors file of uint8 tensors (name -> byte count); returns its size."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, n in tensors.items():
        header[name] = {"dtype": "U8", "shape": [n], "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(range(256)) * (offset // 256) + b"\x07" * (offset % 256))
    return 8 + len(raw) + offset


def make_model_dir(root: Path) -> Path:
    d = root / "Qwen3.6-tiny"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"architectures": ["Qwen3_5ForConditionalGeneration"]}))
    (d / "tokenizer.json").write_text(json.dumps({"version": "1.0", "model": {"type": "BPE"}}))
    (d / "chat_template.jinja").write_text("{{ messages }}")
    (d / "preprocessor_config.json").write_text(json.dumps({"processor_class": "Qwen3VLProcessor"}))
    write_safetensors(d / "model-00001-of-00002.safetensors", {"a.weight": 1000, "b.weight": 300})
    write_safetensors(d / "model-00002-of-00002.safetensors", {"c.weight": 4096})
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00001-of-00002.safetensors",
        "c.weight": "model-00002-of-00002.safetensors",
    }
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return d


def test_safetensors_expected_size_reads_the_header(tmp_path: Path) -> None:
    size = write_safetensors(tmp_path / "x.safetensors", {"w": 10, "v": 7})
    assert safetensors_expected_size(tmp_path / "x.safetensors") == size == (tmp_path / "x.safetensors").stat().st_size


def test_complete_model_dir_passes(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path)
    r = by_name(model_dir_checks(d, require_tmpfs=False))
    assert r["model_dir.exists"].status == "pass"
    assert r["model_dir.architecture"].status == "pass"
    assert r["model_dir.weights"].status == "pass"
    assert "2 weight file(s)" in r["model_dir.weights"].detail
    assert r["model_dir.tokenizer"].status == "pass"
    assert r["model_dir.chat_template"].status == "pass"
    assert r["model_dir.processor"].status == "pass"
    assert r["model_dir.tmpfs"].status == "skipped"


def test_vision_processor_configs_are_required(tmp_path: Path) -> None:
    """SGLang loads Qwen3.6's vision processor at startup; the lookup mirrors transformers' own."""
    d = make_model_dir(tmp_path)
    assert "video processor from preprocessor_config.json" in check_processor(d).detail  # the fallback
    (d / "preprocessor_config.json").unlink()
    missing = check_processor(d)
    assert missing.status == "fail"
    assert "image or video processor config" in missing.detail
    (d / "video_preprocessor_config.json").write_text("{}")
    assert "no readable image processor config" in check_processor(d).detail
    (d / "processor_config.json").write_text(json.dumps({"image_processor": {}, "video_processor": {}}))
    assert check_processor(d).status == "pass"
    (d / "processor_config.json").write_text("not json")
    assert check_processor(d).status == "fail"


def test_missing_shard_fails_naming_it(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path)
    (d / "model-00002-of-00002.safetensors").unlink()
    result = check_weights(d)
    assert result.status == "fail"
    assert "model-00002-of-00002.safetensors missing" in result.detail


def test_truncated_shard_fails_naming_it(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path)
    shard = d / "model-00001-of-00002.safetensors"
    full = shard.stat().st_size
    with shard.open("r+b") as f:
        f.truncate(full - 100)  # an interrupted copy
    result = check_weights(d)
    assert result.status == "fail"
    assert f"model-00001-of-00002.safetensors truncated: {full - 100} of {full} bytes" in result.detail


def test_garbage_weight_file_and_missing_weights_fail(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path)
    (d / "model-00002-of-00002.safetensors").write_bytes(b"\xff" * 64)
    assert "implausible" in check_weights(d).detail
    (d / "model.safetensors.index.json").unlink()
    result = check_weights(d)
    assert result.status == "fail"
    assert "weights are not staged" in result.detail


def test_wrong_architecture_and_missing_template_fail(tmp_path: Path) -> None:
    d = make_model_dir(tmp_path)
    (d / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert check_architecture(d).status == "fail"
    (d / "chat_template.jinja").unlink()
    assert check_chat_template(d).status == "fail"
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages }}"}))
    assert check_chat_template(d).status == "pass"


def test_missing_model_dir_fails_once_and_skips_the_rest(tmp_path: Path) -> None:
    results = model_dir_checks(tmp_path / "nope", require_tmpfs=True)
    assert [r.status for r in results] == ["fail", *["skipped"] * 6]


def test_filesystem_of_uses_the_longest_mount_prefix() -> None:
    mounts = (
        "/dev/vda / ext4 rw 0 0\n"
        "devtmpfs /dev devtmpfs rw 0 0\n"
        "tmpfs /dev/shm tmpfs rw 0 0\n"
        "/dev/vdb /mnt/my\\040disk xfs rw 0 0\n"
    )
    assert filesystem_of(Path("/dev/shm/Qwen3.6-27B"), mounts) == ("/dev/shm", "tmpfs")
    assert filesystem_of(Path("/dev/shmother"), mounts) == ("/dev", "devtmpfs")
    assert filesystem_of(Path("/mnt/my disk/m"), mounts) == ("/mnt/my disk", "xfs")
    assert filesystem_of(Path("/work/x"), mounts) == ("/", "ext4")
    assert check_tmpfs(Path("/work/x"), True, mounts).status == "fail"
    assert check_tmpfs(Path("/dev/shm/Qwen3.6-27B"), True, mounts).status == "pass"


def test_model_dir_on_disk_fails_the_tmpfs_requirement(tmp_path: Path) -> None:
    if filesystem_of(tmp_path)[1] == "tmpfs":
        pytest.skip(f"{tmp_path} is on tmpfs on this machine")
    d = make_model_dir(tmp_path)
    result = check_tmpfs(d, required=True)
    assert result.status == "fail"
    assert "not tmpfs" in result.detail


def test_model_dir_in_dev_shm_passes_the_tmpfs_requirement(tmp_path: Path) -> None:
    shm = Path("/dev/shm")
    if not shm.is_dir() or filesystem_of(shm)[1] != "tmpfs":
        pytest.skip("/dev/shm is not tmpfs on this machine")
    import tempfile

    with tempfile.TemporaryDirectory(dir=shm) as td:
        d = make_model_dir(Path(td))
        r = by_name(model_dir_checks(d, require_tmpfs=True))
        assert r["model_dir.tmpfs"].status == "pass"
        assert r["model_dir.weights"].status == "pass"


def test_free_space_and_ram_thresholds(tmp_path: Path) -> None:
    assert check_free_space("host.work_dir_free", tmp_path / "not" / "yet", 1, "staging").status == "pass"
    assert check_free_space("host.work_dir_free", tmp_path, 2**60, "staging").status == "fail"
    meminfo = "MemTotal: 100 kB\nMemAvailable:   2048 kB\n"
    assert mem_available_bytes(meminfo) == 2048 * 1024
    assert check_free_ram(1024, meminfo).status == "pass"
    assert check_free_ram(10 * 1024**2, meminfo).status == "fail"
    assert check_free_ram(1).status == "pass"  # the real /proc/meminfo


# --- launch flags ------------------------------------------------------------------------------------


def test_only_the_hybrid_gdn_allow_list_passes_on_sm120() -> None:
    args = ["--attention-backend", "fa3"]
    assert check_attention_backend(args, ["12.0"]).status == "fail"
    assert check_attention_backend(args, ["9.0"]).status == "pass"
    assert check_attention_backend(["--decode-attention-backend=fa4"], ["12.0"]).status == "fail"
    torch_native = check_attention_backend(["--prefill-attention-backend", "torch_native"], ["12.0"])
    assert torch_native.status == "fail"  # not fa3/fa4, and still refused by SGLang on SM120
    assert "flashinfer, triton, trtllm_mha" in torch_native.detail
    assert check_attention_backend(["--attention-backend", "triton"], ["12.0"]).status == "pass"


def test_flags_and_settings_judged_by_the_standin_s_own_code(tmp_path: Path) -> None:
    """Names, values and settings resolution: what the stand-in's parser and resolution say, not --help text."""
    settings = Settings(engine="standin", work_dir=tmp_path)
    spec = RunSpec(model_path=str(ensure_model_dir()), context_length=32768, server_args=["--disable-radix-cache"])
    r = by_name(server_flag_checks(settings, spec))
    assert r["engine.server_flags"].status == "pass", r["engine.server_flags"].detail
    assert r["engine.settings"].status == "pass", r["engine.settings"].detail
    assert r["engine.attention_backend"].status == "pass"
    old = spec.model_copy(update={"server_args": ["--mamba-scheduler-strategy", "no_buffer"]})
    r = by_name(server_flag_checks(settings, old))
    assert r["engine.server_flags"].status == "fail"
    assert "'--mamba-scheduler-strategy' is not on the allow-list" in r["engine.server_flags"].detail
    assert r["engine.settings"].status == "skipped"
    bad_value = spec.model_copy(update={"server_args": ["--mamba-radix-cache-strategy", "sometimes"]})
    detail = by_name(server_flag_checks(settings, bad_value))["engine.server_flags"].detail
    assert "invalid choice: 'sometimes'" in detail  # a value, not only a name, is checked
    no_buffer = spec.model_copy(update={"server_args": ["--mamba-radix-cache-strategy", "no_buffer"]})
    refused = by_name(server_flag_checks(settings, no_buffer))["engine.settings"]  # needs no overlap schedule
    assert refused.status == "fail"
    assert "no_buffer" in refused.detail
    # A flag the run may not set never reaches the engine (datagen/checks/tuning.py).
    lmo = by_name(server_flag_checks(settings, spec.model_copy(update={"server_args": ["--language-model-only"]})))
    assert lmo["engine.server_flags"].status == "fail"
    assert "--language-model-only is managed by the pipeline" in lmo["engine.server_flags"].detail
    assert lmo["engine.settings"].status == "skipped"
    missing = spec.model_copy(update={"model_path": str(tmp_path / "absent")})
    assert by_name(server_flag_checks(settings, missing))["engine.settings"].status == "skipped"


def test_missing_sglang_is_reported_by_the_flag_check(tmp_path: Path) -> None:
    settings = Settings(engine="sglang", engine_python=sys.executable, work_dir=tmp_path)
    report = run_flag_probe(settings, ["--model-path", "m"], resolve=False)
    assert isinstance(report, str)
    assert "No module named 'sglang'" in report
    assert "DATAGEN_ENGINE_PYTHON" in report
    absent = Settings(engine="sglang", engine_python=str(tmp_path / "no-python"), work_dir=tmp_path)
    r = by_name(server_flag_checks(absent, RunSpec(model_path=str(tmp_path))))
    assert r["engine.server_flags"].status == "fail"
    assert "set DATAGEN_ENGINE_PYTHON" in r["engine.server_flags"].detail


# --- the whole report ------------------------------------------------------------------------------


def test_run_checks_with_the_standin_passes_and_reports_skips(tmp_path: Path) -> None:
    settings = Settings(engine="standin", skip_gpu_checks=True, require_tmpfs_model=False, work_dir=tmp_path)
    spec = RunSpec(model_path=str(ensure_model_dir()), context_length=32768)
    s3 = CheckResult("s3.namespace_free", "pass", "expansion_v1/ is empty")
    results = run_checks(settings, spec, s3_check=lambda: [s3])
    r = by_name(results)
    assert not [x for x in results if x.failed], format_report(results)
    assert r["gpu.count"].status == "skipped"
    assert "DATAGEN_SKIP_GPU_CHECKS" in r["gpu.count"].detail
    assert r["model_dir.weights"].status == "skipped"
    assert r["engine.server_flags"].status == "pass"
    assert r["s3.namespace_free"] == s3


def test_run_checks_on_this_box_with_sglang_fails_loudly(tmp_path: Path) -> None:
    settings = Settings(engine="sglang", engine_python=sys.executable, work_dir=tmp_path, require_tmpfs_model=True)
    spec = RunSpec(model_path=str(tmp_path / "missing-model"))

    def broken_s3() -> list[CheckResult]:
        raise ConnectionError("endpoint unreachable")

    results = run_checks(settings, spec, s3_check=broken_s3)
    r = by_name(results)
    assert r["model_dir.exists"].status == "fail"
    assert r["engine.server_flags"].status == "fail"
    assert r["s3"].status == "fail"
    assert "ConnectionError: endpoint unreachable" in r["s3"].detail
    gpu_failed = [x for x in results if x.name.startswith(("gpu.", "engine.sglang")) and x.failed]
    assert gpu_failed  # no torch / no GPU / no sglang here: never a silent pass


def test_format_report_is_one_line_per_check_and_rows_match() -> None:
    results = [
        CheckResult("gpu.count", "pass", "8 GPU(s) visible"),
        CheckResult("gpu.free", "fail", "GPU 3: 40.0 GB held by PID 32244 (python train.py)\nsecond line"),
        CheckResult("s3", "skipped", "no S3 check supplied"),
    ]
    text = format_report(results)
    lines = text.splitlines()
    assert len(lines) == 1 + len(results) + 1
    assert lines[0].split() == ["STATUS", "CHECK", "DETAIL"]
    assert lines[2].startswith("FAIL") and "PID 32244 (python train.py) | second line" in lines[2]
    assert lines[-1] == "checks: 1 pass, 1 fail, 1 skipped"
    assert report_rows(results)[1] == {"check": "gpu.free", "status": "fail", "detail": results[1].detail}
