"""The catalog of published prompt ids, kept in S3 beside the data: one immutable part per published namespace.

    <prefix>_catalog/<namespace>.prompt-ids.parquet    prompt_id, source, category, status ("data" | "rejected"),
                                                        reason (a rejected prompt's reject reason)
    <prefix>_catalog/<namespace>.load-rejects.parquet  request_key, source, reason, location: the input rows the
                                                        namespace published as load rejects (only when it has any)

The load-rejects part lets a later expansion over the same (grown) source skip the rows it already published as
rejects instead of publishing and counting them again (tasks.planning); namespaces published before load rejects
were keyed have none, so their broken rows are published once more by the next expansion, then never again.

Prompt ids (datagen.identity): a part records the scheme of its ids in its parquet metadata (`datagen.id_scheme`),
taken from its namespace's manifest (`lineage.prompt_id_scheme`); a part without it lists legacy ids (the source
label and the recorded conversation's render), and its `source` labels are kept with the ids
(`published_prompt_ids` returns `KnownPrompts`), so an expansion matches those prompts under any label they
were published with. The catalog holds both schemes side by side; nothing in it is rewritten.

A part is written with `put_if_absent` right after its namespace's manifest, so it never changes once written and
the catalog is the union of its parts. `_catalog/` cannot collide with a namespace (namespaces start with a letter
or digit). A namespace published without its part (a crash between manifest and part, a publish from before the
catalog existed, or by another box) is backfilled from the namespace's own parquet files by `repair`, which every
run calls before it reads the catalog: whatever its name, a published namespace's prompts are never planned again.
"""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from datagen.identity import LEGACY_SCHEME, KnownPrompts, KnownRejects
from datagen.operations.faults import kill_point
from datagen.publishing.storage import ObjectExists, ObjectStore

__all__ = [
    "CATALOG_DIR",
    "CATALOG_SCHEMA",
    "EXPANSION_PREFIX",
    "LOAD_REJECTS_SCHEMA",
    "CatalogError",
    "backfill",
    "build_load_rejects",
    "build_part",
    "catalog_namespaces",
    "id_scheme_of",
    "load_rejects_key",
    "next_expansion_namespace",
    "part_key",
    "published_load_rejects",
    "published_prompt_ids",
    "repair",
    "write_part",
]

log = logging.getLogger(__name__)

CATALOG_DIR = "_catalog/"
EXPANSION_PREFIX = "expansion_v"
_PART_SUFFIX = ".prompt-ids.parquet"
_LOAD_REJECTS_SUFFIX = ".load-rejects.parquet"
_ROW_KEY_PREFIX = "row:"  # datagen.sources.prompts.LOAD_REJECT_KEY_PREFIX (storage code does not import the loaders)
_MANIFEST = "manifest.json"  # tasks.publishing.MANIFEST_NAME; repeated here so storage code does not import tasks
_SCHEME_KEY = b"datagen.id_scheme"  # a part's parquet metadata: the scheme of its prompt ids (none: legacy)
_EXPANSION_RE = re.compile(rf"^{EXPANSION_PREFIX}(\d+)$")

