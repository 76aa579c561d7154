"""Bad input through the whole `expand-dataset` flow: it fails early and loudly, and the failing task is red."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId
from prefect.client.schemas.objects import TaskRun
from prefect.states import State

from datagen.engine.endpoints import ServerEndpoint
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from flows.cli import summary_text
from flows.expand_dataset import expand_dataset

pytestmark = pytest.mark.slow


def _spec(path: Path, namespace: str, gate: QualityGate | None = None) -> RunSpec:
    return RunSpec(
        sources=[PromptSource(path=str(path))],
        model_path=str(ensure_model_dir()),
        namespace=namespace,
        shard_size=5,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=gate or QualityGate(),
    )


def _task_runs(state: State[Any], until: str) -> dict[str, TaskRun]:
    """Task runs of a flow run by name, once the one named `until` has a final state (events arrive late)."""
    flow_run_id = state.state_details.flow_run_id
    assert flow_run_id is not None
    deadline = time.monotonic() + 60
    with get_client(sync_client=True) as client:
        while True:
            runs = client.read_task_runs(flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])))
            by_name = {r.name.rsplit("-", 1)[0]: r for r in runs}  # Prefect appends "-<short id>"
            done = by_name.get(until)
            if (done is not None and done.state is not None and done.state.is_final()) or time.monotonic() > deadline:
                return by_name
            time.sleep(0.5)


def _failed(runs: dict[str, TaskRun]) -> list[str]:
    return sorted(n for n, r in runs.items() if r.state is not None and r.state.is_failed())


def test_input_whose_every_row_is_rejected_fails_before_servers_with_reasons(
    prefect_api: None, pipeline_env: dict[str, str], tmp_path: Path
) -> None:
    # Issue 13.2: JSONL of plain text used to exit 0 with "nothing new to generate" and the CLI printed None.
    f = tmp_path / "plain.jsonl"
    f.write_text("".join(f"just some text, line {i}\n" for i in range(6)) + '{"text": "wrong columns"}\n')
    state = expand_dataset(_spec(f, "allbad"), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"(?s)all 7 rows read were rejected.*invalid_json=6.*unknown_format=1"):
        state.result()
    runs = _task_runs(state, "quality gate on load rejects")
    assert _failed(runs) == ["quality gate on load rejects"]
    message = runs["quality gate on load rejects"].state.message  # type: ignore[union-attr]
    assert "invalid_json=6 (85.7%)" in message
    # Issue 25.3: the message is the run page's first text: no worker-local paths a browser cannot open.
    assert "load-rejects.jsonl" not in message and str(tmp_path) not in message, message
    assert not any(name.startswith(("start servers", "generate")) for name in runs)


def test_a_quarter_of_rows_broken_fails_before_any_server_starts(
    prefect_api: None, pipeline_env: dict[str, str], tmp_path: Path
) -> None:
    # Issue 13.3: the gate used to learn about load rejects only after all generation had run.
    f = tmp_path / "quarter.jsonl"
    rows = [json.dumps({"instruction": f"Explain idea {i}."}) for i in range(12)]
    f.write_text("\n".join([*rows, *(['{"instruction": 5}'] * 4)]) + "\n")
    state = expand_dataset(_spec(f, "quarter"), return_state=True)
    assert state.is_failed()
    with pytest.raises(Exception, match=r"4/16 rows rejected at load = 25.0%.*\n.*wrong_type=4"):
        state.result()
    runs = _task_runs(state, "quality gate on load rejects")
    assert _failed(runs) == ["quality gate on load rejects"]
    assert not any(name.startswith(("start servers", "generate")) for name in runs)


def test_failed_quality_gate_is_the_red_task_with_the_report(
    prefect_api: None, pipeline_env: dict[str, str], tmp_path: Path
) -> None:
    # Issue 13.9: the flow failed but the `quality gate` task showed Completed.
    f = tmp_path / "good.jsonl"
    f.write_text("".join(json.dumps({"instruction": f"Describe place {i} in detail."}) + "\n" for i in range(6)))
    state = expand_dataset(_spec(f, "gatefail", QualityGate(min_median_completion_tokens=100_000)), return_state=True)
    assert state.is_failed()
    runs = _task_runs(state, "quality gate")
    assert _failed(runs) == ["quality gate"]
    message = runs["quality gate"].state.message  # type: ignore[union-attr]
    assert "quality gate FAILED" in message and "median_completion_tokens" in message
    # Issue 25.3/25.5: short, no reject-file paths, and one gate task and one validation report per run.
    assert "rejects.jsonl" not in message and len(message.splitlines()) <= 8, message
    with get_client(sync_client=True) as client:
        all_runs = client.read_task_runs(
            flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[state.state_details.flow_run_id]))
        )  # type: ignore[list-item]
    assert [r.name.rsplit("-", 1)[0] for r in all_runs].count("quality gate") == 1, [r.name for r in all_runs]
    assert runs["validation summary"].state.is_completed()  # type: ignore[union-attr]
    shards = [r for name, r in runs.items() if name.startswith("validate+tokenize shard")]
    assert shards and all(r.state.is_completed() for r in shards)  # type: ignore[union-attr]


def test_cli_summary_is_never_a_bare_none() -> None:
    line = summary_text({"uri": None, "namespace": "ns", "reason": "nothing new to generate: 0 rows read"})
    assert line == "nothing published in namespace ns: nothing new to generate: 0 rows read"
    assert summary_text({"uri": None, "namespace": "ns"}) == "nothing published in namespace ns: no prompts"
    ok = summary_text({"uri": "s3://b/ns/", "namespace": "ns", "rows": 3, "rejects": 1, "prompts": 4, "dry_run": False})
    assert ok.startswith("Published 3 rows (1 rejects) from 4 prompts in namespace ns")
    assert ok.endswith("\ns3://b/ns/") and "None" not in ok


def _generate_requests(endpoint: ServerEndpoint) -> int:
    """The stand-in's own count of requests it processed (its /metrics, as SGLang reports it)."""
    text = httpx.get(f"{endpoint.url}/metrics", timeout=10).text
    return sum(
        int(float(line.split()[-1])) for line in text.splitlines() if line.startswith("sglang:num_requests_total{")
    )


