"""generate_shard end to end against real stand-in server processes over HTTP, in both turn modes.

One driver for both turn modes: a single-turn prompt is a conversation of one step, so the bookkeeping tests run
in both (the `spec` fixture); only the step's key form and record differ (datagen/conversation/turn_mode.py). A
checkpoint line of the other mode is refused in both.

`turns: every` alone regenerates multi-turn tool-calling conversations turn by turn (the tests after the
bookkeeping ones). The stand-in (its own process) answers a prompt that declares tools with a call of the first
declared function half the time, so conversations take every path: recorded results spliced after a matching call
and the user turn continued token-exact, calls where the row answered in words, words where it called, other
functions, other counts. The lines then go through the real validation and tokenization, and every row is compared
with the real template's `apply_chat_template(..., tools=...)` of the regenerated conversation. A SIGKILL
mid-conversation and a rerun generate every step exactly once: the same steps, with the same outputs, as a run that
was never killed.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import json
import os
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pyarrow.parquet as pq
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.checkpoint import CheckpointError
from datagen.conversation.export import assistant_turn
from datagen.conversation.regeneration import OUTCOMES
from datagen.conversation.turn_mode import turn_mode
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.endpoints import ServerEndpoint
from datagen.identity import RequestKeys, prompt_id_from_messages, request_key
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations.faults import KILL_AFTER_ENV, KILL_AT_ENV
from datagen.records import Completion, Message, Prompt, Reject, TokenRow
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from datagen.sources.preparation import Preparer
from datagen.sources.prompts import iter_prompts
from datagen.standin.testing import run_standin
from tasks.generation import ShardResult, generate_shard, unsettled_requests
from tasks.planning import plan_shards
from tests.turn_fixtures import stage_steps, template_ids

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


# --- `turns: every` alone: multi-turn tool-calling conversations, turn by turn ---------------------------------

REPO_ROOT = Path(__file__).resolve().parents[2]
TURNS_SPEC = RunSpec(model_path="unused", sampling=SamplingSpec(max_new_tokens=320), context_length=8192, turns="every")
BUNDLED = ("tool_calls_openai.jsonl", "tool_calls_sharegpt.jsonl")
STANDIN = {"DATAGEN_STANDIN_LENGTH_MEAN": "100", "DATAGEN_STANDIN_LENGTH_MAX": "200"}


def _tool(name: str, properties: dict[str, Any]) -> dict[str, Any]:
    schema = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": f"{name}.", "parameters": schema}}


TOOLS = [
    _tool("get_weather", {"city": {"type": "string"}, "days": {"type": "integer"}}),
    _tool("web_search", {"query": {"type": "string"}}),
]


def _call(name: str, **arguments: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def _conversation(i: int) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Conversation i of five shapes, each ending with the turn whose reply the loader dropped."""
    weather = _call("get_weather", city=f"City {i}", days=2)
    recorded_answer = {"role": "assistant", "content": "Another model's answer, which is not kept."}
    user = [{"role": "user", "content": f"Question {i}.{k}: what should I know about city {i}?"} for k in range(3)]
    shape = i % 5
    if shape == 0:  # a call with its result, an answer, a second turn that calls again
        return [
            {"role": "system", "content": "You are a travel assistant."},
            user[0],
            {"role": "assistant", "content": "", "tool_calls": [weather]},
            {"role": "tool", "content": f'{{"city": "City {i}", "sky": "rain"}}'},
            recorded_answer,
            user[1],
            {"role": "assistant", "content": "Checking.", "tool_calls": [weather]},
            {"role": "tool", "content": '{"sky": "sun"}'},
        ], TOOLS
    if shape == 1:  # the recorded call is of the second function: the stand-in's call diverges
        search = _call("web_search", query=f"city {i}")
        return [
            user[0],
            {"role": "assistant", "content": "", "tool_calls": [search]},
            {"role": "tool", "content": "r"},
        ], TOOLS
    if shape == 2:  # answered in words throughout, with tools declared
        return [user[0], recorded_answer, user[1], recorded_answer, user[2]], TOOLS
    if shape == 3:  # two parallel calls recorded: a single call is another count
        return [
            user[0],
            {"role": "assistant", "content": "", "tool_calls": [weather, weather]},
            {"role": "tool", "content": "a"},
            {"role": "tool", "content": "b"},
            recorded_answer,
            user[1],
        ], TOOLS
    return [
        {"role": "system", "content": "Be brief."},
        user[0],
        recorded_answer,
        user[1],
        recorded_answer,
        user[2],
    ], None


