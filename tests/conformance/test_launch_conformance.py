"""The launcher's exact argv for a real box (8 GPUs, SM120), judged by SGLang 0.5.23's own parser and
settings resolution, against the fixture's config.json; and `datagen check` running that same real code.

Resolution runs in full (`ServerArgs.resolve_once`, as `sglang.launch_server` calls it) with the stubbed
`torch.cuda` reporting one RTX PRO 6000 (SM 12.0, 97,887 MiB), which is what each server sees.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import SecretStr

from datagen.checks.model_dir import check_processor
from datagen.checks.server_flags import SM120_HYBRID_GDN_BACKENDS, server_flag_checks
from datagen.engine.launcher import ServerFleet, ephemeral_low, write_key_config
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import RunSpec
from datagen.settings import Settings
from datagen.standin import cli
from tests.conformance.conftest import REPO_ROOT, RealSglang

DOC = REPO_ROOT / "docs" / "real-engine.md"
BOX_SERVERS = 8
BOX_KEY = "k3y-in-clear-here"


def documented_server_args() -> dict[str, list[str]]:
    """The run-spec `server_args` examples of docs/real-engine.md (its `server-args-examples` block)."""
    match = re.search(r"```yaml server-args-examples\n(.*?)```", DOC.read_text(encoding="utf-8"), re.S)
    assert match, f"{DOC} lost its server-args-examples block"
    examples = yaml.safe_load(match.group(1))
    assert isinstance(examples, dict) and examples
    return {str(k): [str(a) for a in v] for k, v in examples.items()}


def box_argvs(tmp_path: Path, server_args: list[str]) -> list[list[str]]:
    """The flags of every server a fleet on an 8-GPU SM120 box would start (after `python -m sglang...`)."""
    settings = Settings(
        engine="sglang",
        engine_python="/opt/sglang-venv/bin/python",
        num_servers=BOX_SERVERS,
        base_port=30000,
        allowed_compute_capabilities=["12.0"],
        work_dir=tmp_path,
    )
    spec = RunSpec(model_path=str(ensure_model_dir()), server_args=server_args)
    fleet = ServerFleet(settings, spec, RunLayout(tmp_path / "run"), SecretStr(BOX_KEY))
    write_key_config(fleet._key_config, SecretStr(BOX_KEY))  # what start() writes before launching
    argvs = [server.argv for server in fleet._servers]  # planned, not started
    assert not any(BOX_KEY in a for argv in argvs for a in argv)  # the key reaches servers through the file
    assert all(argv[1:3] == ["-m", "sglang.launch_server"] for argv in argvs)
    return [argv[3:] for argv in argvs]


_RESOLVE = r"""
import ast, re
from pathlib import Path
import sglang.srt.layers.attention.attention_registry as registry
from sglang.srt.arg_groups.overrides import resolving_view
from sglang.srt.server_args import ServerArgs, prepare_server_args

# The SM120 allow-list for hybrid-GDN models, read from the real source (an assert in the model runner).
source = Path(registry.__file__).read_text()
allowed = ast.literal_eval(re.search(r"if get_platform\(\)\.is_sm120:\s*allowed = (\{[^}]*\})", source).group(1))
out = {"sm120_allowed": sorted(allowed), "lmo_archs": list(ServerArgs.LANGUAGE_MODEL_ONLY_ARCHITECTURES), "runs": []}
for argv in ARGS_LIST:
    record = prepare_server_args(argv)
    try:
        record.resolve_once()
    except Exception as exc:
        out["runs"].append({"ok": False, "error": f"{type(exc).__name__}: {exc}"})
        continue
    d = record.resolved_dict()
    view = resolving_view(record)
    keys = ("reasoning_parser", "language_model_only", "nccl_port", "port", "context_length", "attention_backend",
            "prefill_attention_backend", "decode_attention_backend", "served_model_name", "tp_size", "api_key", "host")
    out["runs"].append({"ok": True, **{k: d.get(k) for k in keys}})
