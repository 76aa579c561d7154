"""Publish a staged dataset to `s3://bucket/prefix/<namespace>/`, never replacing or deleting anything.

Order of writes under the namespace:

1. `publish-claim.json`: the sorted list of (key, size, sha256) to be published, plus the manifest's date and
   lineage. Whoever creates it owns the namespace; a re-run of the same files finds its own claim and resumes
   (the manifest is built from that claim, so every attempt writes the same bytes), any other publish is refused
   before it writes a byte of data, with the one command that unblocks it (`datagen abandon`).
2. every file of the staging directory, keyed by its relative path (data/*.parquet, conversations/*.jsonl,
   rejects/*.parquet, README.md), with its sha256 as object metadata; files already there with the same sha256
   are skipped.
3. `manifest.json`, LAST: every object with size and sha256, row counts, and the lineage. A namespace without
   manifest.json holds an incomplete dataset. A re-run that finds its own manifest there is done. Rows are counted
   from the staged files themselves (`staged_rows`: a parquet file's row count, a JSON-lines file's lines), so
   `total_rows` and each object's `rows` are what a reader of the namespace finds.

A namespace that can never be finished (its run's work dir is gone) is marked with `abandoned.json` by
`abandon`: one more object, nothing deleted or replaced; nothing is published there afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import time
from collections.abc import Callable, Iterable
from concurrent.futures import FIRST_EXCEPTION, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, TypeVar

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import BaseModel, Field

from datagen.operations.faults import kill_point
from datagen.publishing.storage import ObjectExists, ObjectInfo, ObjectStore, sha256_file

__all__ = [
    "ABANDONED_NAME",
    "CLAIM_NAME",
    "MANIFEST_NAME",
    "PublishError",
    "PublishResult",
    "StagedFile",
    "abandon",
    "claimed_as_staged",
    "publish",
    "published_as_staged",
    "refuse_other_run",
    "stage_files",
    "staged_rows",
]

CLAIM_NAME = "publish-claim.json"
MANIFEST_NAME = "manifest.json"
MANIFEST_FORMAT = "datagen-manifest/1"
CLAIM_FORMAT = "datagen-publish-claim/2"
ABANDONED_NAME = "abandoned.json"
ABANDONED_FORMAT = "datagen-abandoned/1"
DEFAULT_WORKERS = 4

log = logging.getLogger(__name__)

_T = TypeVar("_T")
_R = TypeVar("_R")


class PublishError(RuntimeError):
    """Publishing was refused or stopped; the message names the namespace or the offending s3:// key."""


class StagedFile(BaseModel):
    """One file to publish: its key relative to the namespace, size and sha256."""

    key: str
    size: int
    sha256: str


class PublishResult(BaseModel):
    """What a publish wrote (or, in a dry run, would write)."""

    uri: str = Field(description="s3://bucket/prefix/namespace/")
    namespace: str
    objects: int = Field(description="Objects of the published dataset, claim and manifest included.")
    bytes: int = Field(description="Their total size in bytes.")
    manifest_key: str = Field(description="Key of manifest.json, relative to the store's prefix.")
    written: list[str] = Field(default_factory=list, description="Keys written by this call (empty in a dry run).")
    skipped: list[str] = Field(default_factory=list, description="Keys already there with identical sha256.")
    planned: list[str] = Field(default_factory=list, description="Dry run only: keys that would be written.")
    dry_run: bool = False


def stage_files(staging_dir: Path, workers: int = DEFAULT_WORKERS) -> list[StagedFile]:
    """Every file under staging_dir with relative key, size and sha256, sorted by key."""
    root = Path(staging_dir)
    if not root.is_dir():
        raise PublishError(f"staging directory {root} does not exist")
    paths = sorted(p for p in root.rglob("*") if p.is_file())
    if not paths:
        raise PublishError(f"staging directory {root} is empty: nothing to publish")
    keys = [p.relative_to(root).as_posix() for p in paths]
    for reserved in (CLAIM_NAME, MANIFEST_NAME):
        if reserved in keys:
            raise PublishError(f"{root / reserved} is reserved for the publisher; remove it from the staging directory")
    # hashlib releases the GIL on large buffers, so hashing in threads uses several cores.
    digests = _parallel(sha256_file, paths, workers)
    return [StagedFile(key=k, size=p.stat().st_size, sha256=d) for k, p, d in zip(keys, paths, digests, strict=True)]


