"""The trainers as judges: SpecForge 0.2.0 and speculators 0.9.0 preprocess what a run publishes, in both turn modes.

`turns: last`: a real run's published namespace. `turns: every`: multi-turn, tool-calling conversations regenerated
turn by turn, built with the fixture model's template (tests/turn_fixtures.py) and validated and tokenized by the
real stages. SpecForge (ThinkingParser, `qwen3.5`) reads the published conversations, speculators the token rows.
Where their rules apply, the loss masks they derive equal ours; the one difference (SpecForge trains on the newline
its template writes after `<|im_end|>`) is asserted exactly. docs/conversations.md says why, and what each rule
covers ("Every turn: rows, conversations and trainers").
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion
from tests.consumers.conftest import REPO_ROOT, SPECFORGE, SPECULATORS, Trainers
from tests.conversation_fixtures import PublishedRun
from tests.turn_fixtures import WEATHER_TOOLS, Step, Turn, build_conversation, stage_steps, three_turn_tool_conversation

pytestmark = pytest.mark.slow

Row = tuple[tuple[int, ...], tuple[int, ...]]


def _rows(root: Path) -> list[dict[str, Any]]:
    """The token rows a namespace published (every column)."""
    rows: list[dict[str, Any]] = pq.read_table(sorted((root / "data").glob("*.parquet"))).to_pylist()
    return rows


def _key(row: dict[str, Any]) -> Row:
    return tuple(row["input_ids"]), tuple(row["loss_mask"])


def _timed_rows(trainers: Trainers, trainer: str, model_dir: Path, root: Path, work: Path) -> list[dict[str, Any]]:
    start = time.monotonic()
    rows = trainers.rows(trainer, model_dir, root, work)
    # Reported, never asserted (the install and run times of the tier: docs/conversations.md).
    print(
        f"\nconsumer tier: {trainer} preprocessing {time.monotonic() - start:.1f}s, install {trainers.install_s:.1f}s"
    )
    return rows


def test_trainer_wheels_are_the_pinned_releases(trainers: Trainers) -> None:
    """The code under judgement is the registry's specforge 0.2.0 and speculators 0.9.0, beside a CPU torch."""
    code = (
        "import importlib.metadata as m, torch, specforge, speculators\n"
        "print(m.version('specforge'), m.version('speculators'), torch.__version__, torch.cuda.is_available(),"
        " specforge.__file__, speculators.__file__)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(trainers.site), "PYTHONNOUSERSITE": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600, check=True
    )
    sf, sp, torch_version, cuda, sf_file, sp_file = proc.stdout.split()
    assert f"specforge=={sf}" == SPECFORGE and f"speculators=={sp}" == SPECULATORS
    assert torch_version.endswith("+cpu") and cuda == "False"
    assert sf_file.startswith(str(trainers.site)) and sp_file.startswith(str(trainers.site))
    # The project's own interpreter has no torch: the tier's install stays out of it.
    assert subprocess.run([sys.executable, "-c", "import torch"], capture_output=True, check=False).returncode != 0


def test_specforge_thinking_parser_reads_our_conversations(
    trainers: Trainers, published_run: PublishedRun, tmp_path: Path
) -> None:
    """SpecForge's JSON loading + ThinkingParser (`qwen3.5`) on conversations/: our ids and mask, plus one newline."""
    ours = _rows(published_run.local)
    theirs = _timed_rows(trainers, "specforge", published_run.model_dir, published_run.local, tmp_path)
    newline = ChatTokenizer.from_model_dir(published_run.model_dir).encode("\n")
    assert len(newline) == 1 and len(theirs) == len(ours)
    # Their row = the template's rendering, which closes the turn with "<|im_end|>\n"; their mask runs from the
    # end of "<|im_start|>assistant\n<think>\n" through that "\n". Ours stops at the <|im_end|> the model sampled.
    trimmed = []
    for row in theirs:
        assert row["input_ids"][-1:] == newline and row["loss_mask"][-1] == 1
        trimmed.append({"input_ids": row["input_ids"][:-1], "loss_mask": row["loss_mask"][:-1]})
    assert Counter(map(_key, trimmed)) == Counter(map(_key, ours))


@pytest.fixture(params=["last", "every"])
def published(request: pytest.FixtureRequest) -> tuple[Path, Path]:
    """(model dir, namespace root) of each turn mode's output: a real single-turn run's published namespace, and
    the every-turn conversations staged by the real stages."""
    if request.param == "last":
        run: PublishedRun = request.getfixturevalue("published_run")
        return run.model_dir, run.local
    staged: tuple[ChatTokenizer, Path] = request.getfixturevalue("staged")
    return ensure_model_dir(), staged[1]


