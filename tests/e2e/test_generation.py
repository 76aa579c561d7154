"""generate_shard end to end against real stand-in server processes over HTTP.

One driver for both turn modes: a single-turn prompt is a conversation of one step, so the bookkeeping tests run
in both (the `spec` fixture); only the step's key form and record differ (datagen/conversation/turn_mode.py).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.conversation.turn_mode import turn_mode
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.endpoints import ServerEndpoint
from datagen.identity import prompt_id_from_messages, request_key
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Prompt, Reject
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from datagen.sources.preparation import Preparer
from datagen.standin.testing import run_standin
from tasks.generation import ShardResult, generate_shard
from tasks.planning import plan_shards

# Fast, short outputs: these tests check bookkeeping, not speed.
FAST = {
    "DATAGEN_STANDIN_LOAD_S": "0.1",
    "DATAGEN_STANDIN_WARMUP_S": "0.1",
    "DATAGEN_STANDIN_LENGTH_MEAN": "24",
    "DATAGEN_STANDIN_LENGTH_MAX": "48",
    "DATAGEN_STANDIN_STEP_BASE_MS": "2",
}
SPEC = RunSpec(
    model_path="unused",
    sampling=SamplingSpec(max_new_tokens=48),
    context_length=8192,
    max_prompt_tokens=400,
    turns="last",
)


@pytest.fixture(params=["last", "every"])
def spec(request: pytest.FixtureRequest) -> RunSpec:
    """SPEC in each turn mode."""
    return SPEC.model_copy(update={"turns": request.param})


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_model_dir()


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(model_dir)


def write_shard(layout: RunLayout, shard_id: int, n: int, *, long_prompt: bool = False) -> list[Prompt]:
    prompts = []
    for i in range(n):
        messages = [{"role": "user", "content": f"Question {i}: what is {i} + {i * 7}? Explain briefly."}]
        prompts.append(Prompt(prompt_id_from_messages("t", messages), "t", i, messages, category="math"))
    if long_prompt:
        messages = [{"role": "user", "content": "word " * 1000}]
        prompts.append(Prompt(prompt_id_from_messages("t", messages), "t", n, messages))
    path = layout.shard_prompts(shard_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in prompts))
    return prompts


@contextlib.contextmanager
def box(model_dir: Path, *envs: dict[str, str], args: tuple[str, ...] = ()) -> Iterator[list[ServerEndpoint]]:
    """One stand-in process per env, all torn down afterwards."""
    with contextlib.ExitStack() as stack:
        endpoints = []
        for i, env in enumerate(envs):
            ep = stack.enter_context(
                run_standin(
                    model_dir, args=("--enable-metrics", *args), env={**FAST, **env, "DATAGEN_STANDIN_SEED": str(i)}
                )
            )
            endpoints.append(
                ServerEndpoint(ep.name or f"s{i}", ep.url, ep.api_key, ep.max_running_requests, ep.log_path)
            )
        yield endpoints


def make_dispatcher(endpoints: list[ServerEndpoint]) -> Dispatcher:
    d = Dispatcher(
        endpoints,
        queue_depth=2,
        backoff_base_s=0.05,
        backoff_max_s=0.5,
        probe_interval_s=0.2,
        load_poll_interval_s=0.2,
        stall_timeout_s=60,
        timeout_floor_s=30,
    )
    assert d.wait_ready(30)
    return d


def requests_served(ep: ServerEndpoint) -> int:
    """The server's own count of generation requests (Prometheus sglang:num_requests_total)."""
    headers = {"Authorization": f"Bearer {ep.api_key.get_secret_value()}"} if ep.api_key else {}
    text = httpx.get(f"{ep.url}/metrics", headers=headers, timeout=10).text
    return sum(int(float(m)) for m in re.findall(r"^sglang:num_requests_total\{[^}]*\} (\S+)$", text, re.M))