def _parallel(fn: Callable[[_T], _R], items: Iterable[_T], workers: int) -> list[_R]:
    """fn over items in a thread pool, results in order; the first failure cancels what has not started."""
    items = list(items)
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures: list[Future[_R]] = [pool.submit(fn, item) for item in items]
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        for future in futures:
            error = future.exception() if future in done else None
            if error is not None:
                for other in futures:
                    other.cancel()
                raise error
        return [f.result() for f in futures]


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _json_bytes(body: dict[str, Any], ns: str) -> bytes:
    try:
        return (json.dumps(body, indent=1, sort_keys=True, allow_nan=False) + "\n").encode()
    except (TypeError, ValueError) as exc:
        raise PublishError(f"lineage for namespace {ns!r} is not plain JSON: {exc}") from None


def _claim_body(namespace: str, files: list[StagedFile], created_at: str, lineage: dict[str, Any]) -> bytes:
    # The files, and what the manifest will say besides them: a resumed publish builds the manifest from the
    # claim it finds, so the manifest is the first attempt's whatever the resuming run knows (issue 24).
    body = {
        "format": CLAIM_FORMAT,
        "namespace": namespace,
        "objects": [f.model_dump() for f in files],
        "created_at": created_at,
        "lineage": lineage,
    }
    return _json_bytes(body, namespace)


def _manifest_body(
    uri: str,
    namespace: str,
    objects: list[StagedFile],
    lineage: dict[str, Any],
    row_counts: dict[str, int],
    created_at: str,
) -> bytes:
    entries = []
    for obj in objects:
        entry: dict[str, Any] = obj.model_dump()
        if obj.key in row_counts:
            entry["rows"] = row_counts[obj.key]
        entries.append(entry)
    body = {
        "format": MANIFEST_FORMAT,
        "uri": uri,
        "namespace": namespace,
        "created_at": created_at,
        "objects": entries,
        "total_bytes": sum(o.size for o in objects),
        "total_rows": {
            "data": sum(n for k, n in row_counts.items() if k.startswith("data/") and k.endswith(".parquet")),
            "rejects": sum(n for k, n in row_counts.items() if k.startswith("rejects/") and k.endswith(".parquet")),
            "conversations": sum(n for k, n in row_counts.items() if k.startswith("conversations/")),
        },
        "lineage": lineage,
    }
    return _json_bytes(body, namespace)


def staged_rows(staging_dir: Path, files: list[StagedFile]) -> dict[str, int]:
    """Rows of each staged dataset file: a parquet file's row count (its footer), a JSON-lines file's lines."""
    rows: dict[str, int] = {}
    for f in files:
        path = Path(staging_dir) / f.key
        if f.key.endswith(".parquet"):
            try:
                rows[f.key] = pq.read_metadata(path).num_rows
            except (pa.ArrowException, OSError) as exc:  # published as the bytes it is; its rows are not known
                log.warning("%s: not a readable parquet file, its rows are not counted in the manifest: %s", path, exc)
        elif f.key.endswith(".jsonl"):
            with path.open("rb") as handle:
                rows[f.key] = sum(1 for line in handle if line.strip())
    return rows


def _row_counts(lineage: dict[str, Any]) -> dict[str, int]:
    raw = lineage.get("row_counts", {})
    if not isinstance(raw, dict) or not all(isinstance(k, str) and isinstance(v, int) for k, v in raw.items()):
        raise PublishError("lineage['row_counts'] must map object keys (e.g. 'data/part-00000.parquet') to ints")
    return dict(raw)


def _read_claim(store: ObjectStore, key: str) -> tuple[bytes, dict[str, Any]] | None:
    """The claim's bytes and body, or None when there is none."""
    if store.head(key) is None:
        return None
    raw = store.get_bytes(key)
    try:
        body = json.loads(raw)
    except ValueError:
        body = None
    if not isinstance(body, dict) or not isinstance(body.get("objects"), list):
        raise PublishError(f"{store.uri(key)} is not a publish claim; namespace {key.split('/')[0]!r} holds other data")
    return raw, body


def _same_files(claim: dict[str, Any], files: list[StagedFile]) -> bool:
    return bool(claim.get("objects") == [f.model_dump() for f in files])


def _unfinished_by_others(store: ObjectStore, claim_key: str, ns: str, claim: dict[str, Any]) -> PublishError:
    raw = claim.get("lineage")
    lineage: dict[str, Any] = raw if isinstance(raw, dict) else {}
    who = ", ".join(
        f"{k} {v}" for k, v in (("claimed", claim.get("created_at")), ("plan", lineage.get("plan_sha256"))) if v
    )
    return PublishError(
        f"{store.uri(claim_key)} already exists: namespace {ns!r} holds an unfinished publish of other files"
        f"{f' ({who})' if who else ''}; this run cannot finish it and wrote nothing there. To finish it, re-run "
        "the run that claimed it (same namespace, same DATAGEN_WORK_DIR: it re-publishes the same bytes); if that "
        f"run's work dir is gone, mark the namespace abandoned with `datagen abandon {ns}` and publish under a new one"
    )


