"""The checkpoint format's one torn-line policy, through every reader, and the typed message's JSON round trip.

Policy (datagen/checkpoint.py): bytes after the last newline are a write a crash cut short: every reader skips
them, the writer cuts them off before it appends; a complete line that is not a JSON object is an error.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from datagen.chat import ChatTokenizer
from datagen.checkpoint import (
    CheckpointAppender,
    CheckpointError,
    CheckpointTail,
    lines_of,
    read_lines,
    read_rows,
    repair,
    settled_keys,
    summarize,
)
from datagen.checks.quality import ValidationSummary
from datagen.conversation.turn_mode import LastTurn
from datagen.conversation.turn_stats import StepTail
from datagen.identity import RequestKeys, prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations import report
from datagen.records import Completion, Message, Prompt, Reject, ToolCall
from datagen.runspec import PromptSource, RunSpec
from tasks.pilot import PilotPopulation, PilotSpec, import_pilot, project
from tasks.planning import ShardPlan, plan_shards
from tasks.selection import SelectionReport
from tasks.tokenization import StreamingTokenizer
from tasks.validation import Completion as ValidatedCompletion
from tasks.validation import MalformedRecord, count_reject_reasons, iter_in_plan_order, iter_jsonl_completions


def completion(i: int, key: str | None = None, source: str = "s") -> Completion:
    messages = [Message(role="user", content=f"question {i}")]
    pid = prompt_id_from_messages(source, messages)
    return Completion(
        prompt_id=pid,
        source=source,
        row=i,
        messages=messages,
        request_key=key or f"rk-{i}",
        prompt_tokens=10,
        output_ids=[1, 2, 3],
        text="abc",
        finish_reason="stop",
        completion_tokens=3 + i,
        meta={"plan_index": i},
    )


def reject(i: int) -> Reject:
    return Reject(stage="generate", reason="server_rejected", detail="400", source="s", row=i, request_key=f"rj-{i}")


def torn(path: Path, lines: list[str]) -> Path:
    """The lines, then half of one more without its newline: what a crash mid-write leaves."""
    path.parent.mkdir(parents=True, exist_ok=True)
    half = lines[-1][: len(lines[-1]) // 2]
    path.write_text("".join(line + "\n" for line in lines[:-1]) + half, encoding="utf-8")
    return path


def test_ledger_skips_a_torn_tail_and_a_corrupt_line_is_an_error(tmp_path: Path) -> None:
    path = torn(tmp_path / "c.jsonl", [completion(i).to_json() for i in range(3)])
    assert settled_keys(path, "completion") == {"rk-0", "rk-1"}
    # Even a complete JSON object is not a record without its newline.
    path.write_text(completion(0).to_json() + "\n" + completion(1).to_json(), encoding="utf-8")
    assert settled_keys(path, "completion") == {"rk-0"}
    path.write_text(completion(0).to_json() + "\n{not json\n" + completion(1).to_json() + "\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"c\.jsonl:2: not a JSON object"):
        settled_keys(path, "completion")


def test_the_writer_cuts_a_torn_tail_before_it_appends(tmp_path: Path) -> None:
    path = torn(tmp_path / "c.jsonl", [completion(i).to_json() for i in range(3)])
    appender = CheckpointAppender(path, interval_s=60)
    appender.write(completion(5).to_json())
    appender.close()
    assert [r["request_key"] for r in read_rows(path)] == ["rk-0", "rk-1", "rk-5"]
    assert path.read_bytes().endswith(b"\n") and repair(path) == 0
    rows, tokens, _ = summarize(path)
    assert (rows, tokens) == (3, 3 + 4 + 8)


def test_validation_and_tokenization_readers_skip_a_torn_tail(tmp_path: Path) -> None:
    completions = torn(tmp_path / "shard-00000.completions.jsonl", [completion(i).to_json() for i in (2, 0, 1)])
    items = list(iter_jsonl_completions(completions))
    assert [(n, c.row) for n, c in items if isinstance(c, ValidatedCompletion)] == [(1, 2), (2, 0)]
    assert len(items) == 2  # before: the torn half line became a malformed_record reject of a request never settled
    assert [c.row for _, c in iter_in_plan_order(completions, LastTurn()) if isinstance(c, ValidatedCompletion)] == [
        0,
        2,
    ]
    assert report.completion_lengths([completions]) == [5, 3]

    rejects = torn(tmp_path / "shard-00000.rejects.jsonl", [reject(i).to_json() for i in range(3)])
    assert count_reject_reasons([rejects]) == {"generate/server_rejected": 2}
    tokenizer = StreamingTokenizer(
        tmp_path / "staging", ChatTokenizer.shared(ensure_model_dir()), True, turns=LastTurn()
    )
    tokenizer.add_rejects(rejects)
    assert tokenizer.close().rejects_by_reason == {"generate/server_rejected": 2}


def test_pilot_projection_skips_a_torn_tail(tmp_path: Path) -> None:
    layout = RunLayout(tmp_path / "pilot")
    torn(layout.shard_completions(0), [completion(i).to_json() for i in range(3)])
    torn(layout.shard_rejects(0), [reject(i).to_json() for i in range(2)])
    plan = ShardPlan.model_construct(shard_ids=[0])
    population = PilotPopulation(population_by_source={"s": 3}, sample_by_source={"s": 3}, selection=SelectionReport())
    throughput = {"aggregate_tokens_per_s": 100.0, "servers": 1}
    projection = project(layout, plan, population, ValidationSummary(), throughput, 1, PilotSpec(), turns=LastTurn())
    # Two completions (3 and 4 tokens) and one generation reject were committed; the torn halves are not rows.
    assert projection.output_tokens["pilot_total"] == 7
    assert projection.output_tokens["by_source"]["s"]["sampled"] == 3


def test_pilot_import_appends_to_a_torn_main_checkpoint_instead_of_skipping_the_shard(tmp_path: Path) -> None:
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"instruction": f"question {i}"}) + "\n" for i in range(4)))
    spec = RunSpec(
        sources=[PromptSource(path=str(prompts))], shard_size=4, model_path=str(ensure_model_dir()), turns="last"
    )
    chat = ChatTokenizer.shared(spec.model_path)
    pilot_layout, main_layout = RunLayout(tmp_path / "pilot"), RunLayout(tmp_path / "main")
    plan = plan_shards(spec, main_layout)
    key_of = RequestKeys(spec.sampling, chat)
    planned = [Prompt.from_json(line) for line in main_layout.shard_prompts(0).read_text().splitlines()]
    keys = [key_of(p.prompt_id) for p in planned]
    pilot_layout.shards_dir.mkdir(parents=True)
    pilot_layout.shard_completions(0).write_text("".join(completion(i, keys[i]).to_json() + "\n" for i in (1, 2)))
    # The main run crashed mid-write after settling prompt 0.
    torn(main_layout.shard_completions(0), [completion(0, keys[0]).to_json(), completion(3, keys[3]).to_json()])

    result = import_pilot(pilot_layout, main_layout, plan, spec, chat)

    assert result.imported_completions == 2  # before: the shard was skipped whole (shards_skipped=[0])
    assert settled_keys(main_layout.shard_completions(0), "completion") == {keys[0], keys[1], keys[2]}


def test_message_json_round_trip_and_old_files_load_unchanged() -> None:
    old_line = (
        '{"prompt_id": "p", "source": "s", "row": 0, "messages": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "Hi"}], "category": null, "location": "f.jsonl:1"}'
    )
    prompt = Prompt.from_json(old_line)
    assert prompt.messages == [Message(role="system", content="Be brief."), Message(role="user", content="Hi")]
    assert prompt.to_json() == old_line  # byte for byte: planned shard files and their checksums stay the same
    turn = Message(
        role="assistant",
        content=[{"type": "text", "text": "Let me "}, {"type": "text", "text": "check."}],
        reasoning_content="The user wants the weather.",
        tool_calls=(ToolCall(name="weather", arguments={"city": "Paris"}, id="call_1"),),
    )
    result = Message(role="tool", content='{"temp": 21}', tool_call_id="call_1", name="weather")
    for m in (turn, result):
        assert Message.from_dict(json.loads(json.dumps(m.to_dict()))) == m
    assert turn.text == "Let me check."
    assert turn.to_dict()["tool_calls"] == [
        {"type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}, "id": "call_1"}
    ]
    c = completion(0)
    c.messages = [Message(role="user", content="q"), turn, result, Message(role="user", content="and tomorrow?")]
    assert Completion.from_json(c.to_json()) == c
    with pytest.raises(ValueError, match="role"):
        Message.from_dict({"role": "critic", "content": "?"})


def test_a_completion_whose_messages_are_not_messages_is_a_malformed_record(tmp_path: Path) -> None:
    row = json.loads(completion(0).to_json())
    row["messages"] = [{"role": "critic", "content": "?"}]
    path = tmp_path / "shard-00000.completions.jsonl"
    path.write_text(completion(1).to_json() + "\n" + json.dumps(row) + "\n")
    items = [item for _, item in iter_jsonl_completions(path)]
    assert isinstance(items[0], ValidatedCompletion)
    assert isinstance(items[1], MalformedRecord) and "role" in str(items[1])


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full for a real ENOSPC")
def test_a_full_disk_names_the_checkpoint_and_what_to_do(tmp_path: Path) -> None:
    # A full disk's write error names no file ("[Errno 28] No space left on device"): the task's failure in the
    # UI must say which checkpoint and what to do. /dev/full gives the kernel's own ENOSPC on every write.
    import errno
    import os

    path = tmp_path / "shards" / "shard-00000.completions.jsonl"
    appender = CheckpointAppender(path, interval_s=60.0)
    full = os.open("/dev/full", os.O_WRONLY)
    try:
        os.dup2(full, appender._f.fileno())  # the appender's own descriptor now writes to a full device
        with pytest.raises(OSError) as raised:
            appender.write('{"request_key": "k"}')
    finally:
        os.close(full)
    assert raised.value.errno == errno.ENOSPC
    assert str(path) in str(raised.value) and "DATAGEN_WORK_DIR" in str(raised.value), str(raised.value)


def test_lines_end_at_a_newline_only_so_a_record_may_hold_line_separators(tmp_path: Path) -> None:
    # ensure_ascii=False writes these characters raw; str.splitlines would cut the record at each of them.
    odd = json.dumps({"request_key": "k", "text": "a\u2028b\u2029c\x85d\x1ce\rf"}, ensure_ascii=False)
    data = (odd + "\n\n" + odd[:9]).encode("utf-8")
    path = tmp_path / "c.jsonl"
    path.write_bytes(data)
    assert [(x.lineno, x.text) for x in read_lines(path)] == [(1, odd)]
    assert [(x.lineno, x.text) for x in lines_of(data, "s3://b/part.jsonl")] == [(1, odd)]
    path.write_bytes(b"{}\n\xff\xfe\n")
    with pytest.raises(CheckpointError, match=r"c\.jsonl:2: not UTF-8"):
        list(read_lines(path))


def test_a_tail_returns_each_committed_line_once_and_waits_for_a_line_in_progress(tmp_path: Path) -> None:
    path = tmp_path / "c.jsonl"
    tail = CheckpointTail(path)
    assert tail.read() == []  # no file yet
    first, second = completion(0).to_json(), completion(1).to_json()
    path.write_text(first + "\n\n" + second[:7], encoding="utf-8")
    assert [(x.lineno, x.offset, x.text) for x in tail.read()] == [(1, 0, first)]
    assert tail.read() == []  # the line being written waits
    with open(path, "a", encoding="utf-8") as f:
        f.write(second[7:] + "\n")
    (line,) = tail.read()
    assert (line.lineno, line.offset, line.text) == (3, len(first) + 2, second)
    assert line.row(path)["request_key"] == "rk-1"


def test_the_live_step_count_names_a_corrupt_line_instead_of_skipping_it(tmp_path: Path) -> None:
    path = tmp_path / "shard-00000.completions.jsonl"
    path.write_text(completion(0).to_json() + "\n{not json\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"shard-00000\.completions\.jsonl:2: not a JSON object"):
        StepTail([path], [], planned=1).poll()


def test_a_reject_line_that_is_not_json_is_named_by_every_reject_reader(tmp_path: Path) -> None:
    rejects = tmp_path / "shard-00000.rejects.jsonl"
    rejects.write_text(reject(0).to_json() + "\nnot json\n", encoding="utf-8")
    with pytest.raises(CheckpointError, match=r"rejects\.jsonl:2: not a JSON object"):
        count_reject_reasons([rejects])
    tokenizer = StreamingTokenizer(
        tmp_path / "staging", ChatTokenizer.shared(ensure_model_dir()), True, turns=LastTurn()
    )
    with pytest.raises(CheckpointError, match=r"rejects\.jsonl:2: not a JSON object"):
        tokenizer.add_rejects(rejects)
