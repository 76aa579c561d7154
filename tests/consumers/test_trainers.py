"""The trainers as judges: SpecForge 0.2.0 and speculators 0.9.0 preprocess what a real run publishes.

Where their rules apply, the loss masks they derive equal ours; the one difference (SpecForge trains on the
newline its template writes after `<|im_end|>`) is asserted exactly, and docs/conversations.md says why.
"""

from __future__ import annotations

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

from datagen.chat import ChatTokenizer
from tests.consumers.conftest import REPO_ROOT, SPECFORGE, SPECULATORS, Trainers
from tests.conversation_fixtures import PublishedRun

pytestmark = pytest.mark.slow


def _ours(run: PublishedRun) -> list[dict[str, Any]]:
    table = pq.read_table(sorted((run.local / "data").glob("*.parquet")), columns=["input_ids", "loss_mask"])
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def _key(row: dict[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    return tuple(row["input_ids"]), tuple(row["loss_mask"])


def _timed_rows(trainers: Trainers, trainer: str, run: PublishedRun, work: Path) -> list[dict[str, Any]]:
    start = time.monotonic()
    rows = trainers.rows(trainer, run.model_dir, run.local, work)
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
    ours = _ours(published_run)
    theirs = _timed_rows(trainers, "specforge", published_run, tmp_path)
    newline = ChatTokenizer.from_model_dir(published_run.model_dir).encode("\n")
    assert len(newline) == 1 and len(theirs) == len(ours)
    # Their row = the template's rendering, which closes the turn with "<|im_end|>\n"; their mask runs from the
    # end of "<|im_start|>assistant\n<think>\n" through that "\n". Ours stops at the <|im_end|> the model sampled.
    trimmed = []
    for row in theirs:
        assert row["input_ids"][-1:] == newline and row["loss_mask"][-1] == 1
        trimmed.append({"input_ids": row["input_ids"][:-1], "loss_mask": row["loss_mask"][:-1]})
    assert Counter(map(_key, trimmed)) == Counter(map(_key, ours))


def test_speculators_passes_our_token_rows_through(
    trainers: Trainers, published_run: PublishedRun, tmp_path: Path
) -> None:
    """speculators loads the namespace (its card's default config) and keeps our input_ids and loss_mask as they are."""
    ours = _ours(published_run)
    theirs = _timed_rows(trainers, "speculators", published_run, tmp_path)
    assert Counter(map(_key, theirs)) == Counter(map(_key, ours))


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