def _refuse_abandoned(store: ObjectStore, ns: str) -> None:
    key = f"{ns}/{ABANDONED_NAME}"
    if store.head(key) is not None:
        raise PublishError(
            f"{store.uri(key)} exists: namespace {ns!r} was abandoned (its objects stay as they are, nothing is "
            "written there any more); publish under a new namespace"
        )


def publish(
    staging_dir: Path,
    namespace: str,
    store: ObjectStore,
    lineage: dict[str, Any],
    dry_run: bool = False,
    workers: int = DEFAULT_WORKERS,
    created_at: str | None = None,
) -> PublishResult:
    """Upload staging_dir under namespace/ (claim first, manifest last), resuming an interrupted identical publish.

    `lineage` goes into the manifest verbatim (run spec, model fingerprint, SGLang version, GPU type,
    chat-template hash, pipeline version); an optional `lineage["row_counts"]` maps keys to row counts.
    `created_at` (default: now) dates the manifest. A publish that finds its own claim (same files) takes the
    manifest's lineage and date from that claim, so every attempt writes the same bytes; a namespace whose
    manifest is already the one this publish would write counts as published by it (nothing is written).
    """
    ns = namespace.strip("/")
    if not ns or "/" in ns or ns in (".", ".."):
        raise PublishError(f"invalid namespace {namespace!r}")
    uri = store.uri(ns + "/")
    manifest_key = f"{ns}/{MANIFEST_NAME}"
    claim_key = f"{ns}/{CLAIM_NAME}"

    files = stage_files(staging_dir, workers)
    row_counts = _row_counts(lineage)
    unknown = sorted(set(row_counts) - {f.key for f in files})
    if unknown:
        raise PublishError(f"lineage['row_counts'] names files that are not staged: {unknown[:5]}")
    # Built (and validated) before any write: a lineage that is not JSON must not leave a half-published namespace.
    claim = _claim_body(ns, files, created_at or _now(), lineage)
    _refuse_abandoned(store, ns)
    found = _read_claim(store, claim_key)
    if found is not None:
        if not _same_files(found[1], files):
            if store.head(manifest_key) is not None:
                raise PublishError(_published(store, manifest_key, ns))
            raise _unfinished_by_others(store, claim_key, ns, found[1])
        claim = found[0]  # our own earlier attempt's claim: its bytes, lineage and date stand

    def manifest_for(claim_bytes: bytes) -> tuple[StagedFile, bytes]:
        body = json.loads(claim_bytes)
        first = StagedFile(key=CLAIM_NAME, size=len(claim_bytes), sha256=hashlib.sha256(claim_bytes).hexdigest())
        # Old claims (no lineage or date in them) leave this attempt's.
        pinned_lineage = body.get("lineage", lineage)
        pinned_at = str(body.get("created_at") or created_at or _now())
        # Counted from the files (the claim's own, by their sha256): a lineage's counts can only add files.
        rows = _row_counts(pinned_lineage) | staged_rows(staging_dir, files)
        return first, _manifest_body(uri, ns, [first, *files], pinned_lineage, rows, pinned_at)

    claim_file, manifest = manifest_for(claim)
    expected = {f.key: f for f in [claim_file, *files]}
    # One rule with the manifest's total_bytes and `datagen inspect`: the dataset's objects, not the manifest.
    total_bytes = sum(f.size for f in expected.values())
    result = PublishResult(
        uri=uri, namespace=ns, objects=len(expected) + 1, bytes=total_bytes, manifest_key=manifest_key, dry_run=dry_run
    )

    published = store.head(manifest_key)
    if published is not None:
        if found is not None and published.sha256 == hashlib.sha256(manifest).hexdigest():
            # An earlier attempt of this publish got as far as the manifest (then was killed): it is done.
            result.skipped = sorted([f"{ns}/{k}" for k in expected] + [manifest_key])
            return result
        raise PublishError(_published(store, manifest_key, ns))
    present = _verify_existing(store, ns, expected, workers)

    to_write = [f for f in files if f.key not in present]
    claim_needed = CLAIM_NAME not in present
    result.skipped = sorted(f"{ns}/{k}" for k in present)
    if dry_run:
        result.planned = ([claim_key] if claim_needed else []) + [f"{ns}/{f.key}" for f in to_write] + [manifest_key]
        return result

    if claim_needed:
        try:
            store.put_if_absent(claim_key, claim, sha256=claim_file.sha256)
            result.written.append(claim_key)
        except ObjectExists:
            # Lost a race for the namespace; a claim of the same files is a twin publish of them: its claim stands.
            raced = _read_claim(store, claim_key)
            if raced is None or not _same_files(raced[1], files):
                raise PublishError(
                    f"{store.uri(claim_key)} was just created by another publish of different files; "
                    f"namespace {ns!r} is taken: choose a new namespace"
                ) from None
            claim_file, manifest = manifest_for(raced[0])
            result.skipped.append(claim_key)
    kill_point("publish.after-claim")

    staging = Path(staging_dir)

    def upload(f: StagedFile) -> bool:
        key = f"{ns}/{f.key}"
        try:
            store.put_if_absent(key, staging / f.key, sha256=f.sha256)
        except ObjectExists as exc:
            if exc.existing_sha256 == f.sha256:
                return False  # identical bytes arrived meanwhile (a twin publish): nothing to do
            raise PublishError(
                f"{store.uri(key)} appeared during the upload with different content "
                f"(sha256 {exc.existing_sha256}, ours {f.sha256}); publish stopped, nothing was replaced"
            ) from None
        kill_point("publish.after-first-file")
        return True

    uploaded = _parallel(upload, to_write, workers)
    for f, wrote in zip(to_write, uploaded, strict=True):
        (result.written if wrote else result.skipped).append(f"{ns}/{f.key}")

    # Before the manifest makes the dataset visible, the namespace must hold exactly our objects.
    stray = sorted(o.key for o in store.list(ns + "/") if o.key[len(ns) + 1 :] not in expected)
    if stray:
        raise PublishError(
            f"{store.uri(stray[0])} (and {len(stray) - 1} more) appeared in namespace {ns!r} during the publish "
            "and is not part of this dataset; manifest not written"
        )
    try:
        store.put_if_absent(manifest_key, manifest)
        result.written.append(manifest_key)
    except ObjectExists as exc:
        if exc.existing_sha256 != hashlib.sha256(manifest).hexdigest():
            raise PublishError(
                f"{store.uri(manifest_key)} was written by another publish meanwhile; namespace {ns!r} is published"
            ) from None
        result.skipped.append(manifest_key)  # a twin publish of the same claim finished first
    kill_point("publish.after-manifest")
    result.skipped.sort()
    return result


