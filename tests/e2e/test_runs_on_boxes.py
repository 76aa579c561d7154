"""One run on one box or many (issue 46): the same expansions, through the deployed flows, on one box and on two.

Real processes throughout: one Prefect server with `infra/deploy.sh`'s deployments for the module, process workers
serving their own work queues (`default` for the one-box `expand-dataset`, `control` for the multi-box parent,
`box-a` and `box-b` for its per-box runs), the session's local S3 server, stand-in servers started by the flows.
Each test has its own S3 prefix and work dirs. Runs are started through the API as the UI starts them.

- Scheduled expansions over a growing source with broken rows, `namespace: auto`, nothing new, source targets, and
  another run spec refused: the same outcomes on one box and on two (the two-box variant failed on the old code:
  it regenerated and republished everything, published into `auto/`, ignored targets).
- A one-box and a two-box run of the same spec publish the same rows and rejects, in both turn modes.
- A one-box and a multi-box run of one namespace started together: one publishes, the other is refused naming it
  (or finds everything published); the namespace holds one run's rows and needs no repair.
"""

from __future__ import annotations

import io
import json
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow.parquet as pq
import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing import catalog
from datagen.publishing.storage import ObjectStore
from tests.e2e.test_multi_box import _kill_marked, _queue_worker
from tests.prefect_fixtures import PrefectApi, PrefectServer, prefect_server, run_deploy, worker_env

pytestmark = pytest.mark.slow

Where = Literal["one-box", "two-boxes"]
QUEUES: dict[str, list[str]] = {"one-box": ["default"], "two-boxes": ["control", "box-a", "box-b"]}
WAIT_S = 420.0  # hang guard only
BOXES = ["box-a", "box-b"]


@pytest.fixture(scope="module")
def deployed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PrefectServer]:
    root = tmp_path_factory.mktemp("boxes-prefect")
    with prefect_server(root / "prefect") as server:
        run_deploy(server, root / "cli-home", {"DATAGEN_HOME": "/nonexistent/deploy-machine-path"})
        yield server


@dataclass
class Place:
    """Where a test's runs go: one box, or a parent and two boxes; one S3 prefix and its store."""

    where: Where
    api: PrefectApi
    store: ObjectStore
    root: Path

    def start(self, spec: dict[str, Any], where: Where | None = None) -> str:
        """Start a run as the UI does, on this place's box(es) or on `where`; its flow run id."""
        if (where or self.where) == "one-box":
            deployment, parameters = self.api.deployment("expand-dataset", "manual"), {"spec": spec}
        else:
            deployment = self.api.deployment("expand-dataset-multibox", "multibox")
            boxes = {
                "boxes": BOXES,
                "exchange": {"lease_s": 10, "sync_interval_s": 1, "shards_in_flight": 2},
                "poll_s": 1,
                "child_exit_grace_s": 15,
            }
            parameters = {"spec": spec, "boxes": boxes}
        response = self.api.create_flow_run(deployment["id"], parameters)
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def wait(self, run_id: str, where: Where | None = None) -> dict[str, Any]:
        """The run (state, name, message) as the API reports it once it has ended."""
        log = self.root / ("default-worker.log" if (where or self.where) == "one-box" else "control-worker.log")
        return self.api.wait_for_flow_run(run_id, WAIT_S, diagnostics=log)

    def run(self, spec: dict[str, Any], *, expect: str = "COMPLETED") -> dict[str, Any]:
        """Start a run and wait for it to end in `expect`."""
        run_id = self.start(spec)
        run = self.wait(run_id)
        assert run["state_type"] == expect, f"{run['state']}\n{self.api.log_text(run_id)[-6000:]}"
        return run

    def lineage(self, namespace: str) -> dict[str, Any]:
        lineage: dict[str, Any] = json.loads(self.store.get_bytes(f"{namespace}/manifest.json"))["lineage"]
        return lineage

    def rows(self, namespace: str, kind: str = "data") -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for o in sorted(self.store.list(f"{namespace}/{kind}/"), key=lambda o: o.key):
            out += pq.read_table(io.BytesIO(self.store.get_bytes(o.key))).to_pylist()
        return out