def test_speculators_passes_our_token_rows_through(
    trainers: Trainers, published: tuple[Path, Path], tmp_path: Path
) -> None:
    """speculators loads the namespace by its card (its default config) and keeps every row's input_ids and
    loss_mask as they are: a single-turn run's rows, and every segment row of an every-turn run."""
    model_dir, root = published
    theirs = _timed_rows(trainers, "speculators", model_dir, root, tmp_path)
    assert Counter(map(_key, theirs)) == Counter(map(_key, _rows(root)))


def _run_tier_offline(tmp_path: Path, required: bool) -> subprocess.CompletedProcess[str]:
    """Run the version test in a fresh pytest with an empty cache and a package index that refuses connections."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed_port = s.getsockname()[1]  # nothing listens here once the socket is closed
    env = dict(os.environ)
    env.update(
        DATAGEN_CONFORMANCE_DIR=str(tmp_path / "empty-cache"),
        PIP_INDEX_URL=f"http://127.0.0.1:{closed_port}/simple/",
        PIP_RETRIES="0",
        PIP_DEFAULT_TIMEOUT="5",
        PIP_CONFIG_FILE=os.devnull,  # this machine's pip.conf adds local indexes and wheel folders
    )
    env.pop("DATAGEN_CONFORMANCE_REQUIRED", None)
    if required:
        env["DATAGEN_CONFORMANCE_REQUIRED"] = "1"
    test = f"{Path(__file__).resolve()}::test_trainer_wheels_are_the_pinned_releases"
    cmd = [sys.executable, "-m", "pytest", test, "-q", "-rs", "-p", "no:cacheprovider"]
    return subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=REPO_ROOT, timeout=600, check=False)


def test_without_a_registry_the_tier_is_skipped_loudly_never_passed(tmp_path: Path) -> None:
    """No cache and no reachable index: SKIPPED with the reason; with DATAGEN_CONFORMANCE_REQUIRED=1, failed."""
    skipped = _run_tier_offline(tmp_path, required=False)
    assert skipped.returncode == 0, skipped.stdout[-3000:]
    assert "1 skipped" in skipped.stdout and "passed" not in skipped.stdout
    assert f"CONSUMER TIER NOT RUN: {SPECFORGE} and {SPECULATORS} cannot be installed" in skipped.stdout
    failed = _run_tier_offline(tmp_path, required=True)
    assert failed.returncode == 1, failed.stdout[-3000:]
    assert "DATAGEN_CONFORMANCE_REQUIRED=1" in failed.stdout


# --- every turn: multi-turn, tool-calling conversations ---------------------------------------------------


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


def _published(staging: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line)
        for p in sorted((staging / "conversations").glob("*.jsonl"))
        for line in p.read_text(encoding="utf-8").splitlines()
    ]


def _specforge_view(row: dict[str, Any], newline: int) -> Row:
    """Our row as SpecForge's rule sees it: the template's "\\n" after each span's <|im_end|> trained on too.

    Inside a segment that "\\n" is the first token of the next step's bridge (loss 0 in ours: the model never
    sampled it); at the end it is the newline the template writes after the last turn (not in our row).
    """
    ids, mask = list(row["input_ids"]), list(row["loss_mask"])
    for i in range(len(ids) - 1):
        if mask[i] == 1 and ids[i] == IM_END_ID and ids[i + 1] == newline:
            mask[i + 1] = 1
    return tuple([*ids, newline]), tuple([*mask, 1])


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
    ours = _rows(staging)
    last_turns = {}
    for row in ours:
        if row["turn_index"] >= last_turns.get(row["conversation_id"], {"turn_index": -1})["turn_index"]:
            last_turns[row["conversation_id"]] = row
    theirs = trainers.rows("specforge", ensure_model_dir(), staging, tmp_path)
    assert Counter(map(_key, theirs)) == Counter(_specforge_view(r, newline) for r in last_turns.values())


def test_specforge_on_exploded_conversations_trains_every_turn_as_our_rows(
    trainers: Trainers, staged: tuple[ChatTokenizer, Path], tmp_path: Path
) -> None:
    """One conversation per user turn: every row SpecForge derives is one of ours (ids, and mask per its rule)."""
    chat, staging = staged
    [newline] = chat.encode("\n")
    exploded = _explode(staging, tmp_path / "exploded")
    theirs = trainers.rows("specforge", ensure_model_dir(), exploded, tmp_path)
    ours = _rows(staging)
    assert len(ours) == 8
    assert Counter(map(_key, theirs)) == Counter(_specforge_view(r, newline) for r in ours)