def _published(store: ObjectStore, manifest_key: str, ns: str) -> str:
    return (
        f"{store.uri(manifest_key)} already exists: the dataset in namespace {ns!r} is published; "
        "choose a new namespace"
    )


def published_as_staged(store: ObjectStore, namespace: str, staging_dir: Path) -> dict[str, Any] | None:
    """The namespace's manifest if it lists exactly the files staged in staging_dir (this run published it)."""
    ns = namespace.strip("/")
    key = f"{ns}/{MANIFEST_NAME}"
    if not Path(staging_dir).is_dir() or store.head(key) is None:
        return None
    try:
        files = stage_files(staging_dir)
        manifest = json.loads(store.get_bytes(key))
        listed = [{k: o[k] for k in ("key", "size", "sha256")} for o in manifest["objects"] if o["key"] != CLAIM_NAME]
    except (PublishError, ValueError, KeyError, TypeError):
        return None  # not this run's (or not a manifest of ours): the publish step refuses it with its reason
    return manifest if listed == [f.model_dump() for f in files] else None


def claimed_as_staged(store: ObjectStore, namespace: str, staging_dir: Path) -> dict[str, Any] | None:
    """The claim of an unfinished publish of exactly the files staged in staging_dir (no manifest yet), else None.

    Such a publish is finished from those files as they are (`publish` takes the claim's lineage and date), without
    validating or tokenizing again: what a resumed run would stage may differ from what was claimed (a newer
    pipeline writes other columns), and a claim is a promise of these bytes.
    """
    ns = namespace.strip("/")
    if not Path(staging_dir).is_dir() or store.head(f"{ns}/{MANIFEST_NAME}") is not None:
        return None
    try:
        found = _read_claim(store, f"{ns}/{CLAIM_NAME}")
        files = stage_files(staging_dir)
    except PublishError:
        return None  # not a claim of ours, or nothing staged: the publish step refuses it with its reason
    if found is None or not _same_files(found[1], files):
        return None
    return found[1]