@contextmanager
def _place(
    where: Where, deployed: PrefectServer, local_s3: LocalS3, root: Path, also: Where | None = None
) -> Iterator[Place]:
    """The workers of `where` (and of `also`), on this test's S3 prefix and work dirs; everything they started ends
    with the block."""
    root.mkdir(parents=True, exist_ok=True)
    prefix = f"{root.parent.name}-{root.name}-{where}/"
    work = {q: root / f"work-{q}" for q in ("default", "control", *BOXES)}

    def env(queue: str) -> dict[str, str]:
        out = worker_env(local_s3, prefix, work[queue], length_mean=24, length_max=48)
        out.update({"DATAGEN_BASE_PORT": "0", "DATAGEN_NUM_SERVERS": "1", "DATAGEN_STANDIN_TOKENS_PER_STEP": "8"})
        if queue in BOXES:
            out["DATAGEN_BOX_NAME"] = queue
        return out

    queues = QUEUES[where] + (QUEUES[also] if also and also != where else [])
    with ExitStack() as stack:
        stack.callback(lambda: [_kill_marked(f"DATAGEN_WORK_DIR={p}") for p in work.values()])
        api = deployed.api()
        stack.callback(api.close)
        for queue in queues:
            stack.enter_context(_queue_worker(deployed, root, queue, env(queue)))
        yield Place(where, api, ObjectStore.from_settings(local_s3.settings(s3_prefix=prefix)), root)


def _write(path: Path, label: str, n: int, start: int = 0) -> None:
    with open(path, "a", encoding="utf-8") as f:
        for i in range(start, start + n):
            f.write(json.dumps({"messages": [{"role": "user", "content": f"[{label}] Explain idea {i}."}]}) + "\n")


def _write_broken(path: Path, tag: str) -> None:
    with open(path, "a", encoding="utf-8") as f:
        f.write('{"messages": [{"role": "user", "content": "unterminated ' + tag + '"\n')  # invalid JSON


def _spec(sources: list[Path], **extra: Any) -> dict[str, Any]:
    return {
        "sources": [{"path": str(p)} for p in sources],
        "model_path": str(ensure_model_dir()),
        "namespace": "auto",
        "shard_size": 4,
        "context_length": 4096,
        "sampling": {"max_new_tokens": 256},
        "validation": {"min_answer_tokens": 0, "reject_truncated": False},
        "quality_gate": {"min_median_completion_tokens": 0, "max_short_share": 1.0},
        **extra,
    }


def _load_rejects(place: Place, namespace: str) -> int:
    return sum(1 for r in place.rows(namespace, "rejects") if r["stage"] == "load")


@pytest.mark.parametrize("where", ["one-box", "two-boxes"])
def test_scheduled_expansions_are_the_same_run_on_one_box_and_on_two(
    where: Where, deployed: PrefectServer, local_s3: LocalS3, tmp_path: Path
) -> None:
    chat = tmp_path / "chat.jsonl"
    _write(chat, "chat", 10)
    _write_broken(chat, "first")
    _write_broken(chat, "second")
    with _place(where, deployed, local_s3, tmp_path) as place:
        # Night 1: `auto` is the next free expansion_vN (not a namespace called "auto"), 10 rows, 2 load rejects.
        first = place.run(_spec([chat]))
        assert catalog.catalog_namespaces(place.store) == ["expansion_v1"]
        assert not place.store.exists("auto/")
        assert len(place.rows("expansion_v1")) == 10 and _load_rejects(place, "expansion_v1") == 2

        # Night 2, nothing new: green, nothing generated or published, the old rejects not judged again.
        second = place.run(_spec([chat]))
        assert "Nothing new to generate" in (second["state"].get("message") or ""), second["state"]
        assert catalog.catalog_namespaces(place.store) == ["expansion_v1"]

        # Night 3, 5 new rows and a new broken one: exactly those; the old rejects are not published again.
        _write(chat, "chat", 5, start=10)
        _write_broken(chat, "third")
        place.run(_spec([chat]))
        assert catalog.catalog_namespaces(place.store) == ["expansion_v1", "expansion_v2"]
        assert len(place.rows("expansion_v2")) == 5 and _load_rejects(place, "expansion_v2") == 1
        lineage = place.lineage("expansion_v2")
        assert (lineage["skipped_published"], lineage["old_rejects_skipped"]) == (10, 2)
        assert {r["prompt_id"] for r in place.rows("expansion_v2")}.isdisjoint(
            {r["prompt_id"] for r in place.rows("expansion_v1")}
        )

        # Night 4, 6 new rows and a target of 2 for the source: 2 published, the other 4 left for later.
        _write(chat, "chat", 6, start=15)
        place.run(_spec([chat], source_targets=[{"name": "chat", "count": 2}]))
        assert len(place.rows("expansion_v3")) == 2
        assert place.lineage("expansion_v3")["run_spec"]["source_targets"] == [{"name": "chat", "count": 2}]

        # Another run spec into a published namespace: refused, naming the run that published it; nothing written.
        before = sorted(o.key for o in place.store.list("expansion_v1/"))
        refused = place.run(_spec([chat], namespace="expansion_v1", shard_size=5), expect="FAILED")
        why = refused["state"].get("message") or ""
        assert "was published by another run" in why and first["name"] in why, refused["state"]
        assert sorted(o.key for o in place.store.list("expansion_v1/")) == before


