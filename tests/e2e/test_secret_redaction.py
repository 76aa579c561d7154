"""The API key never reaches what people read: real stand-in processes (which log and report their settings,
key included, as real SGLang 0.5.23 does) and a real Prefect server, queried for everything a run left there."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import get_client
from pydantic import SecretStr

from datagen.chat import ChatTokenizer
from datagen.engine.client import sampling_params_for
from datagen.engine.dispatcher import Dispatcher, EngineStalled, GenerateJob
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations.redact import MASK, redact, redact_lines, redact_text
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from datagen.settings import Settings
from flows.expand_dataset import expand_dataset
from tasks import provisioning

# --- the redaction module alone -----------------------------------------------------------------------------


def test_redact_masks_known_values_flags_fields_and_bearer_tokens() -> None:
    key = "kS3cr3tValue-_x"
    line = (
        f"server_args={{'api_key': '{key}', 'admin_api_key': 'adm1n-key', 'port': 30000, 'hf_token': None}} "
        f'launch: --api-key={key} --admin-api-k adm1n-key --max-new-tokens 5 "api_key": "other-key" '
        "Authorization: Bearer tok-123 api_key=plain-key"
    )
    out = redact_text(line, [SecretStr(key)])
    for secret in (key, "adm1n-key", "other-key", "tok-123", "plain-key"):
        assert secret not in out, secret
    assert "'port': 30000" in out and "--max-new-tokens 5" in out and "'hf_token': None" in out
    assert out.count(MASK) >= 5
    assert redact_lines([f"x {key}", "fine"], [key]) == [f"x {MASK}", "fine"]


def test_redact_walks_server_info() -> None:
    info = {
        "api_key": "k-123456",
        "admin_api_key": None,
        "max_total_num_tokens": 5,
        "launch_command": "--model-path m --api-key k-123456",
        "internal_states": [{"api_key": "k-123456", "watermark_key": "w", "memory_usage": {"token_capacity": 9}}],
    }
    out = redact(info)
    assert "k-123456" not in json.dumps(out)
    assert out["admin_api_key"] is None and out["max_total_num_tokens"] == 5
    assert out["internal_states"][0]["memory_usage"] == {"token_capacity": 9}
    assert out["internal_states"][0]["watermark_key"] == MASK
    assert info["api_key"] == "k-123456"  # the input is not modified


# --- real processes, real Prefect -----------------------------------------------------------------------------


def _everything_prefect_holds() -> str:
    """Flow runs (state messages), task runs (states, result references), logs and artifacts, as JSON text."""
    with get_client(sync_client=True) as client:
        parts: list[Any] = []
        parts += [r.model_dump(mode="json") for r in client.read_flow_runs()]
        parts += [r.model_dump(mode="json") for r in client.read_task_runs()]
        parts += [r.model_dump(mode="json") for r in client.read_logs()]
        parts += [r.model_dump(mode="json") for r in client.read_artifacts()]
    return json.dumps(parts)


def _files_under(root: Path, exclude: Path) -> Iterator[tuple[Path, bytes]]:
    for path in root.rglob("*"):
        if path.is_file() and exclude not in path.parents:
            yield path, path.read_bytes()


def _prompts(tmp_path: Path) -> list[PromptSource]:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Q{i}?"}]}) + "\n" for i in range(3)))
    return [PromptSource(path=str(path))]


@pytest.fixture
def leaky_key(monkeypatch: pytest.MonkeyPatch, pipeline_env: dict[str, str]) -> str:
    key = f"leak-{uuid.uuid4().hex}"
    monkeypatch.setenv("DATAGEN_SGLANG_API_KEY", key)
    monkeypatch.setenv("DATAGEN_NUM_SERVERS", "1")
    monkeypatch.setenv("DATAGEN_SERVER_START_TIMEOUT_S", "120")
    return key


@pytest.mark.slow
def test_server_that_fails_to_start_shows_no_key_anywhere(
    prefect_api: None, leaky_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The stand-in logs server_args (api_key in clear), then "loads" for longer than the start timeout: the run
    fails with ServerStartError and the server's log tail, masked."""
    monkeypatch.setenv("DATAGEN_STANDIN_LOAD_S", "120")
    monkeypatch.setenv("DATAGEN_SERVER_START_TIMEOUT_S", "20")
    spec = RunSpec(
        sources=_prompts(tmp_path),
        model_path=str(ensure_model_dir()),
        namespace="leak_start_v1",
        context_length=4096,
        sampling=SamplingSpec(max_new_tokens=256),
    )
    with pytest.raises(Exception) as info:
        expand_dataset(spec)
    message = str(info.value)
    assert "did not become healthy within 20 s" in message  # the failure we meant, with its log tail
    assert "server_args={" in message and f"'api_key': '{MASK}'" in message
    assert leaky_key not in message
    # The raw server log holds the key (as real SGLang's would): the masking above was needed.
    work = Path(Settings().work_dir)
    logs = RunLayout.for_run(work, "leak_start_v1").logs_dir
    assert any(leaky_key in p.read_text() for p in logs.glob("server-*.log"))
    held = _everything_prefect_holds()
    assert "leak_start_v1" in held and "server_args=" in held  # the run and its error reached Prefect
    assert leaky_key not in held
    for path, data in _files_under(work, exclude=logs):
        assert leaky_key.encode() not in data, path


@flow(name="stall-probe")
def _stalling_run(spec: RunSpec, name: str) -> None:
    """The real fleet and dispatcher in a Prefect flow, with a short stall timeout."""
    settings = Settings()
    layout = RunLayout.for_run(Path(settings.work_dir), name)
    chat = ChatTokenizer.from_model_dir(spec.model_path)
    api_key = provisioning.api_key_for(settings)
    with (
        provisioning.provision(settings, spec, layout, api_key) as fleet,
        Dispatcher(fleet.endpoints, stall_timeout_s=4.0) as dispatcher,
    ):
        dispatcher.wait_ready(120)
        ids = chat.prompt_ids([{"role": "user", "content": "hang?"}], True)
        dispatcher.submit(GenerateJob(ids, sampling_params_for(spec.sampling))).result(timeout=300)


@pytest.mark.slow
def test_server_that_stalls_shows_no_key_anywhere(
    prefect_api: None, leaky_key: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """EngineStalled carries the servers' last log lines: with the startup settings among them, masked."""
    monkeypatch.setenv("DATAGEN_STANDIN_STALL_AFTER", "0")
    spec = RunSpec(
        sources=_prompts(tmp_path),
        model_path=str(ensure_model_dir()),
        namespace="leak_stall_v1",
        context_length=4096,
        sampling=SamplingSpec(max_new_tokens=256),
        server_args=["--log-level-http", "warning"],  # no access-log lines: the settings line stays in the tail
    )
    with pytest.raises(EngineStalled) as info:
        _stalling_run(spec, "leak_stall_v1")
    message = str(info.value)
    assert "no request finished on any server" in message and "server_args={" in message
    assert leaky_key not in message and f"'api_key': '{MASK}'" in message
    held = _everything_prefect_holds()
    assert "no request finished on any server" in held and leaky_key not in held
    work = Path(Settings().work_dir)
    logs = RunLayout.for_run(work, "leak_stall_v1").logs_dir
    assert any(leaky_key in p.read_text() for p in logs.glob("server-*.log"))
    for path, data in _files_under(work, exclude=logs):
        assert leaky_key.encode() not in data, path
