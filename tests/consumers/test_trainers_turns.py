"""The trainers as judges of every-turn data: multi-turn, tool-calling conversations regenerated turn by turn.

The step lines are real regenerated conversations built with the fixture model's template (tests/turn_fixtures.py),
validated and tokenized by the real stages; SpecForge 0.2.0 (ThinkingParser, `qwen3.5`) reads the published
conversations and speculators 0.9.0 the token rows. docs/conversations.md ("Every turn: rows, conversations and
trainers") says what each rule covers and why the differences asserted here are what they are.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion
from tests.consumers.conftest import Trainers
from tests.turn_fixtures import WEATHER_TOOLS, Step, Turn, build_conversation, stage_steps, three_turn_tool_conversation

pytestmark = pytest.mark.slow

Row = tuple[tuple[int, ...], tuple[int, ...]]


def _steps(chat: ChatTokenizer) -> list[Completion]:
    """Four conversations: tools in the middle turn, tools in the first turn, plain, and one cut by a placeholder."""
    tool_first = build_conversation(
        chat,
        [
            Turn(
                "What is the weather in Oslo today?",
                (
                    Step(
                        "The user wants today's weather in Oslo; I will call the weather function for one day.",
                        "",
                        calls=(("get_weather", {"city": "Oslo", "days": 1}),),
                        results=('{"forecast": ["snow, -3C"]}',),
                    ),
                    Step(
                        "Snow and minus three degrees: I will tell them to dress warmly and mention the snow.",
                        "It is snowing in Oslo today at -3C, so dress warmly and wear boots.",
                    ),
                ),
            ),
            Turn(
                "Should I still go for a run?",
                (
                    Step(
                        "Running in snow at -3C is possible with care; I will give a few safety tips for it.",
                        "You can, with grippy shoes, layers and a shorter route; skip it if the paths are icy.",
                    ),
                ),
            ),
        ],
        prompt_id="conv-tool-first",
        tools=WEATHER_TOOLS,
        plan_index=1,
    )
    plain = build_conversation(
        chat,
        [
            Turn(
                "Give me a one-line definition of entropy.",
                (
                    Step(
                        "A concise definition: entropy measures disorder, or the number of microstates of a system.",
                        "Entropy measures how many microscopic arrangements are consistent with a macroscopic state.",
                    ),
                ),
            ),
            Turn(
                "And in information theory?",
                (
                    Step(
                        "Shannon entropy is the expected information content, in bits, of a random variable.",
                        "It is the average number of bits needed to encode outcomes of a random variable.",
                    ),
                ),
            ),
        ],
        prompt_id="conv-plain",
        system=None,
        plan_index=2,
    )
    cut = build_conversation(
        chat,
        [
            Turn(
                "List two uses of copper.",
                (
                    Step(
                        "Copper conducts electricity and heat well; wiring and cookware are two classic uses.",
                        "Electrical wiring and cookware, both because copper conducts so well.",
                    ),
                ),
            ),
            Turn("Thanks!", (Step("Ok.", "OK."),)),
        ],
        prompt_id="conv-cut",
        plan_index=3,
        outcome="rejected_placeholder",
    )
    return [*three_turn_tool_conversation(chat).steps, *tool_first.steps, *plain.steps, *cut.steps]


@pytest.fixture(scope="module")
def staged(tmp_path_factory: pytest.TempPathFactory) -> tuple[ChatTokenizer, Path]:
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    staging, summary = stage_steps(chat, _steps(chat), tmp_path_factory.mktemp("turns"))
    assert (
        summary.conversations == 4 and summary.turns == 8 and summary.rejects_by_reason == {"validate/placeholder": 1}
    )
    return chat, staging


def _ours(staging: Path) -> list[dict[str, Any]]:
    table = pq.read_table(sorted((staging / "data").glob("*.parquet")))
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def _published(staging: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for p in sorted((staging / "conversations").glob("*.jsonl"))
        for line in p.read_text(encoding="utf-8").splitlines()
    ]


def _key(ids: list[int], mask: list[int]) -> Row:
    return tuple(ids), tuple(mask)


def _specforge_view(row: dict[str, Any], newline: int) -> Row:
    """Our row as SpecForge's rule sees it: the template's "\\n" after each span's <|im_end|> trained on too.

    Inside a segment that "\\n" is the first token of the next step's bridge (loss 0 in ours: the model never
    sampled it); at the end it is the newline the template writes after the last turn (not in our row).
    """
    ids, mask = list(row["input_ids"]), list(row["loss_mask"])
    for i in range(len(ids) - 1):
        if mask[i] == 1 and ids[i] == IM_END_ID and ids[i + 1] == newline:
            mask[i + 1] = 1
    return _key([*ids, newline], [*mask, 1])


def _explode(staging: Path, out: Path) -> Path:
    """One conversation per user turn: the published conversation up to that turn's last assistant message.

    SpecForge's recipe for Qwen3.5/3.6: the template renders reasoning only after the last user query, so a
    whole conversation trains only its last turn; every turn trains when each is its own row.
    """
    lines = []
    for record in _published(staging):
        messages = record["conversations"]
        users = [i for i, m in enumerate(messages) if m["role"] == "user"]
        for k in range(len(users)):
            end = users[k + 1] if k + 1 < len(users) else len(messages)
            lines.append({**record, "id": f"{record['id']}#{k}", "conversations": messages[:end]})
    (out / "conversations").mkdir(parents=True)
    body = "".join(json.dumps(line, ensure_ascii=False) + "\n" for line in lines)
    (out / "conversations" / "conversations-00000-of-00001.jsonl").write_text(body, encoding="utf-8")
    return out


def test_specforge_reads_whole_conversations_and_trains_their_last_turn(
    trainers: Trainers, staged: tuple[ChatTokenizer, Path], tmp_path: Path
) -> None:
    """Whole conversations (with `outcome`, a key it passes through unread): one row each, loss on the last turn."""
    chat, staging = staged
    published = _published(staging)
    assert {r["id"]: r.get("outcome") for r in published} == {
        "conv-tools": "complete",
        "conv-tool-first": "complete",
        "conv-plain": "complete",
        "conv-cut": "rejected_placeholder",
    }
    [newline] = chat.encode("\n")
    ours = _ours(staging)
    last_turns = {}
    for row in ours:
        if row["turn_index"] >= last_turns.get(row["conversation_id"], {"turn_index": -1})["turn_index"]:
            last_turns[row["conversation_id"]] = row
    theirs = trainers.rows("specforge", ensure_model_dir(), staging, tmp_path)
    assert Counter(_key(r["input_ids"], r["loss_mask"]) for r in theirs) == Counter(
        _specforge_view(r, newline) for r in last_turns.values()
    )


def test_specforge_on_exploded_conversations_trains_every_turn_as_our_rows(
    trainers: Trainers, staged: tuple[ChatTokenizer, Path], tmp_path: Path
) -> None:
    """One conversation per user turn: every row SpecForge derives is one of ours (ids, and mask per its rule)."""
    chat, staging = staged
    [newline] = chat.encode("\n")
    exploded = _explode(staging, tmp_path / "exploded")
    theirs = trainers.rows("specforge", ensure_model_dir(), exploded, tmp_path)
    ours = _ours(staging)
    assert len(ours) == 8
    assert Counter(_key(r["input_ids"], r["loss_mask"]) for r in theirs) == Counter(
        _specforge_view(r, newline) for r in ours
    )


def test_speculators_passes_our_turn_rows_through(
    trainers: Trainers, staged: tuple[ChatTokenizer, Path], tmp_path: Path
) -> None:
    """speculators loads the staged namespace by its card and keeps every segment row's ids and mask as they are."""
    _, staging = staged
    theirs = trainers.rows("speculators", ensure_model_dir(), staging, tmp_path)
    ours = _ours(staging)
    assert Counter(_key(r["input_ids"], r["loss_mask"]) for r in theirs) == Counter(
        _key(r["input_ids"], r["loss_mask"]) for r in ours
    )