def write_conversations(layout: RunLayout, shard_id: int, n: int) -> list[Prompt]:
    prompts = []
    for i in range(n):
        messages, tools = _conversation(i)
        pid = prompt_id_from_messages("conv", messages, tools)
        prompts.append(Prompt(pid, "conv", i, [Message.from_dict(m) for m in messages], tools=tools))
    path = layout.shard_prompts(shard_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(p.to_json() + "\n" for p in prompts))
    return prompts


def read_steps(layout: RunLayout, shard_id: int) -> tuple[list[Completion], list[Reject]]:
    steps = [Completion.from_json(json.dumps(r)) for r in rows(layout.shard_completions(shard_id))]
    rejects = [Reject.from_json(json.dumps(r)) for r in rows(layout.shard_rejects(shard_id))]
    return steps, rejects


def check_conversations(
    prompts: list[Prompt], steps: list[Completion], rejects: list[Reject], chat: ChatTokenizer
) -> collections.Counter[str]:
    """Each conversation: steps 0, 1, ... once, ended by one named outcome or one reject; prompts token-exact."""
    key_of = RequestKeys(TURNS_SPEC.sampling, chat)
    mode = turn_mode(TURNS_SPEC)
    keys = [c.request_key for c in steps] + [str(r.request_key) for r in rejects]
    assert len(keys) == len(set(keys))
    by_conversation: dict[str, list[Completion]] = collections.defaultdict(list)
    for c in steps:
        by_conversation[c.prompt_id].append(c)
    rejected = {r.prompt_id: r for r in rejects}
    outcomes: collections.Counter[str] = collections.Counter()
    for prompt in prompts:
        mine = sorted(by_conversation[prompt.prompt_id], key=lambda c: c.step or 0)
        assert [mode.split_key(c.request_key) for c in mine] == [
            (key_of(prompt.prompt_id), n) for n in range(len(mine))
        ]
        ended = [c.outcome for c in mine if c.outcome is not None]
        if prompt.prompt_id in rejected:
            reject_key = rejected[prompt.prompt_id].request_key
            assert ended == [] and reject_key == mode.step_key(key_of(prompt.prompt_id), len(mine))
            outcomes[f"reject:{rejected[prompt.prompt_id].reason}"] += 1
        else:
            assert len(ended) == 1 and (mine[-1].outcome in OUTCOMES or ended[0].startswith("rejected_"))
            outcomes[str(mine[-1].outcome)] += 1
        sent: list[int] = []
        for n, c in enumerate(mine):
            rendered = chat.encode(chat.render(c.messages, True, prompt.tools))
            if c.bridge_ids is not None:  # a continuation: the previous ids, output and bridge, as the server got them
                sent = sent + mine[n - 1].output_ids + c.bridge_ids
                assert sent == rendered
            else:
                sent = rendered
            assert len(sent) == c.prompt_tokens and "server_prompt_tokens" not in c.meta
            assert c.server and c.completion_tokens == len(c.output_ids) > 0
    return outcomes


def test_conversations_regenerate_turn_by_turn_into_exact_rows(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer
) -> None:
    layout = RunLayout(tmp_path / "run")
    prompts = write_conversations(layout, 0, 20)
    # One server: a step's output depends on its prompt alone, so which paths are taken is the same every run.
    with box(model_dir, STANDIN) as eps:
        d = make_dispatcher(eps)
        try:
            assert unsettled_requests(0, layout, chat, TURNS_SPEC) == 20
            result = generate_shard(0, layout, d, chat, TURNS_SPEC, flush_interval_s=0.2)
            served = [requests_served(ep) for ep in eps]
            again = generate_shard(0, layout, d, chat, TURNS_SPEC, flush_interval_s=0.2)
            assert [requests_served(ep) for ep in eps] == served  # settled: nothing sent again
            assert unsettled_requests(0, layout, chat, TURNS_SPEC) == 0
        finally:
            d.close()
    steps, rejects = read_steps(layout, 0)
    assert (result.n_prompts, result.n_completed, result.n_rejected) == (20, len(steps), len(rejects))
    assert result.n_sent == len(steps) + sum(r.reason == "server_rejected" for r in rejects)
    assert again.n_sent == 0 and again.model_dump(exclude={"n_sent"}) == result.model_dump(exclude={"n_sent"})
    outcomes = check_conversations(prompts, steps, rejects, chat)
    print("outcomes:", dict(outcomes), "steps:", len(steps))
    # Every path was taken: results spliced and the turn continued, turns after the first, each named ending.
    assert any(c.bridge_ids for c in steps) and any((c.turn_index or 0) >= 2 for c in steps)
    assert {"complete", "tool_call_divergence", "tool_call_missing", "unexpected_tool_call"} <= set(outcomes)

    token_rows = check_rows(chat, prompts, steps, tmp_path / "stage")
    assert len(token_rows) >= 20


