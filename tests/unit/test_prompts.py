"""Prompt sources: formats, auto-detection, row-exact rejects, parquet, `datasets`, duplicates, stable ids."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import datagen.sources.prompts as prompts_mod
from datagen.identity import prompt_id_from_messages
from datagen.records import Message, Prompt, Reject
from datagen.runspec import PromptSource
from datagen.sources.prompts import LOAD_REJECT_REASONS, PromptSourceError, iter_prompts

REPO = Path(__file__).resolve().parents[2]


def dicts(messages: list[Message]) -> list[dict[str, Any]]:
    """Messages in their JSON form, to compare with what a row held."""
    return [m.to_dict() for m in messages]


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows), encoding="utf-8")
    return path


def load(path: Path | str, **kw: Any) -> tuple[list[Prompt], list[Reject]]:
    items = list(iter_prompts([PromptSource(path=str(path), **kw)]))
    return [i for i in items if isinstance(i, Prompt)], [i for i in items if isinstance(i, Reject)]


def sg(*turns: tuple[str, str], **extra: Any) -> dict[str, Any]:
    return {"conversations": [{"from": f, "value": v} for f, v in turns], **extra}


def oa(*turns: tuple[str, Any], **extra: Any) -> dict[str, Any]:
    return {"messages": [{"role": r, "content": c} for r, c in turns], **extra}


# ----------------------------------------------------------------------------------------------- formats


def test_sharegpt_roles_trailing_reply_dropped_system_and_history_kept(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "chat.jsonl",
        [
            sg(("human", "Hi there"), ("gpt", "OK.")),
            sg(("system", "Be brief."), ("user", "Q1"), ("chatgpt", "A1"), ("human", "Q2")),
            sg(("Human", "Q"), ("model", "A"), ("user", "Q again"), ("assistant", "dropped")),
        ],
    )
    prompts, rejects = load(f)
    assert rejects == []
    assert [dicts(p.messages) for p in prompts] == [
        [{"role": "user", "content": "Hi there"}],
        [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Q1"},
            {"role": "assistant", "content": "A1"},
            {"role": "user", "content": "Q2"},
        ],
        [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "A"},
            {"role": "user", "content": "Q again"},
        ],
    ]
    assert [(p.source, p.row) for p in prompts] == [("chat", 0), ("chat", 1), ("chat", 2)]


def test_sharegpt_accepts_role_content_keys(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "c.jsonl", [{"conversations": [{"role": "user", "content": "Hello"}]}])
    prompts, rejects = load(f)
    assert rejects == []
    assert dicts(prompts[0].messages) == [{"role": "user", "content": "Hello"}]


def test_openai_text_parts_joined_and_non_text_parts_rejected(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "oa.jsonl",
        [
            oa(
                ("developer", "Sys"),
                ("user", [{"type": "text", "text": "Part one. "}, {"type": "text", "text": "Two"}]),
            ),
            oa(("user", [{"type": "text", "text": "Look:"}, {"type": "image_url", "image_url": {"url": "x"}}])),
            oa(("user", "Plain"), ("assistant", None)),
        ],
    )
    prompts, rejects = load(f)
    assert [dicts(p.messages) for p in prompts] == [
        [{"role": "system", "content": "Sys"}, {"role": "user", "content": "Part one. Two"}],
        [{"role": "user", "content": "Plain"}],  # the dropped trailing reply may be anything, even null
    ]
    assert [(r.reason, r.row) for r in rejects] == [("non_text_content", 1)]
    assert rejects[0].detail == f"{f}:2: messages[0].content[1] is a 'image_url' part; only text is supported"


def test_alpaca_instruction_input_system_output_ignored(tmp_path: Path) -> None:
    f = tmp_path / "alpaca.json"
    f.write_text(
        json.dumps(
            [
                {"instruction": "Translate to French.", "input": "Good morning", "output": "Bonjour"},
                {"instruction": "Name a colour.", "input": "", "output": "Red"},
                {"instruction": "Summarize.", "input": "Text.", "system": "You are terse."},
            ],
            indent=2,
        ),
        encoding="utf-8",
    )
    prompts, rejects = load(f)
    assert rejects == []
    assert [dicts(p.messages) for p in prompts] == [
        [{"role": "user", "content": "Translate to French.\n\nGood morning"}],
        [{"role": "user", "content": "Name a colour."}],
        [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Summarize.\n\nText."}],
    ]


def test_auto_detects_per_row_and_explicit_format_is_enforced(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "mixed.jsonl",
        [sg(("human", "from sharegpt")), oa(("user", "from openai")), {"instruction": "from alpaca"}],
    )
    prompts, rejects = load(f)
    assert rejects == []
    assert [p.messages[0].content for p in prompts] == ["from sharegpt", "from openai", "from alpaca"]

    prompts, rejects = load(f, format="openai")
    assert [p.messages[0].content for p in prompts] == ["from openai"]
    assert [(r.reason, r.row, r.detail) for r in rejects] == [
        ("missing_field", 0, f"{f}:1: no 'messages' field"),
        ("missing_field", 2, f"{f}:3: no 'messages' field"),
    ]


def test_same_conversation_in_any_format_gets_the_same_id(tmp_path: Path) -> None:
    conv = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    a = write_jsonl(tmp_path / "a.jsonl", [sg(("system", "S"), ("human", "U"))])
    b = write_jsonl(tmp_path / "b.jsonl", [oa(("system", "S"), ("user", "U"))])
    c = tmp_path / "c.json"
    c.write_text(json.dumps([{"system": "S", "instruction": "U"}]), encoding="utf-8")
    ids = [load(p, name="same")[0][0].prompt_id for p in (a, b, c)]
    assert ids == [prompt_id_from_messages("same", conv)] * 3


# ----------------------------------------------------------------------------------------------- bad rows


def test_malformed_rows_are_rejected_with_exact_lines_and_good_rows_survive(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "bad.jsonl",
        [
            sg(("human", "good 0")),  # line 1
            '{"conversations": [',  # line 2
            "",  # line 3: blank, not a row
            sg(("human", "good 1")),  # line 4
            {"conversations": []},  # line 5
            {"conversations": [{"from": "human"}]},  # line 6
            {"conversations": "hello"},  # line 7
            sg(("human", "   ")),  # line 8
            sg(("human", "a"), ("system", "late")),  # line 9
            sg(("system", "a"), ("system", "b"), ("human", "c")),  # line 10
            sg(
                ("human", "call it"), ("function_call", "{}"), ("observation", "42"), ("human", "and?")
            ),  # line 11: no name
            oa(("user", "q"), ("tool", "r"), ("user", "q2")),  # line 12: a result of no call
            sg(("human", "q"), ("gpt", "a"), ("gpt", "b")),  # line 13
            sg(("system", "only system")),  # line 14
            sg(("human", "q"), ("wizard", "a"), ("human", "q")),  # line 15
            ["not", "an", "object"],  # line 16
            {"text": "no known fields"},  # line 17
            sg(("human", "q"), ("gpt", ""), ("human", "q2")),  # line 18
            sg(("human", "good 2")),  # line 19
        ],
    )
    prompts, rejects = load(f)
    assert [(p.messages[0].content, p.row) for p in prompts] == [("good 0", 0), ("good 1", 2), ("good 2", 17)]
    got = [(r.reason, r.row, r.detail.split(": ", 1)[0]) for r in rejects]
    assert got == [
        ("invalid_json", 1, f"{f}:2"),
        ("empty_conversation", 3, f"{f}:5"),
        ("missing_field", 4, f"{f}:6"),
        ("wrong_type", 5, f"{f}:7"),
        ("empty_user_content", 6, f"{f}:8"),
        ("system_not_first", 7, f"{f}:9"),
        ("multiple_system", 8, f"{f}:10"),
        ("bad_tool_call", 9, f"{f}:11"),
        ("bad_tool_turn", 10, f"{f}:12"),
        ("last_turn_not_user", 11, f"{f}:13"),
        ("no_user_turn", 12, f"{f}:14"),
        ("unknown_role", 13, f"{f}:15"),
        ("not_an_object", 14, f"{f}:16"),
        ("unknown_format", 15, f"{f}:17"),
        ("empty_assistant_content", 16, f"{f}:18"),
    ]
    assert all(r.stage == "load" and r.source == "bad" and r.reason in LOAD_REJECT_REASONS for r in rejects)
    by_line = {r.detail.split(": ", 1)[0]: r.detail.split(": ", 1)[1] for r in rejects}
    assert by_line[f"{f}:6"] == "conversations[0] has no 'value'"
    assert by_line[f"{f}:7"] == "'conversations' must be a list of turns, got str"
    assert by_line[f"{f}:11"] == "conversations[1].value has no function name"
    assert by_line[f"{f}:12"] == "messages[1].content: a tool result that follows no assistant tool call"
    assert by_line[f"{f}:13"] == "after dropping one trailing assistant reply the last turn is 'assistant'"


def test_invalid_utf8_line_is_rejected(tmp_path: Path) -> None:
    f = tmp_path / "enc.jsonl"
    f.write_bytes(b'{"instruction": "ok"}\n{"instruction": "\xff\xfe"}\n{"instruction": "ok too"}\n')
    prompts, rejects = load(f)
    assert [p.messages[0].content for p in prompts] == ["ok", "ok too"]
    assert [(r.reason, r.row) for r in rejects] == [("invalid_utf8", 1)]
    assert rejects[0].detail.startswith(f"{f}:2: line is not UTF-8")


def test_json_list_reports_line_of_each_bad_row(tmp_path: Path) -> None:
    f = tmp_path / "list.json"
    rows = [{"instruction": "first"}, {"instruction": 7}, {"instruction": "third"}]
    f.write_text(json.dumps(rows, indent=2), encoding="utf-8")  # each row spans 3 lines, starting on line 2
    prompts, rejects = load(f)
    assert [p.row for p in prompts] == [0, 2]
    assert [(r.reason, r.row, r.detail) for r in rejects] == [
        ("wrong_type", 1, f"{f}:5: 'instruction' must be a string, got int"),
    ]


def test_broken_json_list_row_is_one_reject_and_rows_after_it_survive(tmp_path: Path) -> None:
    # Issue 13.1: a syntax error inside one element used to end the file there, dropping every later row.
    f = tmp_path / "broken.json"
    f.write_text(
        '[\n{"instruction": "a"},\n{"instruction": "b"},\n{"instruction": "c" oops},\n'
        '{"instruction": "d", "input": "[{,"},\n{"instruction": "unterminated},\n{"instruction": "e"}\n]\n'
    )
    prompts, rejects = load(f)
    assert [(p.messages[0].content, p.row) for p in prompts] == [("a", 0), ("b", 1), ("d\n\n[{,", 3), ("e", 5)]
    assert [(r.reason, r.row, r.detail.split(": ")[0]) for r in rejects] == [
        ("invalid_json", 2, f"{f}:4"),
        ("invalid_json", 4, f"{f}:6"),
    ]
    assert "invalid JSON at line 4" in rejects[0].detail


def test_json_list_missing_comma_between_rows_loses_nothing(tmp_path: Path) -> None:
    f = tmp_path / "nocomma.json"
    f.write_text('[{"instruction": "a"} {"instruction": "b"}, {"instruction": "c"}]')
    prompts, rejects = load(f)
    assert [p.messages[0].content for p in prompts] == ["a", "b", "c"]
    assert rejects == []


def test_json_list_unreadable_past_a_point_fails_loudly_with_rows_lost(tmp_path: Path) -> None:
    # One line, a quote missing: nothing after it can be told apart, so the source fails unless partial reads
    # are allowed, and then every row counted in the unreadable rest is a reject (the gate counts them).
    f = tmp_path / "minified.json"
    f.write_text('[{"instruction": "a"}, {"instruction": "b}, {"instruction": "c"}, {"instruction": "d"}, {"x": 1')
    with pytest.raises(
        PromptSourceError, match=r"minified\.json:1: .*at least 1 row\(s\).*1 row\(s\) read before.*partial"
    ):
        load(f)
    prompts, rejects = load(f, allow_partial_read=True)
    assert [p.messages[0].content for p in prompts] == ["a"]
    assert [(r.reason, r.row) for r in rejects] == [("unreadable_rest", 1)]
    assert rejects[0].detail.startswith(f"{f}:1: invalid JSON at line 1")


def test_truncated_json_list_fails_loudly(tmp_path: Path) -> None:
    f = tmp_path / "cut.json"
    f.write_text('[\n{"instruction": "a"},\n{"instruction": "b"},\n{"instruction": "c", "inp')
    with pytest.raises(PromptSourceError, match=r"cut\.json:4: .*at least 1 row\(s\).*2 row\(s\) read before"):
        load(f)


def test_empty_or_blank_system_prompt_is_kept_as_given(tmp_path: Path) -> None:
    # Issue 13.6: the loader dropped an empty system prompt, so the prompt differed from apply_chat_template.
    from datagen.chat import ChatTokenizer
    from datagen.local.model_fixture import ensure_model_dir

    f = write_jsonl(
        tmp_path / "sys.jsonl",
        [
            oa(("system", ""), ("user", "Question one")),
            sg(("system", "  \n"), ("human", "Question two")),
            {"instruction": "Question three", "system": ""},
            {"instruction": "Question four"},
        ],
    )
    prompts, rejects = load(f)
    assert rejects == []
    given = [
        [{"role": "system", "content": ""}, {"role": "user", "content": "Question one"}],
        [{"role": "system", "content": "  \n"}, {"role": "user", "content": "Question two"}],
        [{"role": "system", "content": ""}, {"role": "user", "content": "Question three"}],
        [{"role": "user", "content": "Question four"}],
    ]
    assert [dicts(p.messages) for p in prompts] == given
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    hf = chat._hf  # the reference: transformers' own apply_chat_template on the messages as given
    for p, messages in zip(prompts, given, strict=True):
        reference = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)
        assert chat.prompt_ids(p.messages) == reference["input_ids"]


def test_json_list_trailing_garbage_is_reported(tmp_path: Path) -> None:
    f = tmp_path / "tail.json"
    f.write_text('[{"instruction": "a"}]\nextra\n')
    prompts, rejects = load(f)
    assert len(prompts) == 1
    assert [(r.reason, r.detail) for r in rejects] == [
        ("invalid_json", f"{f}:2: unexpected data after the closing ']'")
    ]


def test_json_list_streams_across_tiny_chunks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Chunks of 5 characters split every row, string and number: the result must equal a full json.load.
    monkeypatch.setattr(prompts_mod, "_JSON_CHUNK_CHARS", 5)
    rows = [{"instruction": f"q{i} " + "é" * i, "input": "", "n": 12345 + i} for i in range(40)]
    f = tmp_path / "big.json"
    f.write_text(json.dumps(rows, indent=1, ensure_ascii=False), encoding="utf-8")
    prompts, rejects = load(f)
    assert rejects == []
    assert [p.messages[0].content for p in prompts] == [r["instruction"] for r in rows]


def test_json_file_holding_json_lines(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "lines.json", [{"instruction": "a"}, "{bad", {"instruction": "b"}])
    prompts, rejects = load(f)
    assert [p.messages[0].content for p in prompts] == ["a", "b"]
    assert [(r.reason, r.detail.split(": ")[0]) for r in rejects] == [("invalid_json", f"{f}:2")]


def test_category_field(tmp_path: Path) -> None:
    f = write_jsonl(
        tmp_path / "cat.jsonl",
        [
            {"instruction": "a", "category": "math"},
            {"instruction": "b"},
            {"instruction": "c", "category": 3},
            {"instruction": "d", "category": ["x"]},
        ],
    )
    prompts, rejects = load(f, category_field="category")
    assert [p.category for p in prompts] == ["math", None, "3"]
    assert [(r.reason, r.row) for r in rejects] == [("wrong_type", 3)]
    assert [p.category for p in load(f)[0]] == [None, None, None, None]  # no category_field, no categories


# ----------------------------------------------------------------------------------------------- files, dirs, datasets


def test_every_prompt_and_reject_names_its_file_and_line(tmp_path: Path) -> None:
    # Issue 13.8: later stages only had a 0-based row that skips blank lines; now every row carries its location.
    f = tmp_path / "gaps.jsonl"
    f.write_text('\n{"instruction": "one"}\n\n\n{"instruction": 2}\n\n{"instruction": "three"}\n')
    prompts, rejects = load(f)
    assert [(p.row, p.location) for p in prompts] == [(0, f"{f}:2"), (2, f"{f}:7")]
    assert [(r.row, r.location) for r in rejects] == [(1, f"{f}:5")]
    table = tmp_path / "t.parquet"
    pq.write_table(pa.Table.from_pylist([{"instruction": "a"}, {"instruction": "b"}]), table)
    assert [p.location for p in load(table)[0]] == [f"{table}:row 0", f"{table}:row 1"]
    listed = tmp_path / "l.json"
    listed.write_text('[\n  {"instruction": "a"},\n\n  {"instruction": "b"}\n]')
    assert [p.location for p in load(listed)[0]] == [f"{listed}:2", f"{listed}:4"]


def test_parquet_file(tmp_path: Path) -> None:
    table = pa.Table.from_pylist(
        [
            {"messages": [{"role": "user", "content": "pq one"}], "category": "a"},
            {"messages": [{"role": "assistant", "content": "no user"}], "category": "b"},
            {
                "messages": [{"role": "user", "content": "pq two"}, {"role": "assistant", "content": "x"}],
                "category": None,
            },
        ]
    )
    f = tmp_path / "set.parquet"
    pq.write_table(table, f)
    prompts, rejects = load(f, category_field="category")
    assert [(dicts(p.messages), p.category, p.row) for p in prompts] == [
        ([{"role": "user", "content": "pq one"}], "a", 0),
        ([{"role": "user", "content": "pq two"}], None, 2),
    ]
    assert [(r.reason, r.row, r.detail.split(": ")[0]) for r in rejects] == [("no_user_turn", 1, f"{f}:row 1")]


def test_directory_is_read_sorted_with_a_source_per_file(tmp_path: Path) -> None:
    d = tmp_path / "set"
    (d / "sub").mkdir(parents=True)
    (d / ".hidden").mkdir()
    write_jsonl(d / "b.jsonl", [{"instruction": "b0"}, {"instruction": "b1"}])
    write_jsonl(d / "a.jsonl", [{"instruction": "a0"}])
    write_jsonl(d / "sub" / "c.jsonl", [{"instruction": "c0"}])
    write_jsonl(d / ".hidden" / "h.jsonl", [{"instruction": "hidden"}])
    (d / "README.md").write_text("not data")
    prompts, rejects = load(d)
    assert rejects == []
    assert [(p.source, p.row, p.messages[0].content) for p in prompts] == [
        ("a", 0, "a0"),
        ("b", 0, "b0"),
        ("b", 1, "b1"),
        ("sub/c", 0, "c0"),
    ]
    # A name makes the directory one source; row numbers run on across its files.
    named, _ = load(d, name="mine")
    assert [(p.source, p.row) for p in named] == [("mine", 0), ("mine", 1), ("mine", 2), ("mine", 3)]


def test_max_rows_counts_rejected_rows_and_spans_files(tmp_path: Path) -> None:
    d = tmp_path / "set"
    d.mkdir()
    write_jsonl(d / "a.jsonl", [{"instruction": "a0"}, "{bad"])
    write_jsonl(d / "b.jsonl", [{"instruction": "b0"}, {"instruction": "b1"}])
    items = list(iter_prompts([PromptSource(path=str(d), max_rows=3)]))
    assert [("Reject" if isinstance(i, Reject) else "Prompt", i.source, i.row) for i in items] == [
        ("Prompt", "a", 0),
        ("Reject", "a", 1),
        ("Prompt", "b", 0),
    ]


def test_hub_dataset_is_streamed_through_datasets(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    data = write_jsonl(
        tmp_path / "hub.jsonl", [sg(("human", "hub q"), ("gpt", "old")), {"bad": 1}, oa(("user", "hub q2"))]
    )
    real_load = datasets.load_dataset
    calls: list[tuple[str, str, bool]] = []

    # Stands in for the hub: the same call with a local JSON builder, so nothing is downloaded.
    def offline_load(name: str, *, split: str, streaming: bool) -> Any:
        calls.append((name, split, streaming))
        return real_load("json", data_files={split: str(data)}, split=split, streaming=streaming)

    monkeypatch.setattr(datasets, "load_dataset", offline_load)
    prompts, rejects = load("someorg/chat-set", split="train")
    assert calls == [("someorg/chat-set", "train", True)]
    assert [(p.source, p.row, dicts(p.messages)) for p in prompts] == [
        ("someorg/chat-set", 0, [{"role": "user", "content": "hub q"}]),
        ("someorg/chat-set", 2, [{"role": "user", "content": "hub q2"}]),
    ]
    assert [(r.reason, r.detail.split(": ")[0]) for r in rejects] == [
        ("unknown_format", "someorg/chat-set[train]:row 1")
    ]


def test_hub_dataset_that_cannot_be_loaded_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    import datasets

    def unreachable(name: str, *, split: str, streaming: bool) -> Any:
        raise FileNotFoundError(f"Dataset '{name}' doesn't exist on the Hub")

    monkeypatch.setattr(datasets, "load_dataset", unreachable)
    with pytest.raises(
        PromptSourceError, match=r"'nobody/nothing': not a local file or directory .* FileNotFoundError"
    ):
        iter_prompts([PromptSource(path="nobody/nothing")])


def test_saved_dataset_directory_is_read_through_datasets(tmp_path: Path) -> None:
    import datasets

    rows = [{"instruction": "saved 0", "category": "x"}, {"instruction": "", "category": "y"}]
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    datasets.DatasetDict({"test": datasets.Dataset.from_list(rows[:1])}).save_to_disk(str(tmp_path / "dict"))

    prompts, rejects = load(tmp_path / "saved", category_field="category")
    assert [(p.source, p.row, p.category, p.messages[0].content) for p in prompts] == [("saved", 0, "x", "saved 0")]
    assert [(r.reason, r.detail) for r in rejects] == [
        ("empty_user_content", f"{tmp_path / 'saved'}:row 1: 'instruction' is empty")
    ]
    assert [p.messages[0].content for p in load(tmp_path / "dict", split="test")[0]] == ["saved 0"]
    with pytest.raises(PromptSourceError, match=r"no split 'train' \(splits: test\)"):
        iter_prompts([PromptSource(path=str(tmp_path / "dict"))])


def test_config_errors_raise_before_any_row_is_read(tmp_path: Path) -> None:
    good = write_jsonl(tmp_path / "good.jsonl", [{"instruction": "a"}])
    (tmp_path / "prompts.csv").write_text("instruction\na\n")
    (tmp_path / "empty").mkdir()
    cases = {
        str(tmp_path / "missing.jsonl"): r"no such file or directory",
        str(tmp_path / "prompts.csv"): r"unsupported file type '\.csv'",
        str(tmp_path / "empty"): r"holds no \.jsonl, \.json, \.parquet files",
        "./not/here/at/all": r"'\./not/here/at/all': no such file or directory",
    }
    for path, message in cases.items():
        with pytest.raises(PromptSourceError, match=message):
            iter_prompts([PromptSource(path=str(good)), PromptSource(path=path)])


def test_relative_paths_resolve_against_base_dir(tmp_path: Path) -> None:
    write_jsonl(tmp_path / "rel.jsonl", [{"instruction": "a"}])
    items = list(iter_prompts([PromptSource(path="rel.jsonl")], base_dir=tmp_path))
    assert [(i.source, i.row) for i in items] == [("rel", 0)]


def test_corrupt_parquet_names_the_file(tmp_path: Path) -> None:
    f = tmp_path / "broken.parquet"
    f.write_bytes(b"not parquet at all")
    with pytest.raises(PromptSourceError, match=r"broken\.parquet: not a readable parquet file"):
        list(iter_prompts([PromptSource(path=str(f))]))


# ----------------------------------------------------------------------------------------------- ids and duplicates


def test_duplicates_within_and_across_sources_are_rejected(tmp_path: Path) -> None:
    a = write_jsonl(tmp_path / "a.jsonl", [sg(("human", "same")), sg(("human", "other")), oa(("user", "same"))])
    b = write_jsonl(tmp_path / "b.jsonl", [{"instruction": "same"}])
    items = list(iter_prompts([PromptSource(path=str(a)), PromptSource(path=str(b))]))
    assert [("Reject" if isinstance(i, Reject) else "Prompt", i.source, i.row) for i in items] == [
        ("Prompt", "a", 0),
        ("Prompt", "a", 1),
        ("Reject", "a", 2),
        ("Reject", "b", 0),  # issue 35.5: the same prompt in another source is one prompt, the first source's
    ]
    dup, other = items[2], items[3]
    assert isinstance(dup, Reject) and isinstance(items[0], Prompt) and isinstance(other, Reject)
    assert dup.reason == other.reason == "duplicate_prompt"
    assert dup.prompt_id == items[0].prompt_id
    assert dup.detail.startswith(f"{a}:3: same prompt as an earlier row of source 'a'")
    assert other.detail.startswith(f"{b}:1: same prompt as a row of source 'a', planned once under that source")
    assert other.prompt_id != items[0].prompt_id  # different source, different id


def test_ids_are_stable_across_runs_and_depend_on_source(tmp_path: Path) -> None:
    f = write_jsonl(tmp_path / "s.jsonl", [sg(("system", "S"), ("human", "U"), ("gpt", "A"), ("human", "V"))])
    first = load(f)[0][0]
    again = load(f)[0][0]
    renamed = load(f, name="other")[0][0]
    assert first.prompt_id == again.prompt_id == prompt_id_from_messages("s", first.messages)
    assert renamed.prompt_id == prompt_id_from_messages("other", first.messages) != first.prompt_id


# ----------------------------------------------------------------------------------------------- bundled set


def test_bundled_prompt_set_loads_cleanly_with_a_broad_mix() -> None:
    items = list(iter_prompts([PromptSource(path="data/prompts", category_field="category")], base_dir=REPO))
    rejects = [i for i in items if isinstance(i, Reject)]
    assert rejects == []
    prompts = [i for i in items if isinstance(i, Prompt)]
    assert 250 <= len(prompts) <= 350
    sources = Counter(p.source for p in prompts)
    assert set(sources) == {
        "alpaca_instructions",
        "mixed_topics",
        "openai_messages",
        "sharegpt_chat",
        "tool_calls_openai",
        "tool_calls_sharegpt",
    }
    categories = Counter(p.category for p in prompts)
    assert None not in categories
    assert len(categories) >= 12
    # The narrow-mix incident: no category may dominate the demo set.
    assert max(categories.values()) / len(prompts) < 0.15
    assert sum(1 for p in prompts if p.messages[0].role == "system") >= 20
    assert sum(1 for p in prompts if any(m.role == "assistant" for m in p.messages)) >= 10
    assert all(p.messages[-1].role in ("user", "tool") for p in prompts)
    # Tool-calling conversations in both forms: tools declared, calls made, results recorded.
    assert sum(1 for p in prompts if p.tools) >= 20
    assert sum(1 for p in prompts if any(m.tool_calls for m in p.messages)) >= 12
    assert sum(1 for p in prompts if p.messages[-1].role == "tool") >= 6


def test_bundled_parquet_matches_its_generator_script() -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_parquet", REPO / "data/prompts/make_parquet.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    table = pq.read_table(REPO / "data/prompts/mixed_topics.parquet")
    assert table.to_pylist() == module.ROWS


def test_every_turn_keeps_conversations_whose_recorded_replies_are_empty_or_null(tmp_path: Path) -> None:
    # Issue 47.11: every-turn mode discards the recorded replies, yet an empty or null one rejected the whole
    # conversation (`empty_assistant_content`, `wrong_type ... is null`) and its good user turns were lost.
    from datagen.identity import PromptIdentity
    from datagen.local.model_fixture import ensure_model_dir
    from datagen.runspec import RunSpec

    def conv(reply: object, i: int) -> dict[str, Any]:
        users = [{"role": "user", "content": f"Question {i}.{t}: why?"} for t in range(2)]
        return {"messages": [users[0], {"role": "assistant", "content": reply}, users[1]]}

    sharegpt = {
        "conversations": [
            {"from": "human", "value": "Hi?"},
            {"from": "gpt", "value": ""},
            {"from": "human", "value": "Again?"},
        ]
    }
    f = write_jsonl(tmp_path / "replies.jsonl", [conv("", 0), conv(None, 1), conv("  ", 2), sharegpt])
    every = PromptIdentity.for_spec(RunSpec(model_path=str(ensure_model_dir()), turns="every"))
    last = PromptIdentity.for_spec(RunSpec(model_path=str(ensure_model_dir()), turns="last"))

    def load_as(path: Path, identity: PromptIdentity) -> tuple[list[Prompt], list[Reject]]:
        items = list(iter_prompts([PromptSource(path=str(path))], identity=identity))
        return [i for i in items if isinstance(i, Prompt)], [i for i in items if isinstance(i, Reject)]

    prompts, rejects = load_as(f, every)
    assert rejects == [] and len(prompts) == 4
    assert all([m.role for m in p.messages] == ["user", "assistant", "user"] for p in prompts)
    assert prompts[1].messages[1].content == ""  # the null reply, kept as an empty one (it is never sent)
    # `last` sends the recorded history as it is: an empty reply there is still refused.
    prompts, rejects = load_as(f, last)
    assert prompts == [] and [r.reason for r in rejects] == [
        "empty_assistant_content",
        "wrong_type",
        "empty_assistant_content",
        "empty_assistant_content",
    ]
    # Content that is not text at all is still bad input in both modes, named with its place.
    bad = write_jsonl(tmp_path / "bad.jsonl", [conv(5, 3)])
    _, rejects = load_as(bad, every)
    assert [(r.reason, r.detail) for r in rejects] == [
        ("wrong_type", f"{bad}:1: messages[1].content must be a string or a list of text parts, got int")
    ]
