"""Conversations published beside the token rows: SpecForge's schema, exact under the template, same bytes again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
import yaml

from datagen.chat import ChatTokenizer
from datagen.conversation.export import ConversationWriter, conversation_record, split_reasoning
from datagen.conversation.turn_mode import turn_mode
from datagen.publishing.storage import ObjectExists, ObjectStore
from datagen.records import Completion, Message, ToolCall
from tasks.publishing import CLAIM_NAME, publish
from tasks.tokenization import tokenize_accepted
from tests.conversation_fixtures import PublishedRun

pytestmark = pytest.mark.slow


def _completion(text: str, **kw: Any) -> Completion:
    return Completion(
        prompt_id="p1",
        source="s",
        row=0,
        messages=[Message(role="user", content=[{"type": "text", "text": "Hi "}, {"type": "text", "text": "there"}])],
        request_key="k",
        prompt_tokens=3,
        output_ids=[1, 2],
        text=text,
        finish_reason="stop",
        completion_tokens=2,
        **kw,
    )


@pytest.mark.parametrize(
    ("text", "thinking", "expected"),
    [
        ("plan\n</think>\n\nanswer", True, ("plan\n", "\n\nanswer")),  # neither side stripped, as SGLang's parser
        ("<think>plan</think>answer", True, ("plan", "answer")),
        ("still thinking", True, ("still thinking", "")),  # truncated inside its reasoning
        ("plan <tool_call>\n<function=f>", True, ("plan ", "<tool_call>\n<function=f>")),
        ("just an answer", False, (None, "just an answer")),
    ],
)
def test_split_reasoning_as_sglangs_qwen3_parser(text: str, thinking: bool, expected: tuple[str | None, str]) -> None:
    assert split_reasoning(text, thinking) == expected


def test_record_has_specforge_keys_and_arrow_safe_fields() -> None:
    """List content becomes its text; tools and call arguments are JSON text; only set keys appear."""
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    c = _completion(
        "r</think>\n\nok <tool_call>x</tool_call>", tools=tools, tool_calls=[ToolCall(name="f", arguments={"a": 1})]
    )
    rec = conversation_record([c], enable_thinking=True)
    assert list(rec) == ["id", "conversations", "tools"]
    assert json.loads(rec["tools"]) == tools
    user, turn = rec["conversations"]
    assert user == {"role": "user", "content": "Hi there"}
    assert turn == {
        "role": "assistant",
        "content": "\n\nok ",
        "reasoning_content": "r",
        # Issue 47.10: each generated call has an OpenAI id (`call_<step>_<i>`), which results would answer.
        "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}, "id": "call_0_0"}],
    }
    assert list(conversation_record([_completion("a</think>b")], True)) == ["id", "conversations"]


def test_writer_names_parts_like_the_data_files(tmp_path: Path) -> None:
    (tmp_path / "conversations").mkdir()
    (tmp_path / "conversations" / "conversations-00000-of-00009.jsonl").write_text("stale\n")
    writer = ConversationWriter(tmp_path, rows_per_file=2)
    for i in range(5):
        writer.write({"id": str(i), "conversations": []})
    files = writer.close()
    assert [f.name for f in files] == [f"conversations-0000{i}-of-00003.jsonl" for i in range(3)]
    assert sorted(p.name for p in (tmp_path / "conversations").iterdir()) == [f.name for f in files]
    assert [len(f.read_text().splitlines()) for f in files] == [2, 2, 1]


def _messages(turns: list[dict[str, Any]]) -> list[Message]:
    out = []
    for t in turns:
        t = dict(t)
        for call in t.get("tool_calls") or []:
            call["function"]["arguments"] = json.loads(call["function"]["arguments"])
        out.append(Message.from_dict(t))
    return out


def _lines(local: Path) -> list[dict[str, Any]]:
    files = sorted((local / "conversations").glob("conversations-*.jsonl"))
    return [json.loads(line) for f in files for line in f.read_text(encoding="utf-8").splitlines()]


def test_a_run_publishes_conversations_that_rerender_to_its_token_rows(published_run: PublishedRun) -> None:
    local = published_run.local
    manifest = json.loads((local / "manifest.json").read_text())
    listed = {o["key"] for o in manifest["objects"]}
    conv_keys = sorted(str(p.relative_to(local)) for p in (local / "conversations").glob("*.jsonl"))
    assert conv_keys and set(conv_keys) <= listed
    card = yaml.safe_load((local / "README.md").read_text().split("---\n")[1])
    assert {
        "config_name": "conversations",
        "data_files": [{"split": "train", "path": "conversations/conversations-*.jsonl"}],
    } in card["configs"]

    rows = pq.read_table(sorted((local / "data").glob("*.parquet"))).to_pylist()
    lines = _lines(local)
    assert [line["id"] for line in lines] == [r["conversation_id"] for r in rows]  # same rows, same order
    chat = ChatTokenizer.from_model_dir(published_run.model_dir)
    for line, row in zip(lines, rows, strict=True):
        assert row["conversation_id"] == row["prompt_id"] and row["num_loss_spans"] == 1
        assert row["span_finish_reasons"] == [row["finish_reason"]]
        messages = _messages(line["conversations"])
        assert row["turn_index"] == sum(m.role == "user" for m in messages) - 1
        turn = messages[-1]
        assert turn.role == "assistant" and turn.reasoning_content and turn.text
        prompt_ids = chat.encode(chat.render(messages[:-1], enable_thinking=True))
        assert row["input_ids"][: row["prompt_tokens"]] == prompt_ids  # the prompt as we sent it
        rendered = chat.render_conversation(messages, enable_thinking=True)
        assert rendered.endswith("<|im_end|>\n")  # the template closes the turn; the model's turn ends at <|im_end|>
        assert chat.encode(rendered[:-1]) == row["input_ids"]


class _StopAfter:
    """An ObjectStore whose writes fail after `n` of them: a publish interrupted part way."""

    def __init__(self, store: ObjectStore, n: int) -> None:
        self.store, self.left = store, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self.store, name)

    def put_if_absent(self, key: str, data: bytes | Path, sha256: str | None = None, metadata: Any = None) -> Any:
        if self.left <= 0:
            raise ConnectionError(f"interrupted before {key}")
        self.left -= 1
        return self.store.put_if_absent(key, data, sha256, metadata)


def _restage(published_run: PublishedRun, staging: Path) -> Path:
    """Tokenize the run's accepted completions again, as a re-run of the stage would."""
    layout_root = published_run.work_dir / "runs" / published_run.spec.namespace
    accepted = sorted((layout_root / "validated").glob("*accepted*.jsonl"))
    assert accepted, f"no accepted completions under {layout_root / 'validated'}"
    chat = ChatTokenizer.from_model_dir(published_run.model_dir)
    tokenize_accepted(accepted, staging, chat, enable_thinking=True, turns=turn_mode(published_run.spec))
    return staging


