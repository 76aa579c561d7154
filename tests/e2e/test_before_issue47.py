"""What the code before issue 47 left keeps working under today's code: its published namespace and its interrupted run.

`tests/fixtures/before_issue47/` was made by `make_before_issue47.py` on main `a0af713` (README there): the objects it
published for namespace `before_v1` (every turn, 6 conversations, 2 broken rows), its catalog parts (legacy ids: the
source label and the recorded conversation's render), and the work dir of the same run killed after 8 of its 11 step
lines. Both are read here with today's code, against real S3 and an attached, seeded stand-in (a step's output depends
on its prompt alone, so a resumed conversation continues as the uninterrupted one did).
"""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from flows.expand_dataset import expand_dataset
from tests.e2e.test_prompt_identity import requests_served

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "before_issue47"
MADE = json.loads((FIXTURE / "made.json").read_text())


def _spec(source: Path, namespace: str) -> RunSpec:
    """The fixture's run spec (make_before_issue47.py `spec`) over `source`."""
    return RunSpec(
        sources=[PromptSource(path=str(source))],
        model_path=str(ensure_model_dir()),
        namespace=namespace,
        turns="every",
        shard_size=3,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=256),
        quality_gate=QualityGate(
            max_reject_rate=0.5, min_median_completion_tokens=8, max_source_share=1.0, max_category_share=1.0
        ),
    )