def check_rows(chat: ChatTokenizer, prompts: list[Prompt], steps: list[Completion], work: Path) -> list[TokenRow]:
    """Through the real validation and tokenization: each row is the template's render of its regenerated turns
    (`apply_chat_template(..., tools=...)`, less the closing newline), loss exactly on the generated ids."""
    work.mkdir()
    staging, _ = stage_steps(chat, steps, work)
    token_rows = [TokenRow(**r) for r in pq.read_table(sorted((staging / "data").glob("*.parquet"))).to_pylist()]
    cut = [r["reason"] for r in pq.read_table(sorted((staging / "rejects").glob("*.parquet"))).to_pylist()]
    print("rows:", len(token_rows), "rejects:", collections.Counter(cut))
    tools = {p.prompt_id: p.tools for p in prompts}
    for row in token_rows:
        segment = [c for c in steps if c.prompt_id == row.prompt_id and c.turn_index == row.turn_index]
        last = segment[-1]
        conversation = [m.to_dict() for m in [*last.messages, assistant_turn(last, True)]]
        expected = template_ids(chat, conversation, tools[row.prompt_id])
        assert row.input_ids == expected[:-1] and expected[-1:] == chat.encode("\n")
        mask = [0] * len(row.input_ids)
        for s in segment:
            start = len(chat.encode(chat.render(s.messages, True, tools[row.prompt_id])))
            assert row.input_ids[start : start + len(s.output_ids)] == s.output_ids
            mask[start : start + len(s.output_ids)] = [1] * len(s.output_ids)
        assert row.loss_mask == mask and row.input_ids[-1] == IM_END_ID
    return token_rows


def test_the_bundled_tool_calling_sets_regenerate_in_both_forms(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer
) -> None:
    """The demo's OpenAI and ShareGPT tool-calling conversations, loaded as a run loads them, regenerate exactly."""
    sources = [PromptSource(path=str(REPO_ROOT / "data/prompts" / name)) for name in BUNDLED]
    prompts = [p for p in iter_prompts(sources) if isinstance(p, Prompt)]
    assert len(prompts) == 26
    layout = RunLayout(tmp_path / "run")
    layout.shards_dir.mkdir(parents=True)
    layout.shard_prompts(0).write_text("".join(p.to_json() + "\n" for p in prompts))
    with box(model_dir, STANDIN) as eps:
        d = make_dispatcher(eps)
        try:
            result = generate_shard(0, layout, d, chat, TURNS_SPEC, flush_interval_s=0.2)
        finally:
            d.close()
    steps, rejects = read_steps(layout, 0)
    assert result.n_prompts == len(prompts) and rejects == []
    outcomes = check_conversations(prompts, steps, rejects, chat)
    print("outcomes:", dict(outcomes), "steps:", len(steps))
    assert any(c.bridge_ids for c in steps)  # recorded results were spliced and a user turn continued
    assert len(check_rows(chat, prompts, steps, tmp_path / "stage")) >= len(prompts)


# Runs generate_shard in its own process against the test's stand-in; the fault point SIGKILLs it mid-run.
RUNNER = textwrap.dedent(
    """
    import json, sys
    from pathlib import Path
    from pydantic import SecretStr
    from datagen.chat import ChatTokenizer
    from datagen.engine.endpoints import ServerEndpoint
    from datagen.engine.dispatcher import Dispatcher
    from datagen.layout import RunLayout
    from datagen.runspec import RunSpec
    from tasks.generation import generate_shard

    args = json.loads(sys.argv[1])
    endpoint = ServerEndpoint("s0", args["url"], SecretStr(args["key"]), args["slots"])
    dispatcher = Dispatcher([endpoint], queue_depth=2, load_poll_interval_s=0.2, stall_timeout_s=60)
    assert dispatcher.wait_ready(30)
    spec = RunSpec.model_validate(args["spec"])
    generate_shard(0, RunLayout(Path(args["root"])), dispatcher, ChatTokenizer.from_model_dir(args["model"]), spec)
    dispatcher.close()
    """
)