RESULT = out
"""


def resolve_real(real_sglang: RealSglang, argvs: list[list[str]]) -> dict[str, Any]:
    """Parse and fully resolve each argv with the real code on an emulated SM120 GPU."""
    code = f"ARGS_LIST = {json.dumps(argvs)}\n{_RESOLVE}"
    result: dict[str, Any] = real_sglang.run(code, gpu="sm120", timeout_s=600)
    return result


def test_every_documented_box_argv_resolves_with_real_sglang(real_sglang: RealSglang, tmp_path: Path) -> None:
    """8 servers x every documented server_args example: parsed and resolved by 0.5.23, as launched."""
    examples = documented_server_args()
    plan = {name: box_argvs(tmp_path / name, args) for name, args in examples.items()}
    flat = [argv for argvs in plan.values() for argv in argvs]
    result = resolve_real(real_sglang, flat)
    assert set(result["sm120_allowed"]) == SM120_HYBRID_GDN_BACKENDS  # our check uses the real allow-list
    assert "Qwen3_5ForConditionalGeneration" not in result["lmo_archs"]
    runs = iter(result["runs"])
    for name, argvs in plan.items():
        resolved = [next(runs) for _ in argvs]
        failed = [(i, r["error"]) for i, r in enumerate(resolved) if not r["ok"]]
        assert not failed, f"real SGLang refuses example {name!r}: {failed}"
        for i, r in enumerate(resolved):
            assert r["port"] == 30000 + i
            assert r["tp_size"] == 1
            assert r["api_key"] == BOX_KEY  # read from the --config file by the real merger
            assert r["host"] == "127.0.0.1"
            assert r["reasoning_parser"] == "qwen3"
            assert r["language_model_only"] is False
            assert r["served_model_name"] == "qwen3.6-27b"
            assert r["context_length"] == 262144
            backends = {r["prefill_attention_backend"] or r["attention_backend"]}
            backends.add(r["decode_attention_backend"] or r["attention_backend"])
            assert backends <= SM120_HYBRID_GDN_BACKENDS, (name, backends)
        nccl = [r["nccl_port"] for r in resolved]
        assert len(set(nccl)) == BOX_SERVERS  # servers started together never share one
        assert all(20000 <= p < ephemeral_low() for p in nccl)
        assert not set(nccl) & set(range(30000, 30000 + BOX_SERVERS))


# Argvs whose resolution the stand-in must judge as the real code does (accept, or refuse with its message).
VARIANTS: dict[str, list[str]] = {
    "launcher as is": [],
    "language-model-only": ["--language-model-only"],
    "chat kwargs not an object": ["--default-chat-template-kwargs", "[1]"],
    "chat kwargs object": ["--default-chat-template-kwargs", '{"enable_thinking": false}'],
    "unknown speculative algorithm": ["--speculative-algorithm", "MEDUSA"],
    "speculative algorithm in lower case": ["--speculative-algorithm", "nextn"],
    "mamba no_buffer with overlap": ["--mamba-radix-cache-strategy", "no_buffer"],
    "mamba no_buffer without overlap": ["--mamba-radix-cache-strategy", "no_buffer", "--disable-overlap-schedule"],
    "mamba no_buffer on trtllm_mha": [
        "--mamba-radix-cache-strategy",
        "no_buffer",
        "--disable-overlap-schedule",
        "--attention-backend",
        "trtllm_mha",
    ],
}


def _standin_verdict(argv: list[str]) -> dict[str, Any]:
    args = cli.parse_args(argv)
    try:
        cli.resolve_settings(args)
    except (ValueError, AssertionError) as exc:
        return {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    return {"ok": True}


def test_standin_resolution_refuses_what_real_resolution_refuses(real_sglang: RealSglang, tmp_path: Path) -> None:
    """Same argv, same verdict: the stand-in starts exactly when real SGLang would, else fails the same way."""
    base = box_argvs(tmp_path, [])[0]
    argvs = {name: [*base, *extra] for name, extra in VARIANTS.items()}
    real = dict(zip(argvs, resolve_real(real_sglang, list(argvs.values()))["runs"], strict=True))
    assert real["launcher as is"]["ok"] and not real["language-model-only"]["ok"]  # the tier can tell them apart
    assert "does not support ['Qwen3_5ForConditionalGeneration']" in real["language-model-only"]["error"]
    differ = {}
    for name, argv in argvs.items():
        mine, theirs = _standin_verdict(argv), real[name]
        if mine["ok"] != theirs["ok"] or mine.get("error") != theirs.get("error"):
            differ[name] = {"stand-in": mine, "real": theirs}
    assert differ == {}


def test_datagen_check_runs_the_installed_engines_own_parser(
    real_sglang: RealSglang, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`datagen check` with the engine's interpreter: values and resolution judged by sglang 0.5.23 itself."""
    monkeypatch.setenv("CONFORMANCE_GPU", "sm120")  # the engine's interpreter sees one SM120 GPU
    settings = Settings(engine="sglang", engine_python=real_sglang.engine_python(tmp_path), work_dir=tmp_path)
    spec = RunSpec(model_path=str(ensure_model_dir()))
    ok = {r.name: r for r in server_flag_checks(settings, spec)}
    assert ok["engine.server_flags"].status == "pass", ok["engine.server_flags"].detail
    assert "sglang 0.5.23's own parser" in ok["engine.server_flags"].detail
    assert ok["engine.settings"].status == "pass", ok["engine.settings"].detail

    def verdict(server_args: list[str]) -> dict[str, Any]:
        results = server_flag_checks(settings, spec.model_copy(update={"server_args": server_args}))
        return {r.name: r for r in results}

    bad_value = verdict(["--attention-backend", "fa5"])["engine.server_flags"]
    assert bad_value.status == "fail" and "invalid choice: 'fa5'" in bad_value.detail
    bad_int = verdict(["--max-total-tokens", "32K"])["engine.server_flags"]  # suffixes are case-sensitive
    assert bad_int.status == "fail" and "Invalid integer value: '32K'" in bad_int.detail
    refused = verdict(["--mamba-radix-cache-strategy", "no_buffer"])["engine.settings"]  # needs no overlap
    assert refused.status == "fail" and "no_buffer" in refused.detail
    # Flags a run may not set never reach the engine (datagen/checks/tuning.py): refused with our reason.
    gone = verdict(["--mamba-scheduler-strategy", "auto"])["engine.server_flags"]
    assert gone.status == "fail" and "not on the allow-list of tuning flags" in gone.detail
    lmo = verdict(["--language-model-only"])
    assert (
        lmo["engine.server_flags"].status == "fail" and "managed by the pipeline" in lmo["engine.server_flags"].detail
    )
    assert lmo["engine.settings"].status == "skipped"