def test_an_interrupted_publish_rerun_republishes_identical_conversation_bytes(
    published_run: PublishedRun,
    tmp_path: Path,
) -> None:
    first = _restage(published_run, tmp_path / "first")
    published = {p.name: p.read_bytes() for p in (published_run.local / "conversations").glob("*.jsonl")}
    assert published, "the run published no conversations"
    assert {p.name: p.read_bytes() for p in (first / "conversations").glob("*.jsonl")} == published

    store = published_run.store
    with pytest.raises(ConnectionError, match="interrupted"):
        publish(first, "conv_resume", _StopAfter(store, 3), {"pipeline_version": "test"}, workers=1)  # type: ignore[arg-type]
    before = {o.key for o in store.list("conv_resume/")}
    assert f"conv_resume/{CLAIM_NAME}" in before and len(before) == 3
    assert any(k.startswith("conv_resume/conversations/") for k in before)  # interrupted after a conversation file

    again = _restage(published_run, tmp_path / "again")  # the re-run: a fresh tokenization, then publish
    result = publish(again, "conv_resume", store, {"pipeline_version": "test"})
    assert sorted(result.skipped) == sorted(before)  # what the first attempt wrote had the same bytes
    resumed = {Path(o.key).name: store.get_bytes(o.key) for o in store.list("conv_resume/conversations/")}
    assert resumed == published


def test_objectexists_is_what_a_changed_conversation_file_meets(published_run: PublishedRun, tmp_path: Path) -> None:
    """Never-overwrite holds for conversations: different bytes under a published key are refused."""
    key = next(o.key for o in published_run.store.list("conv_v1/conversations/"))
    with pytest.raises(ObjectExists):
        published_run.store.put_if_absent(key, b'{"id": "other"}\n')
    assert published_run.store.get_bytes(key) == (published_run.local / key.split("/", 1)[1]).read_bytes()