def _run_killed(layout: RunLayout, ep: ServerEndpoint, model_dir: Path, kill_after: int) -> None:
    """Run the shard in a process of its own, SIGKILLed at the `kill_after`-th line of an unfinished conversation."""
    args = {
        "url": ep.url,
        "key": ep.api_key.get_secret_value() if ep.api_key else "",
        "slots": ep.max_running_requests,
        "spec": TURNS_SPEC.model_dump(mode="json"),
        "root": str(layout.root),
        "model": str(model_dir),
    }
    env = {**os.environ, KILL_AT_ENV: "generate.mid-conversation", KILL_AFTER_ENV: str(kill_after)}
    proc = subprocess.run(
        [sys.executable, "-c", RUNNER, json.dumps(args)], cwd=REPO_ROOT, env=env, capture_output=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr.decode()[-3000:]  # SIGKILLed at the fault point, not failed


def _outputs(layout: RunLayout) -> dict[str, list[int]]:
    return {c.request_key: c.output_ids for c in read_steps(layout, 0)[0]}


def test_a_kill_mid_conversation_then_a_rerun_generates_every_step_once(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer
) -> None:
    clean, killed = RunLayout(tmp_path / "clean"), RunLayout(tmp_path / "killed")
    prompts = write_conversations(clean, 0, 15)
    write_conversations(killed, 0, 15)
    # One server, so each step's output depends on its prompt alone (same ids, same output), in both runs.
    with box(model_dir, {**STANDIN, "DATAGEN_STANDIN_MAX_RUNNING": "4"}) as (ep,):
        d = make_dispatcher([ep])
        try:
            generate_shard(0, clean, d, chat, TURNS_SPEC, flush_interval_s=0.2)
        finally:
            d.close()
        _run_killed(killed, ep, model_dir, kill_after=6)
        before, _ = read_steps(killed, 0)
        # Killed mid-conversation: some conversation's last written step is not its last.
        last_written = {c.prompt_id: c for c in before}  # lines of a conversation are written in step order
        assert any(c.outcome is None for c in last_written.values())
        assert unsettled_requests(0, killed, chat, TURNS_SPEC) > 0
        d = make_dispatcher([ep])
        try:
            served = requests_served(ep)
            resumed = generate_shard(0, killed, d, chat, TURNS_SPEC, flush_interval_s=0.2)
            sent = requests_served(ep) - served
        finally:
            d.close()
    steps, rejects = read_steps(killed, 0)
    check_conversations(prompts, steps, rejects, chat)
    # The first attempt's lines stay as they were; the rerun wrote only the steps after them.
    assert [c.to_json() for c in steps[: len(before)]] == [c.to_json() for c in before]
    assert resumed.n_sent == sent == len(steps) - len(before)
    print(f"killed after {len(before)} step lines; the rerun sent {sent} steps, {len(steps)} in all")
    # Every step of the clean run, with the same output, and no other.
    assert _outputs(killed) == _outputs(clean)
    assert [r.request_key for r in rejects] == [r.request_key for r in read_steps(clean, 0)[1]]


@pytest.mark.parametrize(("turns", "other"), [("every", "last"), ("last", "every")])
def test_a_checkpoint_of_another_mode_is_refused(turns: str, other: str, tmp_path: Path, chat: ChatTokenizer) -> None:
    """A line of the other mode (a `last` key in an every-turn shard, a step in a `last` one), or a line written
    twice: a clear error, from the one ledger both modes read, before anything is sent."""
    spec = TURNS_SPEC.model_copy(update={"turns": turns})
    layout = RunLayout(tmp_path)
    prompts = write_conversations(layout, 0, 2)
    key = RequestKeys(spec.sampling, chat)(prompts[0].prompt_id)
    other_key = turn_mode(spec.model_copy(update={"turns": other})).step_key(key, 0)  # `<key>` or `<key>:step-0`
    assert other_key != turn_mode(spec).step_key(key, 0)
    line = Completion(prompts[0].prompt_id, "conv", 0, [], other_key, 1, [IM_END_ID], "", "stop", 1)
    layout.shard_completions(0).write_text(line.to_json() + "\n")
    with pytest.raises(CheckpointError, match="1 lines that are no step of a conversation of this shard"):
        unsettled_requests(0, layout, chat, spec)
    line.request_key = turn_mode(spec).step_key(key, 0)
    layout.shard_completions(0).write_text(2 * (line.to_json() + "\n"))
    with pytest.raises(CheckpointError, match=r"step 0 of conversation .* after 1 step lines"):
        generate_shard(0, layout, None, chat, spec)
