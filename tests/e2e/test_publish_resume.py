"""SIGKILL the pipeline at each step of its publish, run it again: the same objects as an uninterrupted run.

The flow runs as a real process with its own stand-in servers; it reports to a real Prefect server and writes to
SeaweedFS, one of each per test process, each test under its own PREFECT_HOME, work dir and S3 prefix.
`DATAGEN_FAULT_KILL_AT` (datagen/operations/faults.py, inert unless set) makes it SIGKILL itself right after the
named step.
After the kill the test ends what it left running, runs the same flow again, and compares every published object
with those of an uninterrupted run of the same prompts (under another S3 prefix, so that nothing but the first
attempt's run id and time, and the prefix in the manifest's URI, may differ). Finally an expansion
(`namespace: auto`, `skip_published: true`) over the same prompts must plan none of them.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import os
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations.faults import KILL_AT_ENV
from datagen.publishing import catalog
from datagen.publishing.pinned import PinnedFacts
from datagen.publishing.storage import ObjectStore
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from tasks.publishing import CLAIM_NAME, MANIFEST_NAME
from tests.e2e.test_crash_resume import _cleanup, _env, _kill_all, _run_flow, _tail
from tests.prefect_fixtures import CLIENT_RETRY_ENV, PrefectServer

pytestmark = pytest.mark.slow

NAMESPACE = "pubkill"  # not expansion_vN: the catalog's repair must not depend on the name
N_PROMPTS = 12
FAST_STANDIN = {
    "DATAGEN_STANDIN_STEP_BASE_MS": "5",
    "DATAGEN_STANDIN_TOKENS_PER_STEP": "8",
    "DATAGEN_STANDIN_LENGTH_MEAN": "60",
    "DATAGEN_STANDIN_LENGTH_MAX": "160",
}
WAIT_S = 900  # hang guard only


def _spec(prompts: Path, namespace: str = NAMESPACE, skip_published: bool = True) -> RunSpec:
    return RunSpec(
        sources=[PromptSource(path=str(prompts))],
        model_path=str(ensure_model_dir()),
        namespace=namespace,
        skip_published=skip_published,
        shard_size=4,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(max_reject_rate=0.5, min_median_completion_tokens=16),
    )


@dataclass
class Run:
    """One pipeline's place: its S3 prefix, work dir and env."""

    env: dict[str, str]
    tmp: Path
    store: ObjectStore

    @property
    def work_dir(self) -> Path:
        return Path(self.env["DATAGEN_WORK_DIR"])

    def facts(self) -> PinnedFacts:
        return PinnedFacts.model_validate_json((self.work_dir / "runs" / NAMESPACE / "pinned-facts.json").read_bytes())

    def flow(self, spec: RunSpec, name: str, kill_at: str | None = None) -> tuple[int, dict[str, Any]]:
        """Run the flow to its end (or its self-inflicted SIGKILL); exit code and what it reported."""
        spec_path, out, log = self.tmp / f"{name}.spec.json", self.tmp / f"{name}.json", self.tmp / "flow.log"
        spec_path.write_text(spec.model_dump_json())
        env = {**self.env, **({KILL_AT_ENV: kill_at} if kill_at else {})}
        proc = _run_flow(env, spec_path, out, log)
        rc = proc.wait(timeout=WAIT_S)
        # A killed flow leaves its Prefect server and stand-ins behind; a finished one may leave its server.
        _kill_all(self.work_dir)
        return rc, (json.loads(out.read_text()) if rc == 0 else {"log": _tail(log)})

    def objects(self) -> dict[str, bytes]:
        return {o.key[len(NAMESPACE) + 1 :]: self.store.get_bytes(o.key) for o in self.store.list(f"{NAMESPACE}/")}