def rows(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def check_ledger(
    result: ShardResult, prompts: list[Prompt], chat: ChatTokenizer, spec: RunSpec = SPEC
) -> list[Completion]:
    """Every prompt settled exactly once (its one step, keyed as `spec`'s mode keys it), counts add up, checksum and
    tokens match the file."""
    completions = [Completion.from_json(json.dumps(r)) for r in rows(Path(result.completions_path))]
    rejects = [Reject.from_json(json.dumps(r)) for r in rows(Path(result.rejects_path))]
    keys = [c.request_key for c in completions] + [r.request_key for r in rejects]
    mode = turn_mode(spec)
    expected = {
        mode.step_key(request_key(p.prompt_id, spec.sampling, chat.fingerprint, chat.template_hash), 0) for p in prompts
    }
    assert len(keys) == len(set(keys)) and set(keys) == expected
    assert result.n_prompts == len(prompts) == result.n_completed + result.n_rejected
    assert (result.n_completed, result.n_rejected) == (len(completions), len(rejects))
    assert result.output_tokens == sum(c.completion_tokens for c in completions)
    assert result.completions_sha256 == hashlib.sha256(Path(result.completions_path).read_bytes()).hexdigest()
    for c in completions:
        assert c.completion_tokens == len(c.output_ids) > 0
        assert c.finish_reason in ("stop", "length")
        assert (c.output_ids[-1] == IM_END_ID) == (c.finish_reason == "stop")
        assert c.prompt_tokens == len(chat.prompt_ids(c.messages))
        assert c.server
    return completions


def test_shard_completes_and_counts_add_up_then_rerun_sends_nothing(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer, spec: RunSpec
) -> None:
    layout = RunLayout(tmp_path)
    prompts = write_shard(layout, 0, 40, long_prompt=True)
    with box(model_dir, {}) as eps:
        d = make_dispatcher(eps)
        try:
            baseline = requests_served(eps[0])  # the server's own warmup request
            first = generate_shard(0, layout, d, chat, spec, flush_interval_s=0.2)
            served = requests_served(eps[0])
            again = generate_shard(0, layout, d, chat, spec, flush_interval_s=0.2)
            assert requests_served(eps[0]) == served  # the server saw nothing new
        finally:
            d.close()
    check_ledger(first, prompts, chat, spec)
    assert (first.n_prompts, first.n_completed, first.n_rejected, first.n_sent) == (41, 40, 1, 40)
    assert served - baseline == 40
    (reject,) = rows(layout.shard_rejects(0))
    assert reject["stage"] == "generate" and reject["reason"] == "prompt_too_long"
    assert re.search(r"prompt has \d+ tokens, limit is 400", reject["detail"])
    assert again.n_sent == 0
    assert again.model_dump(exclude={"n_sent"}) == first.model_dump(exclude={"n_sent"})


def test_half_checkpoint_only_sends_the_other_half_and_survives_a_torn_line(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer, spec: RunSpec
) -> None:
    full, half = RunLayout(tmp_path / "full"), RunLayout(tmp_path / "half")
    prompts = write_shard(full, 3, 30)
    write_shard(half, 3, 30)
    with box(model_dir, {}) as eps:
        d = make_dispatcher(eps)
        try:
            generate_shard(3, full, d, chat, spec)
            lines = full.shard_completions(3).read_text().splitlines(keepends=True)
            # The first 15 results, then half a line: what a crash mid-write leaves.
            half.shard_completions(3).write_text("".join(lines[:15]) + lines[15][: len(lines[15]) // 2])
            before = requests_served(eps[0])
            result = generate_shard(3, half, d, chat, spec)
            sent = requests_served(eps[0]) - before
        finally:
            d.close()
    assert result.n_sent == 15 and sent == 15
    completions = check_ledger(result, prompts, chat, spec)
    assert result.n_completed == 30
    assert [c.request_key for c in completions[:15]] == [json.loads(x)["request_key"] for x in lines[:15]]


def test_a_server_dying_mid_run_loses_and_duplicates_nothing(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer, spec: RunSpec
) -> None:
    layout = RunLayout(tmp_path)
    prompts = write_shard(layout, 1, 120)
    slow = {"DATAGEN_STANDIN_STEP_BASE_MS": "10"}
    with box(model_dir, {**slow, "DATAGEN_STANDIN_CRASH_AFTER": "10"}, slow) as eps:
        d = make_dispatcher(eps)
        try:
            result = generate_shard(1, layout, d, chat, spec, flush_interval_s=0.2)
            stats = d.stats()
        finally:
            d.close()
    completions = check_ledger(result, prompts, chat, spec)
    assert result.n_completed == 120 and result.n_rejected == 0
    by_server = {ep.name: sum(c.server == ep.name for c in completions) for ep in eps}
    assert by_server[eps[0].name] >= 10 and by_server[eps[1].name] >= 1
    states = {s.name: s.state for s in stats.servers}
    assert states == {eps[0].name: "down", eps[1].name: "up"}
    assert stats.requeued >= 1  # requests in flight on the dead server were sent again elsewhere


def test_injected_server_errors_end_completed_or_rejected_with_a_reason(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer, spec: RunSpec
) -> None:
    layout = RunLayout(tmp_path)
    prompts = write_shard(layout, 2, 150)
    with box(model_dir, {"DATAGEN_STANDIN_ERROR_RATE": "0.05"}) as eps:
        d = make_dispatcher(eps)
        try:
            result = generate_shard(2, layout, d, chat, spec, flush_interval_s=0.2)
            stats = d.stats()
        finally:
            d.close()
    check_ledger(result, prompts, chat, spec)
    assert stats.retries >= 1  # errors really were injected, and retried
    assert all(r["reason"] and r["detail"] for r in rows(layout.shard_rejects(2)))


def test_a_servers_400_becomes_a_reject_row_with_its_message(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer, spec: RunSpec
) -> None:
    layout = RunLayout(tmp_path)
    prompts = write_shard(layout, 4, 5)
    messages = [{"role": "user", "content": "tell me about " * 60}]
    prompts.append(Prompt(prompt_id_from_messages("t", messages), "t", 5, messages))
    layout.shard_prompts(4).write_text("".join(p.to_json() + "\n" for p in prompts))
    # Our limit (400) lets it through; the server's own context (160 tokens) does not.
    with box(model_dir, {}, args=("--context-length", "160")) as eps:
        d = make_dispatcher(eps)
        try:
            result = generate_shard(4, layout, d, chat, spec)
        finally:
            d.close()
    check_ledger(result, prompts, chat, spec)
    (reject,) = rows(layout.shard_rejects(4))
    assert reject["reason"] == "server_rejected" and reject["prompt_id"] == prompts[-1].prompt_id
    assert "context length" in reject["detail"]


def test_generation_sends_planning_s_render_without_rendering_again(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = tmp_path / "q.jsonl"
    source.write_text("".join(json.dumps({"instruction": f"Question {i}: add {i} and {i}."}) + "\n" for i in range(12)))
    spec = SPEC.model_copy(update={"model_path": str(model_dir), "sources": [PromptSource(path=str(source))]})
    layout = RunLayout(tmp_path / "run")
    plan = plan_shards(spec, layout)

    def no_render(self: Preparer, messages: list[Any]) -> list[int]:
        raise AssertionError("generation rendered a prompt that planning had rendered")

    monkeypatch.setattr(Preparer, "__call__", no_render)
    with box(model_dir, {}) as eps:
        d = make_dispatcher(eps)
        try:
            result = generate_shard(plan.shard_ids[0], layout, d, chat, spec)
        finally:
            d.close()
    assert (result.n_completed, result.n_rejected) == (12, 0)
    for c in rows(layout.shard_completions(0)):
        assert c["prompt_tokens"] == len(chat.prompt_ids(Completion.from_json(json.dumps(c)).messages))