_PROCESSOR = r"""
from sglang.srt.utils.hf_transformers.processor import get_processor
out = {}
for path in ARGS:
    try:
        # As the tokenizer manager calls it (managers/tokenizer_manager.py: get_processor_wrapper).
        proc = get_processor(path, tokenizer_mode="auto", trust_remote_code=False, revision=None,
                             tokenizer_backend="huggingface", model_name=path)
        parts = [a for a in ("image_processor", "video_processor", "tokenizer") if getattr(proc, a, None)]
        out[path] = {"ok": True, "class": type(proc).__name__, "parts": sorted(parts)}
    except Exception as exc:
        out[path] = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
RESULT = out
"""


def test_model_dir_check_requires_what_the_real_processor_loader_reads(real_sglang: RealSglang, tmp_path: Path) -> None:
    """Without --language-model-only the server loads Qwen3.6's processor: our check and the real loader agree."""
    fixture = ensure_model_dir()
    variants = {"fixture": fixture}
    for name, drop in {
        "no processor files": ("preprocessor_config.json", "video_preprocessor_config.json"),
        "image config only": ("video_preprocessor_config.json",),
        "video config only": ("preprocessor_config.json",),
    }.items():
        copy = tmp_path / name.replace(" ", "-")
        shutil.copytree(fixture, copy)
        for file in drop:
            (copy / file).unlink()
        variants[name] = copy
    real = real_sglang.run(_PROCESSOR, [str(p) for p in variants.values()])
    verdicts = {name: real[str(path)] for name, path in variants.items()}
    assert verdicts["fixture"] == {
        "ok": True,
        "class": "Qwen3VLProcessor",
        "parts": ["image_processor", "tokenizer", "video_processor"],
    }
    assert not verdicts["no processor files"]["ok"]
    for name, path in variants.items():
        ours = check_processor(path)
        assert (ours.status == "pass") == verdicts[name]["ok"], (name, ours.detail, verdicts[name])


def test_standin_process_exits_like_real_sglang_on_a_refused_setting() -> None:
    """`python -m datagen.standin ... --language-model-only` dies at startup with real SGLang's message."""
    argv = [sys.executable, "-m", "datagen.standin", "--model-path", str(ensure_model_dir()), "--language-model-only"]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 1
    assert "ValueError: --language-model-only does not support ['Qwen3_5ForConditionalGeneration']" in proc.stderr