def refuse_other_run(store: ObjectStore, namespace: str, run_spec: dict[str, Any]) -> None:
    """Raise PublishError when `namespace` is published with another run spec than `run_spec` (its JSON form).

    Only the fields both specs have are compared, at every depth (a namespace published before a field existed
    is still this run's when the rest agrees); a manifest without a run spec cannot tell, and is left to `publish`.
    """
    ns = namespace.strip("/")
    key = f"{ns}/{MANIFEST_NAME}"
    if store.head(key) is None:
        return
    try:
        manifest = json.loads(store.get_bytes(key))
        lineage = manifest.get("lineage") or {}
        theirs = lineage.get("run_spec")
    except (ValueError, AttributeError):
        return  # not a manifest of ours: publish refuses it with its own reason
    if not isinstance(theirs, dict):
        return
    differs = sorted(k for k in theirs.keys() & run_spec.keys() if _spec_differs(theirs[k], run_spec[k]))
    if not differs:
        return
    who = ", ".join(
        f"{what} {value}"
        for what, value in (
            ("run", lineage.get("run_name")),
            ("run id", lineage.get("run_id")),
            ("published", manifest.get("created_at")),
        )
        if value
    )
    raise PublishError(
        f"{store.uri(key)} exists: namespace {ns!r} was published by another run ({who or 'an earlier run'}) "
        f"with a different run spec ({', '.join(differs)} differ); this run wrote nothing and publishes no new "
        "dataset there. Run it under a new namespace (or 'auto'); to resume that run, use its run spec"
    )


def _spec_differs(theirs: Any, ours: Any) -> bool:
    """Whether two run spec values differ, comparing only the keys both objects have, at every depth."""
    if isinstance(theirs, dict) and isinstance(ours, dict):
        return any(_spec_differs(theirs[k], ours[k]) for k in theirs.keys() & ours.keys())
    if isinstance(theirs, list) and isinstance(ours, list):
        return len(theirs) != len(ours) or any(_spec_differs(a, b) for a, b in zip(theirs, ours, strict=True))
    return bool(theirs != ours)


def abandon(store: ObjectStore, namespace: str, reason: str) -> str:
    """Mark an unfinished namespace abandoned (one new marker object; nothing deleted or replaced); its s3:// URI.

    Idempotent. A published namespace (it has a manifest) cannot be abandoned.
    """
    ns = namespace.strip("/")
    if not ns or "/" in ns or ns in (".", ".."):
        raise PublishError(f"invalid namespace {namespace!r}")
    key = f"{ns}/{ABANDONED_NAME}"
    if store.head(f"{ns}/{MANIFEST_NAME}") is not None:
        raise PublishError(
            f"{store.uri(ns + '/' + MANIFEST_NAME)} exists: namespace {ns!r} is published; there is nothing to abandon"
        )
    left = [o for o in store.list(ns + "/") if o.key != key]
    if not left and store.head(key) is None:
        raise PublishError(f"{store.uri(ns + '/')} holds nothing: there is no unfinished publish to abandon")
    found = _read_claim(store, f"{ns}/{CLAIM_NAME}") if any(o.key.endswith("/" + CLAIM_NAME) for o in left) else None
    body = {
        "format": ABANDONED_FORMAT,
        "namespace": ns,
        "abandoned_at": _now(),
        "reason": reason,
        "claim": {k: found[1].get(k) for k in ("created_at", "lineage")} if found else None,
        "objects_left": [{"key": o.key[len(ns) + 1 :], "size": o.size} for o in left],
    }
    with contextlib.suppress(ObjectExists):  # abandoned before: the first marker stands
        store.put_if_absent(key, _json_bytes(body, ns))
    return store.uri(key)


def _verify_existing(store: ObjectStore, ns: str, expected: dict[str, StagedFile], workers: int) -> set[str]:
    """Keys (relative to the namespace) already present with our sha256; refuse anything else found there."""
    existing = list(store.list(ns + "/"))
    for obj in existing:
        rel = obj.key[len(ns) + 1 :]
        if rel not in expected:
            raise PublishError(
                f"{store.uri(obj.key)} already exists and is not part of this dataset: namespace {ns!r} holds "
                "other data; choose a new namespace"
            )
        if obj.size != expected[rel].size:
            raise PublishError(_differs(store, obj.key, f"size {obj.size}, ours {expected[rel].size}", ns))

    def check(obj: ObjectInfo) -> str:
        rel = obj.key[len(ns) + 1 :]
        head = store.head(obj.key)
        found = head.sha256 if head is not None else None
        if found != expected[rel].sha256:
            raise PublishError(_differs(store, obj.key, f"sha256 {found}, ours {expected[rel].sha256}", ns))
        return rel

    return set(_parallel(check, existing, workers))


def _differs(store: ObjectStore, key: str, what: str, ns: str) -> str:
    return (
        f"{store.uri(key)} already exists with different content ({what}); it will not be replaced: "
        "choose a new namespace"
    )