@pytest.mark.parametrize("turns", ["last", "every"])
def test_one_box_and_two_boxes_publish_the_same_rows(
    turns: str, deployed: PrefectServer, local_s3: LocalS3, tmp_path: Path
) -> None:
    repo = Path(__file__).parents[2]
    sources = []
    for name in ("tool_calls_openai.jsonl", "tool_calls_sharegpt.jsonl"):
        rows = (repo / "data" / "prompts" / name).read_text(encoding="utf-8").splitlines(keepends=True)[:6]
        (tmp_path / name).write_text("".join(rows), encoding="utf-8")
        sources.append(tmp_path / name)
    _write_broken(sources[0], "x")
    spec = _spec(sources, namespace=f"same_{turns}", turns=turns, shard_size=3)
    spec["quality_gate"]["max_reject_rate"] = 1.0  # the stand-in's short replies fail some tool rounds: rejects too
    published: dict[str, tuple[list[Any], list[Any]]] = {}
    for where in ("one-box", "two-boxes"):
        with _place(where, deployed, local_s3, tmp_path / where) as place:
            place.run(spec)
            published[where] = (sorted(_rows(place, spec["namespace"])), sorted(_rejects(place, spec["namespace"])))
    assert published["one-box"][0] and published["one-box"][1]
    assert published["one-box"] == published["two-boxes"]


def test_a_one_box_and_a_two_box_run_of_one_namespace_started_together_never_interleave(
    deployed: PrefectServer, local_s3: LocalS3, tmp_path: Path
) -> None:
    """Issue 46.4 across deployments: the one-box `manual` run and the multi-box run of one namespace, started at
    once (each deployment's concurrency limit of 1 does not hold the other back). One generates and publishes; the
    other is refused, having written nothing: by the namespace's lease naming the first, or (when it starts after the
    first has published) as a published namespace. The namespace holds one run's rows, as a run alone publishes them,
    and the next expansion needs no repair."""
    chat = tmp_path / "chat.jsonl"
    _write(chat, "chat", 12)
    _write_broken(chat, "one")
    spec = _spec([chat], namespace="together", shard_size=3)
    with _place("one-box", deployed, local_s3, tmp_path / "alone") as alone:
        alone.run(spec)
        expected = (sorted(_rows(alone, "together")), sorted(_rejects(alone, "together")))
    with _place("one-box", deployed, local_s3, tmp_path / "both", also="two-boxes") as place:
        ids = {where: place.start(spec, where) for where in ("one-box", "two-boxes")}
        runs = {where: place.wait(run_id, where) for where, run_id in ids.items()}
        states = {where: run["state_type"] for where, run in runs.items()}
        assert sorted(states.values()) == ["COMPLETED", "FAILED"], runs
        loser = next(where for where, state in states.items() if state == "FAILED")
        winner = runs["two-boxes" if loser == "one-box" else "one-box"]
        why = runs[loser]["state"].get("message") or ""
        # Refused before any work: by the lease naming the run that holds the namespace, or (when it started after
        # the other had published) by the namespace being published.
        assert (
            f"namespace together is being run by flow run {winner['name']}" in why
            or "namespace 'together' is published; choose a new namespace" in why
        ), why
        published = (sorted(_rows(place, "together")), sorted(_rejects(place, "together")))
        assert published == expected
        assert catalog.catalog_namespaces(place.store) == ["together"]
        # Nothing to repair: the next expansion (`auto`), on either placement, is green and finds nothing new.
        for where in ("one-box", "two-boxes"):
            again = place.wait(place.start({**spec, "namespace": "auto"}, where), where)
            assert "Nothing new to generate" in (again["state"].get("message") or ""), (where, again["state"])
        assert catalog.catalog_namespaces(place.store) == ["together"]
        assert (sorted(_rows(place, "together")), sorted(_rejects(place, "together"))) == expected


def _rows(place: Place, namespace: str) -> list[tuple[Any, ...]]:
    return [(r["prompt_id"], r.get("turn_index"), r["input_ids"], r["loss_mask"]) for r in place.rows(namespace)]


def _rejects(place: Place, namespace: str) -> list[tuple[str, str, str]]:
    return [(r["prompt_id"] or "", r["stage"], r["reason"]) for r in place.rows(namespace, "rejects")]
