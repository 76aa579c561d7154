"""`turns: every` generation end to end: multi-turn tool-calling conversations against stand-in servers over HTTP.

The stand-in (its own process) answers a prompt that declares tools with a call of the first declared function
half the time, so conversations take every path: recorded results spliced after a matching call and the user turn
continued token-exact, calls where the row answered in words, words where it called, other functions, other
counts. The lines then go through the real validation and tokenization, and every row is compared with the real
template's `apply_chat_template(..., tools=...)` of the regenerated conversation. A SIGKILL mid-conversation and a
rerun generate every step exactly once: the same steps, with the same outputs, as a run that was never killed.
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.checkpoint import CheckpointError
from datagen.conversation.export import assistant_turn
from datagen.conversation.regeneration import OUTCOMES, split_step_key
from datagen.conversation.turn_mode import turn_mode
from datagen.engine.endpoints import ServerEndpoint
from datagen.identity import RequestKeys, prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations.faults import KILL_AFTER_ENV, KILL_AT_ENV
from datagen.records import Completion, Message, Prompt, Reject, TokenRow
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from datagen.sources.prompts import iter_prompts
from tasks.generation import generate_shard, unsettled_requests
from tests.e2e.test_generation import box, make_dispatcher, requests_served, rows
from tests.turn_fixtures import stage_steps, template_ids

REPO_ROOT = Path(__file__).resolve().parents[2]
SPEC = RunSpec(model_path="unused", sampling=SamplingSpec(max_new_tokens=320), context_length=8192, turns="every")
BUNDLED = ("tool_calls_openai.jsonl", "tool_calls_sharegpt.jsonl")
STANDIN = {"DATAGEN_STANDIN_LENGTH_MEAN": "100", "DATAGEN_STANDIN_LENGTH_MAX": "200"}


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_model_dir()


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(model_dir)


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
    key_of = RequestKeys(SPEC.sampling, chat)
    keys = [c.request_key for c in steps] + [str(r.request_key) for r in rejects]
    assert len(keys) == len(set(keys))
    by_conversation: dict[str, list[Completion]] = collections.defaultdict(list)
    for c in steps:
        by_conversation[c.prompt_id].append(c)
    rejected = {r.prompt_id: r for r in rejects}
    outcomes: collections.Counter[str] = collections.Counter()
    for prompt in prompts:
        mine = sorted(by_conversation[prompt.prompt_id], key=lambda c: c.step or 0)
        assert [split_step_key(c.request_key) for c in mine] == [
            (key_of(prompt.prompt_id), n) for n in range(len(mine))
        ]
        ended = [c.outcome for c in mine if c.outcome is not None]
        if prompt.prompt_id in rejected:
            assert ended == [] and rejected[prompt.prompt_id].request_key.endswith(f":step-{len(mine)}")
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
            assert unsettled_requests(0, layout, chat, SPEC) == 20
            result = generate_shard(0, layout, d, chat, SPEC, flush_interval_s=0.2)
            served = [requests_served(ep) for ep in eps]
            again = generate_shard(0, layout, d, chat, SPEC, flush_interval_s=0.2)
            assert [requests_served(ep) for ep in eps] == served  # settled: nothing sent again
            assert unsettled_requests(0, layout, chat, SPEC) == 0
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
            result = generate_shard(0, layout, d, chat, SPEC, flush_interval_s=0.2)
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
        "spec": SPEC.model_dump(mode="json"),
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
            generate_shard(0, clean, d, chat, SPEC, flush_interval_s=0.2)
        finally:
            d.close()
        _run_killed(killed, ep, model_dir, kill_after=6)
        before, _ = read_steps(killed, 0)
        # Killed mid-conversation: some conversation's last written step is not its last.
        last_written = {c.prompt_id: c for c in before}  # lines of a conversation are written in step order
        assert any(c.outcome is None for c in last_written.values())
        assert unsettled_requests(0, killed, chat, SPEC) > 0
        d = make_dispatcher([ep])
        try:
            served = requests_served(ep)
            resumed = generate_shard(0, killed, d, chat, SPEC, flush_interval_s=0.2)
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


@pytest.mark.parametrize(("turns", "other_form"), [("every", "{key}"), ("last", "{key}:step-0")])
def test_a_checkpoint_of_another_mode_is_refused(
    turns: str, other_form: str, tmp_path: Path, chat: ChatTokenizer
) -> None:
    """A line of the other mode (a `last` key in an every-turn shard, a step in a `last` one), or a line written
    twice: a clear error, from the one ledger both modes read, before anything is sent."""
    spec = SPEC.model_copy(update={"turns": turns})
    layout = RunLayout(tmp_path)
    prompts = write_conversations(layout, 0, 2)
    key = RequestKeys(spec.sampling, chat)(prompts[0].prompt_id)
    line = Completion(prompts[0].prompt_id, "conv", 0, [], other_form.format(key=key), 1, [IM_END_ID], "", "stop", 1)
    layout.shard_completions(0).write_text(line.to_json() + "\n")
    with pytest.raises(CheckpointError, match="1 lines that are no step of a conversation of this shard"):
        unsettled_requests(0, layout, chat, spec)
    line.request_key = turn_mode(spec).step_key(key, 0)
    layout.shard_completions(0).write_text(2 * (line.to_json() + "\n"))
    with pytest.raises(CheckpointError, match=r"step 0 of conversation .* after 1 step lines"):
        generate_shard(0, layout, None, chat, spec)