@pytest.fixture(scope="module")
def prompts(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One prompt file for every run: its path is in the run spec and in reject rows, hence in the objects."""
    path = tmp_path_factory.mktemp("prompts") / "pubkill.jsonl"
    path.write_text(
        "".join(
            json.dumps({"messages": [{"role": "user", "content": f"Name {i} ways to reuse a glass jar."}]}) + "\n"
            for i in range(N_PROMPTS)
        )
    )
    return path


def _make_run(local_s3: LocalS3, server: PrefectServer, tmp: Path, prompts: Path) -> Run:
    tmp.mkdir(parents=True, exist_ok=True)
    # The flows report to a running server, not to one each starts for itself: 17 server starts fewer in this file.
    api = {"PREFECT_API_URL": server.api_url, "PREFECT_API_AUTH_STRING": server.auth_string, **CLIENT_RETRY_ENV}
    env = {**_env(local_s3, tmp), **FAST_STANDIN, **api}
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=env["DATAGEN_S3_PREFIX"]))
    return Run(env=env, tmp=tmp, store=store)


@pytest.fixture(scope="module")
def reference(
    local_s3: LocalS3,
    session_prefect_server: PrefectServer,
    tmp_path_factory: pytest.TempPathFactory,
    prompts: Path,
) -> Iterator[tuple[Run, dict[str, bytes]]]:
    """An uninterrupted run of the same prompts: its objects are what every interrupted run must end with."""
    run = _make_run(local_s3, session_prefect_server, tmp_path_factory.mktemp("reference"), prompts)
    with _cleanup(run.work_dir):
        rc, out = run.flow(_spec(prompts), "reference")
    assert rc == 0, f"the uninterrupted run failed:\n{out.get('log')}"
    yield run, run.objects()


def _as_in(ref: Run, ref_objects: dict[str, bytes], run: Run) -> dict[str, bytes]:
    """The reference's objects as `run` must have written them: its first attempt's run id and time, its prefix.

    The card changes first, then the claim that lists the card's sha256, then the manifest that lists both.
    """
    ours, theirs = run.facts(), ref.facts()
    pairs = [(theirs.created_at, ours.created_at), (ref.store.uri(), run.store.uri())]
    for a, b in ((theirs.run_id, ours.run_id), (theirs.run_name, ours.run_name)):
        if a and b:
            pairs.append((a, b))
            pairs.append((json.dumps(a)[1:-1], json.dumps(b)[1:-1]))  # as the manifest's JSON spells it
    out = dict(ref_objects)
    resized: dict[str, int] = {}  # sha256 of a rewritten object -> its new size (names differ in length)
    for key in ("README.md", CLAIM_NAME, MANIFEST_NAME):
        old = out[key]
        new = old
        for a, b in pairs:
            new = new.replace(a.encode(), b.encode())
        if resized:  # the claim and the manifest list what came before by sha256 and size: both written as JSON
            new = _resized(new, resized)
        out[key] = new
        pairs.append((hashlib.sha256(old).hexdigest(), hashlib.sha256(new).hexdigest()))
        resized[hashlib.sha256(new).hexdigest()] = len(new)
    return out


def _resized(body: bytes, sizes: dict[str, int]) -> bytes:
    """`body` (a JSON document as the publisher writes it) with each listed object's size and the total set anew."""
    doc = json.loads(body)

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("sha256") in sizes and "size" in node:
                node["size"] = sizes[node["sha256"]]
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(doc)
    if isinstance(doc.get("objects"), list) and "total_bytes" in doc:
        doc["total_bytes"] = sum(int(o["size"]) for o in doc["objects"])
    return (json.dumps(doc, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()


def _diff(got: dict[str, bytes], want: dict[str, bytes]) -> str:
    lines = []
    for key in sorted(got):
        if got[key] != want[key] and not key.endswith(".parquet"):
            a, b = want[key].decode(errors="replace"), got[key].decode(errors="replace")
            lines += [f"--- {key}", *difflib.unified_diff(a.splitlines(), b.splitlines(), lineterm="", n=0)]
    return "\n".join(lines)


@pytest.mark.parametrize(
    "kill_at",
    ["publish.after-claim", "publish.after-first-file", "publish.after-manifest", "catalog.before-part"],
)
def test_killed_publish_resumes_to_the_same_objects(
    kill_at: str,
    reference: tuple[Run, dict[str, bytes]],
    local_s3: LocalS3,
    session_prefect_server: PrefectServer,
    tmp_path: Path,
    prompts: Path,
) -> None:
    ref, ref_objects = reference
    run = _make_run(local_s3, session_prefect_server, tmp_path, prompts)
    with _cleanup(run.work_dir):
        rc, out = run.flow(_spec(prompts), "first", kill_at=kill_at)
        assert rc == -signal.SIGKILL, f"the first run was not killed at {kill_at} (exit {rc}):\n{out.get('log')}"
        left = run.objects()
        # The kill landed where it was asked to.
        assert CLAIM_NAME in left
        data = [k for k in left if k not in (CLAIM_NAME, MANIFEST_NAME)]
        if kill_at == "publish.after-claim":
            assert not data
        elif kill_at == "publish.after-first-file":
            # Files go up 4 at a time: the others in flight at the kill may have finished too.
            assert data and MANIFEST_NAME not in left
        else:
            assert MANIFEST_NAME in left
        assert run.store.head(catalog.part_key(NAMESPACE)) is None

        started = time.monotonic()
        rc, out = run.flow(_spec(prompts), "rerun")
        rerun_s = time.monotonic() - started
        assert rc == 0, f"the re-run after a kill at {kill_at} failed:\n{out.get('log')}"
        # The card and manifest carry the first attempt's date (pinned in the work dir and in the claim).
        assert json.loads(left[CLAIM_NAME])["created_at"] == run.facts().created_at
        # What the interruption cost: no request generated again; after the manifest, nothing but the catalog part.
        assert sum(int(s["sent"]) for s in out["shards"]) == 0
        if MANIFEST_NAME in left:
            assert out["report"]["already_published"] is True
        final = run.objects()
        # Figures for the README's table (printed with -s; never asserted: the machine is shared).
        print(f"COST {kill_at}: re-run {rerun_s:.0f} s; {len(left)} objects kept, {len(final) - len(left)} uploaded")
        # Objects the first attempt wrote are untouched (never replaced), and the whole namespace is byte for
        # byte what an uninterrupted run writes.
        assert {k: final[k] for k in left} == left
        expected = _as_in(ref, ref_objects, run)
        assert sorted(final) == sorted(expected)
        assert [k for k in sorted(final) if final[k] != expected[k]] == [], _diff(final, expected)
        # The catalog lists every prompt: the reference's part, byte for byte.
        part = catalog.part_key(NAMESPACE)
        assert run.store.get_bytes(part) == ref.store.get_bytes(part)

        # A following expansion over the same prompts generates none of them again.
        rc, out = run.flow(_spec(prompts, namespace="auto"), "expansion")
        assert rc == 0, f"the expansion failed:\n{out.get('log')}"
        assert out["report"]["prompts"] == 0, out["report"]
        assert out["report"]["skipped_published"] == N_PROMPTS
        assert sum(int(s["sent"]) for s in out["shards"]) == 0


def test_expansion_after_a_kill_before_the_catalog_part_skips_those_prompts(
    local_s3: LocalS3, session_prefect_server: PrefectServer, tmp_path: Path, prompts: Path
) -> None:
    """A namespace published without its part (any name, no re-run of it) is repaired before the next plan."""
    run = _make_run(local_s3, session_prefect_server, tmp_path, prompts)
    with _cleanup(run.work_dir):
        rc, out = run.flow(_spec(prompts, namespace="summer-set"), "first", kill_at="catalog.before-part")
        assert rc == -signal.SIGKILL, out.get("log")
        assert catalog.catalog_namespaces(run.store) == []
        rc, out = run.flow(_spec(prompts, namespace="auto"), "expansion")
        assert rc == 0, out.get("log")
        assert out["report"]["prompts"] == 0, out["report"]
        assert out["report"]["skipped_published"] == N_PROMPTS
    assert catalog.catalog_namespaces(run.store) == ["summer-set"]
    assert catalog.repair(run.store) == []  # idempotent: nothing left to backfill


def test_unfinishable_namespace_names_the_command_and_abandon_keeps_every_object(
    local_s3: LocalS3,
    session_prefect_server: PrefectServer,
    tmp_path: Path,
    prompts: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Work dir gone after a kill: the re-run names `datagen abandon`; abandoning adds one marker, deletes nothing."""
    run = _make_run(local_s3, session_prefect_server, tmp_path, prompts)
    with _cleanup(run.work_dir):
        rc, out = run.flow(_spec(prompts, skip_published=False), "first", kill_at="publish.after-first-file")
        assert rc == -signal.SIGKILL, out.get("log")
        before = run.objects()
        os.rename(run.work_dir, tmp_path / "lost-work-dir")  # the box's disk is gone
        rc, out = run.flow(_spec(prompts, skip_published=False), "rerun")
        assert rc != 0
        assert f"datagen abandon {NAMESPACE}" in out["log"], out["log"]
        assert run.objects() == before

    from flows.cli import main

    for key, value in run.env.items():
        if key.startswith("DATAGEN_S3_"):
            monkeypatch.setenv(key, value)
    assert main(["abandon", NAMESPACE, "--reason", "work dir lost"]) == 0
    assert main(["abandon", NAMESPACE]) == 0  # idempotent: the first marker stands
    after = run.objects()
    assert {k: after[k] for k in before} == before
    assert set(after) - set(before) == {"abandoned.json"}
    marker = json.loads(after["abandoned.json"])
    assert marker["reason"] == "work dir lost"
    assert sorted(o["key"] for o in marker["objects_left"]) == sorted(before)


def test_two_runs_of_one_namespace_started_together_never_interleave(
    reference: tuple[Run, dict[str, bytes]],
    local_s3: LocalS3,
    session_prefect_server: PrefectServer,
    tmp_path: Path,
    prompts: Path,
) -> None:
    """Issue 46.4: three runs of one spec started together on one box wrote the same checkpoint, failed, and every
    later run of the namespace failed the same way. Now one runs; the others are refused naming it, having written
    nothing; the namespace is byte for byte an uninterrupted run's, and a later run of it needs no repair."""
    ref, ref_objects = reference
    run = _make_run(local_s3, session_prefect_server, tmp_path, prompts)
    spec_path = tmp_path / "together.spec.json"
    spec_path.write_text(_spec(prompts).model_dump_json())
    with _cleanup(run.work_dir):
        procs = [
            _run_flow(run.env, spec_path, tmp_path / f"together-{i}.json", tmp_path / f"together-{i}.log")
            for i in range(3)
        ]
        codes = [p.wait(timeout=WAIT_S) for p in procs]
        _kill_all(run.work_dir)
        assert sorted(codes).count(0) == 1, codes
        winner = codes.index(0)
        for i in range(len(codes)):
            if i != winner:
                log = (tmp_path / f"together-{i}.log").read_text(errors="replace")
                # Refused by the namespace's lease (or this box's lock on its work dir), naming the other run.
                assert "is being run by flow run" in log or "is in use by another run on this box" in log, log[-3000:]
        final = run.objects()
        expected = _as_in(ref, ref_objects, run)
        assert sorted(final) == sorted(expected)
        assert [k for k in sorted(final) if final[k] != expected[k]] == [], _diff(final, expected)
        # The lease was released: the same spec again is the earlier attempt's "already published", at once.
        rc, out = run.flow(_spec(prompts), "again")
        assert rc == 0, out.get("log")
        assert out["report"]["already_published"] is True