def test_rows_that_fail_a_pre_generation_check_cost_no_generate_request(
    prefect_api: None, pipeline_env: dict[str, str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    # Issue 23.2: every check that can run before generation runs there. A lone surrogate (used to crash
    # planning), a row over the token limit though under the length-only shortcut (counted in chunks), a tool
    # turn that answers no call (issue 21 loads tool turns; this one is malformed): none reaches the server.
    # The stand-in is attached by URL so its own counter says what it received.
    rows = [
        '{"instruction": "broken \\ud800 text"}',
        json.dumps({"instruction": "word " * 40_000}),  # ~40K tokens > 7168, 200 KB < 7168 x 128 bytes
        json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "tool", "content": "x"}]}),
    ]
    bad = tmp_path / "bad.jsonl"
    bad.write_text("\n".join(rows) + "\n", encoding="utf-8")
    mixed = tmp_path / "mixed.jsonl"
    mixed.write_text("\n".join([*rows, json.dumps({"instruction": "Describe a lighthouse at night."})]) + "\n")
    with run_standin(ensure_model_dir(), args=["--enable-metrics"]) as endpoint:
        assert endpoint.api_key is not None
        before = _generate_requests(endpoint)  # its own warm-up request, if any
        monkeypatch.setenv("DATAGEN_SERVER_URLS", json.dumps([endpoint.url]))
        monkeypatch.setenv("DATAGEN_SGLANG_API_KEY", endpoint.api_key.get_secret_value())
        state = expand_dataset(_spec(bad, "prefail"), return_state=True)
        assert state.is_failed()
        with pytest.raises(Exception, match=r"(?s)all 3 rows read were rejected"):
            state.result()
        assert _generate_requests(endpoint) == before
        rejects_file = Path(pipeline_env["DATAGEN_WORK_DIR"]) / "runs" / "prefail" / "load-rejects.jsonl"
        load_rejects = [json.loads(line) for line in rejects_file.read_text().splitlines()]
        assert [r["reason"] for r in load_rejects] == ["invalid_unicode", "prompt_too_long", "bad_tool_turn"]
        # The same rows beside one good prompt: the run goes on, and the server gets exactly that one.
        done = expand_dataset(
            _spec(mixed, "premixed", QualityGate(max_reject_rate=0.8, min_median_completion_tokens=1))
        )
        assert done["prompts"] == 1
        assert _generate_requests(endpoint) == before + 1