@pytest.fixture
def standin(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The fixture's stand-in (same seed and lengths), attached by URL so its own counter says what it was sent."""
    with run_standin(ensure_model_dir(), args=["--enable-metrics"], env=MADE["standin"]) as endpoint:
        assert endpoint.api_key is not None
        monkeypatch.setenv("DATAGEN_SERVER_URLS", json.dumps([endpoint.url]))
        monkeypatch.setenv("DATAGEN_SGLANG_API_KEY", endpoint.api_key.get_secret_value())
        yield endpoint


def _rows(store: ObjectStore, namespace: str) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for o in store.list(f"{namespace}/data/"):
        for r in pq.read_table(io.BytesIO(store.get_bytes(o.key))).to_pylist():
            out.append((r["prompt_id"], r["turn_index"], r["input_ids"], r["loss_mask"]))
    return out


def _fixture_rows() -> list[tuple[Any, ...]]:
    table = pq.read_table(FIXTURE / "published" / "before_v1" / "data" / "train-00000-of-00001.parquet")
    return [(r["prompt_id"], r["turn_index"], r["input_ids"], r["loss_mask"]) for r in table.to_pylist()]


def test_a_namespace_published_before_issue_47_is_expanded_with_no_request(
    prefect_api: None,
    pipeline_env: dict[str, str],
    local_s3: LocalS3,
    standin: Any,
    tmp_path: Path,
) -> None:
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
    published = FIXTURE / "published"
    for path in sorted(p for p in published.rglob("*") if p.is_file()):
        store.put_if_absent(path.relative_to(published).as_posix(), path.read_bytes())
    src = tmp_path / "src"
    src.mkdir()
    shutil.copyfile(FIXTURE / "prompts" / "old.jsonl", src / "old.jsonl")  # the file it published, same label
    spec = _spec(src, "auto")

    def expand() -> tuple[dict[str, Any], int]:
        before = requests_served(standin)
        summary = expand_dataset(spec)
        return summary, requests_served(standin) - before

    # The same file: its 6 conversations (4 published as data, 2 as rejects) and 2 broken rows are known.
    summary, sent = expand()
    assert sent == 0 and summary["prompts"] == 0 and summary["uri"] is None, summary
    assert summary["skipped_published"] == 6 and summary["old_rejects_skipped"] == 2, summary
    # Renamed: the legacy ids hold the old label, which the namespace's catalog part names: still known.
    (src / "old.jsonl").rename(src / "renamed.jsonl")
    summary, sent = expand()
    assert sent == 0 and summary["prompts"] == 0, summary
    assert summary["skipped_published"] == 6 and summary["old_rejects_skipped"] == 2, summary
    # A new file sorting first with one of its conversations and new ones: only the new ones are sent.
    old = (src / "renamed.jsonl").read_text().splitlines()
    new = [
        json.dumps({"id": f"n{i}", "messages": [{"role": "user", "content": f"New question {i}: what is a tide?"}]})
        for i in range(3)
    ]
    (src / "0first.jsonl").write_text("".join(f"{line}\n" for line in [old[0], *new]))
    summary, sent = expand()
    assert summary["prompts"] == 3 and summary["skipped_published"] == 1 + 6, summary
    manifest = json.loads(store.get_bytes(f"{summary['namespace']}/manifest.json"))
    assert sent == manifest["lineage"]["conversations"]["steps"] == 3
    assert manifest["lineage"]["prompt_id_scheme"] == "continued_content"
    assert sorted(o.key.split("/")[0] for o in store.list("") if o.key.endswith("/manifest.json")) == [
        "before_v1",
        summary["namespace"],
    ]


def test_a_run_interrupted_before_issue_47_resumes_on_its_checkpoints_to_the_same_rows(
    prefect_api: None,
    pipeline_env: dict[str, str],
    local_s3: LocalS3,
    standin: Any,
    tmp_path: Path,
) -> None:
    run_dir = Path(pipeline_env["DATAGEN_WORK_DIR"]) / "runs" / "before_v1"
    shutil.copytree(FIXTURE / "interrupted", run_dir)
    written = sum(len(p.read_text().splitlines()) for p in run_dir.glob("shards/*.completions.jsonl"))
    source = tmp_path / "old.jsonl"
    shutil.copyfile(FIXTURE / "prompts" / "old.jsonl", source)
    whole = json.loads((FIXTURE / "published" / "before_v1" / "manifest.json").read_text())["lineage"]
    assert 0 < written < whole["conversations"]["steps"]

    before = requests_served(standin)
    summary = expand_dataset(_spec(source, "before_v1"))
    sent = requests_served(standin) - before

    # Only the steps its checkpoints did not hold were sent, and the rows are those the old code's uninterrupted
    # run published: the same prompt ids (the work dir keeps its legacy ids), the same tokens and masks.
    assert sent == whole["conversations"]["steps"] - written, (sent, written)
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
    assert _rows(store, "before_v1") == _fixture_rows()
    assert summary["conversations"]["steps"] == whole["conversations"]["steps"]
    lineage = json.loads(store.get_bytes("before_v1/manifest.json"))["lineage"]
    assert lineage["prompt_id_scheme"] == "rendered_token_ids"


def test_a_publish_killed_before_issue_47_is_finished_from_its_claim_byte_for_byte(
    prefect_api: None,
    pipeline_env: dict[str, str],
    local_s3: LocalS3,
    standin: Any,
    tmp_path: Path,
) -> None:
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=pipeline_env["DATAGEN_S3_PREFIX"]))
    s3 = FIXTURE / "claimed" / "s3"
    for path in sorted(p for p in s3.rglob("*") if p.is_file()):
        store.put_if_absent(path.relative_to(s3).as_posix(), path.read_bytes())
    shutil.copytree(
        FIXTURE / "claimed" / "dataset", Path(pipeline_env["DATAGEN_WORK_DIR"]) / "runs" / "before_v1" / "dataset"
    )
    source = tmp_path / "old.jsonl"
    shutil.copyfile(FIXTURE / "prompts" / "old.jsonl", source)
    claim = json.loads((s3 / "before_v1" / "publish-claim.json").read_text())

    before = requests_served(standin)
    summary = expand_dataset(_spec(source, "before_v1"))
    assert requests_served(standin) == before  # nothing generated, validated or tokenized again
    assert summary["already_published"] is True and "finished the publish" in summary["message"]

    # Every object the old code claimed, with the bytes it claimed; then the manifest over exactly them.
    listed = {o["key"]: o["sha256"] for o in claim["objects"]}
    found = {o.key.removeprefix("before_v1/") for o in store.list("before_v1/")}
    assert found == {*listed, "publish-claim.json", "manifest.json"}
    for key, sha in listed.items():
        assert store.head(f"before_v1/{key}").sha256 == sha  # type: ignore[union-attr]
        assert store.get_bytes(f"before_v1/{key}") == (FIXTURE / "claimed" / "dataset" / key).read_bytes()
    manifest = json.loads(store.get_bytes("before_v1/manifest.json"))
    assert [o["key"] for o in manifest["objects"]] == ["publish-claim.json", *sorted(listed)]
    assert manifest["lineage"] == claim["lineage"] and manifest["created_at"] == claim["created_at"]
    # The same data the uninterrupted run published (the stand-in is seeded).
    for key in ("data/train-00000-of-00001.parquet", "conversations/conversations-00000-of-00001.jsonl"):
        assert store.get_bytes(f"before_v1/{key}") == (FIXTURE / "published" / "before_v1" / key).read_bytes()