CATALOG_SCHEMA = pa.schema(
    [
        pa.field("prompt_id", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("category", pa.string()),
        pa.field("status", pa.string(), nullable=False),
        pa.field("reason", pa.string()),  # rejected rows: why (a part written before it existed has no column)
    ]
)


LOAD_REJECTS_SCHEMA = pa.schema(
    [
        pa.field("request_key", pa.string(), nullable=False),
        pa.field("source", pa.string(), nullable=False),
        pa.field("reason", pa.string(), nullable=False),
        pa.field("location", pa.string()),
    ]
)


class CatalogError(RuntimeError):
    """The catalog in S3 disagrees with what a namespace holds."""


def part_key(namespace: str) -> str:
    """Key (under the store's prefix) of one namespace's catalog part."""
    return f"{CATALOG_DIR}{namespace}{_PART_SUFFIX}"


def load_rejects_key(namespace: str) -> str:
    """Key (under the store's prefix) of the load rejects one namespace published (see the module docstring)."""
    return f"{CATALOG_DIR}{namespace}{_LOAD_REJECTS_SUFFIX}"


def _status_table(table: pa.Table, status: str, rank: int, file_no: int) -> pa.Table:
    """One file's rows as catalog columns plus sort keys (rank: data 0, rejected 1, a later turn's
    `earlier_turn_rejected` 2; seq: see below)."""
    n = table.num_rows
    category = table.column("category") if "category" in table.column_names else pa.nulls(n, pa.string())
    reason = table.column("reason") if "reason" in table.column_names else pa.nulls(n, pa.string())
    ranks: pa.Array | pa.ChunkedArray = pa.array([rank] * n, pa.int8())
    if rank and n:
        # A user turn after the one that ended its conversation says less than that turn's own reject: kept last.
        later = pc.fill_null(pc.equal(reason.cast(pa.string()), "earlier_turn_rejected"), False)
        ranks = pc.if_else(later, pa.scalar(rank + 1, pa.int8()), pa.scalar(rank, pa.int8()))
    return pa.table(
        {
            "prompt_id": table.column("prompt_id").cast(pa.string()),
            "source": table.column("source").cast(pa.string()),
            "category": category.cast(pa.string()),
            "status": pa.array([status] * n, pa.string()),
            "reason": reason.cast(pa.string()),
            "_rank": ranks,
            # Sorted descending: the last rejected row wins, the first data row (data rows come negated).
            "_seq": pa.array([(file_no << 40) + i if rank else -((file_no << 40) + i) for i in range(n)], pa.int64()),
        }
    )


def build_part(parquet_files: Iterable[tuple[str, bytes | Path]], id_scheme: str = LEGACY_SCHEME) -> bytes:
    """Catalog part bytes from a dataset's parquet files ("data/..." or "rejects/..." names), sorted by prompt id.

    `id_scheme`: the scheme of the namespace's prompt ids, recorded in the part (none is written for the legacy one,
    so a part is the bytes it always was for it).

    A prompt id listed more than once keeps `data` over `rejected`, else its last row. Built in Arrow, not as
    Python objects: at a million ids a dict of strings cost ~300 MB at the end of every run (scale benchmark).
    """
    parts: list[pa.Table] = []
    for file_no, (name, content) in enumerate(parquet_files):
        source = io.BytesIO(content) if isinstance(content, bytes) else content
        columns = [c for c in ("prompt_id", "source", "category", "reason") if c in pq.read_schema(source).names]
        if isinstance(source, io.BytesIO):
            source.seek(0)
        data = name.startswith("data/")
        table = pq.read_table(source, columns=columns)
        # Load rejects have no prompt id (the row never parsed): nothing to skip later.
        table = table.filter(pc.is_valid(table.column("prompt_id")))
        parts.append(_status_table(table, "data" if data else "rejected", 0 if data else 1, file_no))
    if parts:
        rows = pa.concat_tables(parts)
        rows = rows.take(
            pc.sort_indices(rows, [("prompt_id", "ascending"), ("_rank", "ascending"), ("_seq", "descending")])
        )
        ids = rows.column("prompt_id").combine_chunks()
        if len(ids) > 1:  # the first row of each run of equal ids is the one kept
            first = pc.not_equal(ids.slice(1), ids.slice(0, len(ids) - 1))
            rows = rows.filter(pa.concat_arrays([pa.array([True]), first]))
        table = rows.select(["prompt_id", "source", "category", "status", "reason"]).cast(CATALOG_SCHEMA)
    else:
        table = CATALOG_SCHEMA.empty_table()
    if id_scheme != LEGACY_SCHEME:
        table = table.replace_schema_metadata({_SCHEME_KEY: id_scheme.encode()})
    out = io.BytesIO()
    pq.write_table(table, out, compression="zstd")
    return out.getvalue()


def build_load_rejects(
    parquet_files: Iterable[tuple[str, bytes | Path]], id_scheme: str = LEGACY_SCHEME
) -> bytes | None:
    """The load-rejects part from a dataset's parquet files: keyed load rejects, sorted by key; None when none.

    `id_scheme` is recorded as in `build_part`: a part without it holds the keys of the code before issue 47.
    """
    tables: list[pa.Table] = []
    for name, content in parquet_files:
        if not name.startswith("rejects/"):
            continue
        source = io.BytesIO(content) if isinstance(content, bytes) else content
        names = pq.read_schema(source).names
        if not {"stage", "request_key", "source", "reason"} <= set(names):
            continue  # a rejects file from before load rejects were keyed
        if isinstance(source, io.BytesIO):
            source.seek(0)
        columns = ["stage", "request_key", "source", "reason", *(["location"] if "location" in names else [])]
        table = pq.read_table(source, columns=columns)
        keyed = pc.and_(
            pc.equal(table.column("stage"), "load"),
            pc.starts_with(pc.fill_null(table.column("request_key"), ""), _ROW_KEY_PREFIX),
        )
        table = table.filter(pc.fill_null(keyed, False))
        location = table.column("location") if "location" in table.column_names else pa.nulls(len(table), pa.string())
        tables.append(
            pa.table(
                {
                    "request_key": table.column("request_key").cast(pa.string()),
                    "source": table.column("source").cast(pa.string()),
                    "reason": table.column("reason").cast(pa.string()),
                    "location": location.cast(pa.string()),
                }
            )
        )
    rows = pa.concat_tables(tables) if tables else LOAD_REJECTS_SCHEMA.empty_table()
    if rows.num_rows == 0:
        return None
    rows = rows.take(pc.sort_indices(rows, [("request_key", "ascending")])).cast(LOAD_REJECTS_SCHEMA)
    if id_scheme != LEGACY_SCHEME:
        rows = rows.replace_schema_metadata({_SCHEME_KEY: id_scheme.encode()})
    out = io.BytesIO()
    pq.write_table(rows, out, compression="zstd")
    return out.getvalue()


def _staged_parquet(staging_dir: Path) -> list[tuple[str, bytes | Path]]:
    return [
        (f"{kind}/{p.name}", p) for kind in ("data", "rejects") for p in sorted((staging_dir / kind).glob("*.parquet"))
    ]


def write_part(store: ObjectStore, namespace: str, staging_dir: Path) -> int:
    """Write the catalog part of a just-published namespace from its staged files; returns the prompt ids in it.

    An existing part is accepted only when it lists exactly the same prompt ids (a resumed run). The load-rejects
    part goes first: the prompt-ids part marks a namespace catalogued (repair backfills only where it is missing).
    The ids' scheme is the one the namespace's manifest names.
    """
    files = _staged_parquet(staging_dir)
    scheme = id_scheme_of(store, namespace)
    _put_load_rejects(store, namespace, build_load_rejects(files, scheme))
    return _put_part(store, namespace, build_part(files, scheme))


def id_scheme_of(store: ObjectStore, namespace: str) -> str:
    """The prompt id scheme a published namespace's manifest names (`lineage.prompt_id_scheme`); legacy without."""
    key = f"{namespace}/{_MANIFEST}"
    if store.head(key) is None:
        return LEGACY_SCHEME
    try:
        lineage = json.loads(store.get_bytes(key)).get("lineage") or {}
        scheme = lineage.get("prompt_id_scheme")
    except (ValueError, AttributeError):
        return LEGACY_SCHEME
    return scheme if isinstance(scheme, str) else LEGACY_SCHEME


def _put_load_rejects(store: ObjectStore, namespace: str, body: bytes | None) -> None:
    if body is None:
        return  # no keyed load rejects: no object (most namespaces)
    key = load_rejects_key(namespace)
    try:
        store.put_if_absent(key, body)
    except ObjectExists:
        ours = _keys(body)
        theirs = _keys(store.get_bytes(key))
        if theirs != ours:
            raise CatalogError(
                f"{store.uri(key)} already exists and lists {len(theirs)} load rejects, but namespace {namespace!r} "
                f"published {len(ours)} different ones; the catalog part was not replaced"
            ) from None


def _keys(body: bytes) -> set[str]:
    return set(pq.read_table(io.BytesIO(body), columns=["request_key"]).column("request_key").to_pylist())


def published_load_rejects(store: ObjectStore, exclude: Iterable[str] = ()) -> KnownRejects:
    """The keys of every input row a namespace (but the `exclude` ones) published as a load reject, with the source
    labels of the parts written before issue 47 (their keys hold the label: datagen.identity.KnownRejects)."""
    skip = set(exclude)
    keys: set[str] = set()
    legacy_labels: set[str] = set()
    for o in store.list(CATALOG_DIR):
        name = o.key[len(CATALOG_DIR) :]
        if name.endswith(_LOAD_REJECTS_SUFFIX) and "/" not in name and name[: -len(_LOAD_REJECTS_SUFFIX)] not in skip:
            body = store.get_bytes(o.key)
            table = pq.read_table(io.BytesIO(body), columns=["request_key", "source"])
            keys |= set(table.column("request_key").to_pylist())
            if (table.schema.metadata or {}).get(_SCHEME_KEY) is None:
                legacy_labels |= set(pc.unique(table.column("source")).to_pylist())
    return KnownRejects(keys, legacy_labels)


def _put_part(store: ObjectStore, namespace: str, body: bytes) -> int:
    table = pq.read_table(io.BytesIO(body), columns=["prompt_id"])
    key = part_key(namespace)
    kill_point("catalog.before-part")
    try:
        store.put_if_absent(key, body)
    except ObjectExists:
        # Python strings only here: a million ids as a list cost ~100 MB at the end of every run (scale benchmark).
        ours = set(table.column("prompt_id").to_pylist())
        theirs = _part_ids(store, namespace)
        if theirs != ours:
            raise CatalogError(
                f"{store.uri(key)} already exists and lists {len(theirs)} prompt ids, but namespace {namespace!r} "
                f"holds {len(ours)} different ones; the catalog part was not replaced"
            ) from None
    return int(table.num_rows)


def _part_ids(store: ObjectStore, namespace: str) -> set[str]:
    table = pq.read_table(io.BytesIO(store.get_bytes(part_key(namespace))), columns=["prompt_id"])
    return set(table.column("prompt_id").to_pylist())


def catalog_namespaces(store: ObjectStore) -> list[str]:
    """Namespaces that have a catalog part, in key order."""
    return [
        o.key[len(CATALOG_DIR) : -len(_PART_SUFFIX)]
        for o in store.list(CATALOG_DIR)
        if o.key.endswith(_PART_SUFFIX) and "/" not in o.key[len(CATALOG_DIR) :]
    ]


def published_prompt_ids(store: ObjectStore, exclude: Iterable[str] = (), retry: Iterable[str] = ()) -> KnownPrompts:
    """Every prompt id in the catalog (data and rejected), except the parts of the `exclude` namespaces.

    A prompt whose only rows are rejects with a reason in `retry` is left out (a later run generates it again);
    a part from before the catalog kept reasons cannot tell, so its rejects stay in. The ids of both schemes, with
    the source labels of the parts whose ids are legacy (`KnownPrompts`, module docstring).
    """
    skip = set(exclude)
    retried = set(retry)
    ids: set[str] = set()
    legacy_labels: set[str] = set()
    for namespace in catalog_namespaces(store):
        if namespace in skip:
            continue
        body = store.get_bytes(part_key(namespace))
        legacy = (pq.read_schema(io.BytesIO(body)).metadata or {}).get(_SCHEME_KEY) is None
        # Python strings only for the columns needed: at a million ids each column costs ~100 MB.
        columns = None if retried else ["prompt_id", "source"] if legacy else ["prompt_id"]
        table = pq.read_table(io.BytesIO(body), columns=columns)
        if legacy:
            legacy_labels |= set(pc.unique(table.column("source")).to_pylist())
        if not retried:
            ids |= set(table.column("prompt_id").to_pylist())
            continue
        if "reason" not in table.column_names:
            log.warning("catalog: %s has no reject reasons; its rejects are not retried", part_key(namespace))
            ids |= set(table.column("prompt_id").to_pylist())
            continue
        again = pc.and_(
            pc.equal(table.column("status"), "rejected"), pc.is_in(table.column("reason"), pa.array(sorted(retried)))
        )
        again = pc.fill_null(again, False)
        ids |= set(table.filter(pc.invert(again)).column("prompt_id").to_pylist())
    # A prompt rejected for a retried reason here but published (or rejected otherwise) in another namespace: skipped.
    return KnownPrompts(ids, legacy_labels)


def backfill(store: ObjectStore, namespace: str) -> bool:
    """Write the missing catalog part of a published namespace from its parquet files; True if one was written.

    Reads the namespace's whole data files (the prompt_id column alone is not fetchable through ObjectStore): a
    recovery path, not the normal one.
    """
    if store.head(f"{namespace}/{_MANIFEST}") is None or store.head(part_key(namespace)) is not None:
        return False
    files: list[tuple[str, bytes | Path]] = [
        (o.key[len(namespace) + 1 :], store.get_bytes(o.key))
        for kind in ("data/", "rejects/")
        for o in store.list(f"{namespace}/{kind}")
        if o.key.endswith(".parquet")
    ]
    scheme = id_scheme_of(store, namespace)
    _put_load_rejects(store, namespace, build_load_rejects(files, scheme))
    n = _put_part(store, namespace, build_part(files, scheme))
    log.warning("catalog: backfilled %s with %d prompt ids (the part was missing)", part_key(namespace), n)
    return True


def repair(store: ObjectStore) -> list[str]:
    """Backfill the part of every published namespace (any name) that has none; the namespaces backfilled.

    One listing of the top-level names and of `_catalog/`, plus a HEAD per namespace without a part: cheap when
    nothing is missing, so it runs before every plan.
    """
    with_part = set(catalog_namespaces(store))
    repaired = []
    for namespace in store.children():
        if namespace.startswith("_") or namespace in with_part:
            continue  # _catalog/, _runs/ (multi-box exchange): not namespaces
        if backfill(store, namespace):
            repaired.append(namespace)
    return repaired


def next_expansion_namespace(store: ObjectStore) -> str:
    """The next free `expansion_vN`: one past the highest N that holds objects or a catalog part.

    Only reads (`datagen check` calls it too): `repair` backfills missing parts before every plan.
    """
    taken = {int(m.group(1)) for ns in catalog_namespaces(store) if (m := _EXPANSION_RE.match(ns))}
    n = 1
    # Probe upward: a namespace holds objects (even an unfinished publish) or has a part -> taken.
    while n in taken or store.exists(f"{EXPANSION_PREFIX}{n}/"):
        taken.add(n)
        n += 1
    return f"{EXPANSION_PREFIX}{max([n, *(t + 1 for t in taken)])}"
