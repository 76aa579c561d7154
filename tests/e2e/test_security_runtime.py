"""Issue 20's probes of run parameters, paths and local files, made again with real processes.

Each probe worked on the code before this suite: run `server_args` rebound, unkeyed or code-loading servers;
`..`, symlinked and absolute prompt sources outside any data directory were read and published; a pilot name
reached the filesystem; servers inherited the S3 secret, carried the key on their command line and wrote
world-readable logs. docs/security.md ("Run parameters and the GPU box", "Paths and local files") maps each
defence to its test here.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr, ValidationError

from datagen.checks.tuning import MANAGED_FLAGS, TUNING_FLAGS, ServerArgsError, check_server_args
from datagen.engine.launcher import launch_flags, reap_orphaned_servers
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.paths import PathNotAllowed, confine, secure_run, untrusted
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from datagen.settings import Settings
from datagen.sources.prompts import iter_prompts
from flows.expand_dataset import expand_dataset
from tasks.pilot import PilotSpec
from tasks.provisioning import provision
from tests.conformance.test_launch_conformance import documented_server_args

KEY = SecretStr("sec-key-5d1e9c")
S3_SECRET = "s3-secret-never-in-a-server-8c2f"

# The probes (appended to every server's argv, they won: tests/conformance/test_tuning_conformance.py)
# and the other spellings argparse accepts for them, each with the flag the refusal must name.
PROBES: list[tuple[list[str], str]] = [
    (["--host", "0.0.0.0"], "--host"),
    (["--host=0.0.0.0"], "--host"),
    (["--ho", "0.0.0.0"], "--host"),  # an abbreviation SGLang's parser (allow_abbrev) expands
    (["--api-key="], "--api-key"),
    (["--api-key", ""], "--api-key"),
    (["--api-k", "x"], "--api-key"),
    (["--api_key", "x"], "--api-key"),
    (["--admin-api-key=x"], "--admin-api-key"),
    (["--enable-custom-logit-processor"], "--enable-custom-logit-processor"),
    (["--enable-custom-logit"], "--enable-custom-logit-processor"),
    (["--trust-remote-code"], "--trust-remote-code"),
    (["--trust_remote_code"], "--trust-remote-code"),
    (["--tokenizer-path", "/tmp/x"], "--tokenizer-path"),
    (["--tokenizer-p=/tmp/x"], "--tokenizer-path"),
    (["--port", "31999"], "--port"),
    (["--port=31999"], "--port"),
    (["--nccl-port", "25000"], "--nccl-port"),
    (["--model-path", "/etc"], "--model-path"),
    (["--model", "/etc"], "--model"),
    (["--served-model-name", "x"], "--served-model-name"),
    (["--config", "/tmp/x.yaml"], "--config"),
    (["--config=/tmp/x.yaml"], "--config"),
    (["--forward-hooks", "[]"], "--forward-hooks"),
    (["--speculative-draft-model", "/tmp/m"], "--speculative-draft-model"),
    (["--mem-fraction-static", "0.8", "--host", "0.0.0.0"], "--host"),  # hidden behind a tuning flag
    (["--not-a-flag"], "--not-a-flag"),
    (["-h"], "-h"),
    (["--", "--host"], "--"),
]


@pytest.mark.parametrize(("server_args", "flag"), PROBES, ids=[" ".join(a) for a, _ in PROBES])
def test_every_probe_server_arg_is_refused_by_the_run_spec_and_the_launcher(server_args: list[str], flag: str) -> None:
    with pytest.raises(ValidationError) as info:
        RunSpec(server_args=server_args)
    assert flag in str(info.value)
    # A spec built without validation (model_copy) is refused again where the argv is made.
    spec = RunSpec().model_copy(update={"server_args": server_args})
    with pytest.raises(ServerArgsError, match=flag):
        launch_flags(Settings(), spec, 30000, Path("/nonexistent/key.yaml"))


def test_refusals_say_why() -> None:
    with pytest.raises(ServerArgsError) as info:
        check_server_args(["--trust-remote-code", "--api-k", "x", "--mem-frac", "0.8", "--enable-lora"])
    text = str(info.value)
    assert "--trust-remote-code is managed by the pipeline" in text and "run code" in text
    assert "'--api-k' could stand for --api-key" in text
    assert "did you mean --mem-fraction-static" in text
    assert "'--enable-lora'" in text and "changes what the servers load" in text


def test_documented_tuning_flags_and_the_memory_plan_flags_are_accepted() -> None:
    for name, args in documented_server_args().items():
        assert RunSpec(server_args=args).server_args == args, name
    plan = ["--mem-fraction-static=0.85", "--max-running-requests", "96", "--cuda-graph-max-bs-decode", "96"]
    plan += ["--disable-radix-cache", "--mamba-full-memory-ratio", "0.8", "--max-mamba-cache-size", "200"]
    plan += ["--chunked-prefill-size", "-1", "--schedule-policy", "lpm", "--kv-cache-dtype", "auto"]
    plan += ["--mamba-ssm-dtype", "bfloat16", "--speculative-algorithm", "NEXTN", "--speculative-num-steps", "3"]
    check_server_args(plan)


# --- paths -----------------------------------------------------------------------------------------------


def _rows(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"instruction": text}) + "\n")
    return path


@pytest.fixture
def roots(tmp_path: Path) -> tuple[Settings, Path, Path]:
    """Settings with one data root and one model root in tmp_path, and a secret file outside both."""
    data = tmp_path / "data"
    _rows(data / "ok.jsonl", "a fine prompt")
    outside = _rows(tmp_path / "outside" / "secret.jsonl", "SECRET-ROW-CONTENT")
    settings = Settings(
        data_roots=[data], model_roots=[ensure_model_dir().parent], work_dir=tmp_path / "work", _env_file=None
    )
    return settings, data, outside


def _spec(path: str, model: str | None = None) -> RunSpec:
    return RunSpec(sources=[PromptSource(path=path)], model_path=model or str(ensure_model_dir()))


def test_sources_outside_the_data_roots_are_refused_whatever_the_spelling(
    roots: tuple[Settings, Path, Path], tmp_path: Path
) -> None:
    settings, data, outside = roots
    (data / "link.jsonl").symlink_to(outside)
    (data / "dirlink").symlink_to(outside.parent, target_is_directory=True)
    spellings = {
        "dotdot": f"{data}/../outside/secret.jsonl",
        "relative dotdot": "../outside/secret.jsonl",  # from the data root as working directory
        "symlink": str(data / "link.jsonl"),
        "symlinked dir": str(data / "dirlink" / "secret.jsonl"),
        "absolute": str(outside),
        "etc": "/etc/passwd",
    }
    for name, path in spellings.items():
        with pytest.raises(PathNotAllowed, match="is not under the roots the box allows") as info:
            secure_run(settings, _spec(path), base_dir=data)
        assert "SECRET" not in str(info.value), name
    # A directory source is read file by file: a link inside it that leads outside refuses the whole source.
    (data / "sets" / "sub").mkdir(parents=True)
    _rows(data / "sets" / "fine.jsonl", "fine")
    (data / "sets" / "sub" / "leak.jsonl").symlink_to(outside)
    with pytest.raises(PathNotAllowed, match=re.escape("'sets': sub/leak.jsonl leads outside the roots")) as info:
        secure_run(settings, _spec("sets"), base_dir=data)
    assert "SECRET" not in str(info.value) and str(outside) not in str(info.value)
    secure_run(settings, _spec("ok.jsonl"), base_dir=data)  # inside: fine, relative to the working directory
    secure_run(settings, _spec(str(data / "ok.jsonl")))


def test_refusal_reads_the_same_whether_the_outside_file_exists_or_not(roots: tuple[Settings, Path, Path]) -> None:
    settings, _, outside = roots
    messages = []
    for _ in range(2):
        with pytest.raises(PathNotAllowed) as info:
            secure_run(settings, _spec(str(outside)))
        messages.append(str(info.value))
        if outside.exists():  # the second refusal is about a path that does not exist
            outside.unlink()
            outside.parent.rmdir()
    assert messages[0] == messages[1]


def test_model_path_outside_the_model_roots_is_refused(roots: tuple[Settings, Path, Path]) -> None:
    settings, data, _ = roots
    with pytest.raises(PathNotAllowed, match="model_path '/etc' is not under"):
        secure_run(settings, _spec(str(data / "ok.jsonl"), model="/etc"))
    with pytest.raises(PathNotAllowed, match="model_path"):
        secure_run(settings, _spec(str(data / "ok.jsonl"), model=f"{ensure_model_dir()}/../../../../etc"))
    # The production layout works with the defaults: the staged model in /dev/shm.
    # The defaults, not this machine's DATAGEN_MODEL_ROOTS (tests/conftest.py names /dev/shm for the tests).
    defaults = Settings.model_fields["model_roots"].get_default(call_default_factory=True)
    confine("/dev/shm/Qwen3.6-27B", defaults, "model_path", "DATAGEN_MODEL_ROOTS")
    # Issue 49: not all of /dev/shm, where every local user may put a directory of weights.
    with pytest.raises(PathNotAllowed, match="is not under"):
        confine("/dev/shm/someone-elses-model", defaults, "model_path", "DATAGEN_MODEL_ROOTS")


def test_a_model_others_may_write_is_refused(roots: tuple[Settings, Path, Path], tmp_path: Path) -> None:
    settings, data, _ = roots
    model = tmp_path / "model"
    shutil.copytree(ensure_model_dir(), model)
    mine = settings.model_copy(update={"model_roots": [tmp_path]})
    secure_run(mine, _spec(str(data / "ok.jsonl"), model=str(model)))
    (model / "tokenizer_config.json").chmod(0o666)
    with pytest.raises(PathNotAllowed, match=r"tokenizer_config\.json is writable by every user"):
        secure_run(mine, _spec(str(data / "ok.jsonl"), model=str(model)))
    (model / "tokenizer_config.json").chmod(0o644)
    model.chmod(0o777)
    with pytest.raises(PathNotAllowed, match=r"model_path '.*model' is writable by every user"):
        secure_run(mine, _spec(str(data / "ok.jsonl"), model=str(model)))


def test_a_model_another_user_owns_is_untrusted() -> None:
    # Pure logic on a file's status (mode, ino, dev, nlink, uid, ...): whose it is and who may write it.
    me = os.getuid()
    mine = os.stat_result((0o100644, 0, 0, 1, me, 0, 0, 0, 0, 0))
    assert untrusted(mine, me) is None
    other = os.stat_result((0o100644, 0, 0, 1, me + 1, 0, 0, 0, 0, 0))
    assert untrusted(other, me) == f"belongs to user {me + 1}"
    root_owned = os.stat_result((0o100644, 0, 0, 1, 0, 0, 0, 0, 0, 0))
    assert untrusted(root_owned, me) is None
    world = os.stat_result((0o100666, 0, 0, 1, me, 0, 0, 0, 0, 0))
    assert untrusted(world, me) == "is writable by every user"


def test_hub_dataset_names_only_when_the_box_allows_them(roots: tuple[Settings, Path, Path]) -> None:
    settings, data, _ = roots
    with pytest.raises(PathNotAllowed):
        secure_run(settings, _spec("someorg/some-prompts"), base_dir=data.parent)
    secure_run(settings.model_copy(update={"hub_datasets": True}), _spec("someorg/some-prompts"), base_dir=data.parent)
    with pytest.raises(PathNotAllowed):  # a name that is a local path outside the roots is still a path
        secure_run(settings.model_copy(update={"hub_datasets": True}), _spec("outside/secret.jsonl"), data.parent)


def test_pilot_names_and_field_names_are_plain_names() -> None:
    for bad in ("../../../../etc", "/etc", "a/b", ".hidden", ".."):
        with pytest.raises(ValidationError, match="pilot"):
            RunSpec(pilot=bad)
        with pytest.raises(ValidationError, match="name"):
            PilotSpec(name=bad)
    for bad_field in ("a\nb", "x|y", "<script>", "", "f" * 65):
        with pytest.raises(ValidationError, match="category_field"):
            PromptSource(path="data/prompts", category_field=bad_field)
    assert RunSpec(pilot="p1.v2").pilot == "p1.v2"


def test_served_model_name_is_a_name_not_more_arguments() -> None:
    # The name goes into every server's argv: a flag or a second word there would be read by SGLang's parser.
    for bad in ("--trust-remote-code", "x --host 0.0.0.0", "-x", "base:lora", "a b", "", "n" * 129, "x\ny", "é"):
        with pytest.raises(ValidationError, match="served_model_name") as refused:
            RunSpec(served_model_name=bad)
        # The refusal names what was given (issue 49: it printed a literal "{v!r}"), at most its first 100 chars.
        message = refused.value.errors()[0]["msg"]
        assert "{v!r}" not in message and (":" in bad or message.endswith(f"not {bad[:100]!r}")), message
    for good in ("qwen3.6-27b", "Qwen/Qwen3.6-27B", "m_1.v2"):
        assert RunSpec(served_model_name=good).served_model_name == good


def test_category_values_are_bounded_plain_labels(tmp_path: Path) -> None:
    f = tmp_path / "cats.jsonl"
    rows = [
        {"instruction": "q1", "category": "coding"},
        {"instruction": "q2", "category": "数学 / logic (hard)"},
        {"instruction": "q3", "category": "x" * 65},
        {"instruction": "q4", "category": "a | <img src=x onerror=alert(1)>"},
        {"instruction": "q5", "category": "line\nbreak"},
    ]
    f.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = list(iter_prompts([PromptSource(path=str(f), category_field="category")]))
    kept = [(p.row, p.category) for p in out if not hasattr(p, "reason")]
    rejected = [(r.row, r.reason) for r in out if hasattr(r, "reason")]
    assert kept == [(0, "coding"), (1, "数学 / logic (hard)")]
    assert rejected == [(2, "bad_category"), (3, "bad_category"), (4, "bad_category")]
    assert not any("onerror" in getattr(r, "detail", "") for r in out)  # the value is not echoed


@pytest.mark.slow
@pytest.mark.parametrize("where", ["dotdot", "symlink", "absolute", "model"])
def test_the_flow_refuses_outside_paths_before_reading_or_starting_anything(
    prefect_api: None,
    pipeline_env: dict[str, str],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    where: str,
) -> None:
    data = tmp_path / "data"
    _rows(data / "ok.jsonl", "a fine prompt")
    outside = _rows(tmp_path / "outside" / "secret.jsonl", "SECRET-ROW-CONTENT")
    (data / "link.jsonl").symlink_to(outside)
    monkeypatch.setenv("DATAGEN_DATA_ROOTS", json.dumps([str(data)]))
    monkeypatch.setenv("DATAGEN_MODEL_ROOTS", json.dumps([str(ensure_model_dir())]))
    source = {
        "dotdot": f"{data}/../outside/secret.jsonl",
        "symlink": str(data / "link.jsonl"),
        "absolute": str(outside),
        "model": str(data / "ok.jsonl"),
    }[where]
    model = "/etc" if where == "model" else str(ensure_model_dir())
    spec = RunSpec(
        sources=[PromptSource(path=source)],
        model_path=model,
        namespace=f"probe-{where}",
        shard_size=5,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
    )
    state = expand_dataset(spec, dry_run=True, return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match="is not under the roots the box allows") as info:
        state.result()
    assert "SECRET" not in str(info.value)
    run_dir = RunLayout.for_run(Path(pipeline_env["DATAGEN_WORK_DIR"]), spec.namespace)
    assert not run_dir.logs_dir.exists()  # no server was started
    assert not run_dir.shards_dir.exists()  # nothing was planned (read)


# --- a real fleet: environment, command line, key file and modes ------------------------------------------


def _environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return dict(item.decode().split("=", 1) for item in raw if b"=" in item)


def test_launched_servers_hold_no_pipeline_secret_and_write_private_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    secrets = {
        "DATAGEN_S3_SECRET_ACCESS_KEY": S3_SECRET,
        "DATAGEN_S3_ACCESS_KEY_ID": "s3-id-never-in-a-server",
        "AWS_SECRET_ACCESS_KEY": "aws-secret-never-in-a-server",
        "PREFECT_API_AUTH_STRING": "admin:prefect-pass-never-in-a-server",
        "HF_TOKEN": "hf_never_in_a_server",
        "DATAGEN_SGLANG_API_KEY": KEY.get_secret_value(),
    }
    for name, value in secrets.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("DATAGEN_STANDIN_LOAD_S", "0")
    monkeypatch.setenv("DATAGEN_STANDIN_WARMUP_S", "0")
    work = tmp_path / "work"
    settings = Settings(engine="standin", num_servers=2, base_port=0, server_start_timeout_s=120, work_dir=work)
    spec = RunSpec(model_path=str(ensure_model_dir()), context_length=32768)
    secure_run(settings, spec)
    layout = RunLayout.for_run(work, "sec")
    with provision(settings, spec, layout, KEY) as fleet:
        pids = fleet.pids()
        assert len(pids) == 2
        key_files = list((work / "fleets").glob("*.key.yaml"))
        assert len(key_files) == 1
        for name, pid in pids.items():
            env = _environ(pid)
            leaked = sorted(k for k, v in secrets.items() if k in env or any(v in x for x in env.values()))
            assert leaked == [], f"{name} inherited {leaked}"
            assert env["HF_HUB_OFFLINE"] == "1" and env["CUDA_VISIBLE_DEVICES"] in ("0", "1") and "PATH" in env
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().decode()
            assert KEY.get_secret_value() not in cmdline
            assert f"--config\0{key_files[0]}" in cmdline
        # The key still protects the servers: it reached them through the file.
        for endpoint in fleet:
            assert httpx.get(f"{endpoint.url}/server_info", timeout=30).status_code == 401
            auth = {"Authorization": f"Bearer {KEY.get_secret_value()}"}
            assert httpx.get(f"{endpoint.url}/server_info", headers=auth, timeout=30).status_code == 200
        modes = {p: stat.S_IMODE(p.stat().st_mode) for p in [work, layout.logs_dir, key_files[0].parent]}
        modes |= {p: stat.S_IMODE(p.stat().st_mode) for p in [key_files[0], *layout.logs_dir.glob("*.log")]}
    assert modes.pop(work) == 0o700
    assert modes.pop(layout.logs_dir) == 0o700
    assert modes.pop(key_files[0].parent) == 0o700
    assert modes.pop(key_files[0]) == 0o600
    assert sorted(p.name for p in modes) == ["server-0.log", "server-1.log"]
    assert set(modes.values()) == {0o600}
    assert not key_files[0].exists()  # removed with the fleet
    assert KEY.get_secret_value() in (layout.logs_dir / "server-0.log").read_text()  # why the log is 0600


def test_an_existing_work_dir_is_made_private(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir(mode=0o755)
    os.chmod(work, 0o755)
    secure_run(Settings(work_dir=work, data_roots=[Path("data")], _env_file=None), RunSpec())
    assert stat.S_IMODE(work.stat().st_mode) == 0o700


def test_the_documented_allow_list_is_the_code_s() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "real-engine.md").read_text(encoding="utf-8")
    match = re.search(r"```text tuning-flags\n(.*?)```", doc, re.S)
    assert match, "docs/real-engine.md lost its tuning-flags block"
    assert match.group(1).split() == sorted(TUNING_FLAGS)
    assert all(f"`{flag}`" in doc for flag in MANAGED_FLAGS)


def test_a_dead_fleet_s_key_file_is_removed_by_the_next_run(tmp_path: Path) -> None:
    """A SIGKILLed pipeline cannot remove its key file; the next run on the box does (stop_leftover_servers)."""
    fleets = tmp_path / "fleets"
    fleets.mkdir()
    me = os.getpid()
    live = fleets / f"{me}-{Path(f'/proc/{me}/stat').read_text().rsplit(')', 1)[1].split()[19]}-a.key.yaml"
    dead = fleets / "999999999-1-b.key.yaml"
    for f in (live, dead):
        f.write_text('api-key: "k"\n')
    assert reap_orphaned_servers(tmp_path) == []
    assert live.exists() and not dead.exists()
