"""`datagen inspect [NAMESPACE]`: the namespaces in S3, or what one holds; reads through `ObjectStore` only."""

from __future__ import annotations

import io
import json
from collections import Counter, defaultdict
from typing import Any

import pyarrow.parquet as pq

from datagen.operations.report import human_bytes
from datagen.publishing.storage import ObjectStore, StorageError

__all__ = ["inspect_namespace", "list_namespaces"]

MANIFEST = "manifest.json"
CARD = "README.md"
# The summary counts conversations from the rows' columns when the data files are at most this large (S3 reads
# whole objects); a run records its own counts in the manifest's lineage.
ROW_COLUMNS_READ_LIMIT = 256 * 1024 * 1024


def _rejects(store: ObjectStore, keys: list[str], examples: int) -> tuple[Counter[str], dict[str, list[str]]]:
    counts: Counter[str] = Counter()
    shown: dict[str, list[str]] = defaultdict(list)
    for key in keys:
        table = pq.read_table(io.BytesIO(store.get_bytes(key)), columns=["stage", "reason", "detail", "prompt_id"])
        for row in table.to_pylist():
            label = f"{row['stage']}/{row['reason']}"
            counts[label] += 1
            if len(shown[label]) < examples:
                detail = str(row["detail"])
                shown[label].append(f"{row['prompt_id'] or '-'}: {detail[:200]}{'…' if len(detail) > 200 else ''}")
    return counts, shown


def list_namespaces(store: ObjectStore) -> str:
    """One line per namespace under the store's prefix: published (when, rows, size) or an unfinished publish."""
    # `_catalog/`, `_preflight/` and other underscore names are the pipeline's own, never namespaces.
    names = [n for n in store.children() if n and not n.startswith("_")]
    if not names:
        return f"{store.uri()}: no namespaces yet"
    lines = [f"{len(names)} namespace{'s' if len(names) != 1 else ''} in {store.uri()}:"]
    for ns in names:
        if store.head(f"{ns}/{MANIFEST}") is None:
            objects = list(store.list(ns + "/"))
            size = human_bytes(sum(o.size for o in objects))
            lines.append(f"  {ns}  NOT PUBLISHED ({len(objects)} objects, {size}: an unfinished publish)")
            continue
        manifest: dict[str, Any] = json.loads(store.get_bytes(f"{ns}/{MANIFEST}"))
        lineage = manifest.get("lineage", {})
        rows = (
            lineage.get("rows") if isinstance(lineage.get("rows"), int) else manifest.get("total_rows", {}).get("data")
        )
        rows_text = f"{rows:,} rows" if isinstance(rows, int) else "rows unknown"
        turns = lineage.get("conversations")
        if isinstance(turns, dict):  # every-turn mode: the run's own counts
            rows_text += f" from {turns.get('conversations_finished', 0):,} conversations"
        lines.append(
            f"  {ns}  published {manifest.get('created_at')}, {rows_text}, "
            f"{human_bytes(int(manifest.get('total_bytes', 0)))}"
        )
    lines.append("details of one: datagen inspect NAMESPACE")
    return "\n".join(lines)


def _conversation_counts(store: ObjectStore, ns: str, manifest: dict[str, Any]) -> list[str]:
    """Conversations and turns: the run's own counts (every-turn mode records them), else the rows' columns."""
    keys = [str(e.get("key", "")) for e in manifest.get("objects", [])]
    lines: list[str] = []
    turns = manifest.get("lineage", {}).get("conversations")
    if isinstance(turns, dict):
        outcomes = ", ".join(f"{k} {v:,}" for k, v in (turns.get("conversations_by_outcome") or {}).items())
        lines.append(
            f"conversations: {turns.get('conversations_finished', 0):,} finished of "
            f"{turns.get('conversations_planned', 0):,} planned; {turns.get('steps', 0):,} steps generated, "
            f"{turns.get('user_turns', 0):,} user turns answered" + (f"; ended: {outcomes}" if outcomes else "")
        )
        if isinstance(turns.get("published"), int):
            lines.append(
                f"published: {turns['published']:,} conversations, {turns.get('published_user_turns', 0):,} user "
                "turns (one row each)"
            )
    data = [e for e in manifest.get("objects", []) if str(e.get("key", "")).startswith("data/")]
    size = sum(int(e.get("size", 0)) for e in data)
    if size > ROW_COLUMNS_READ_LIMIT:
        lines.append(f"rows per conversation: not counted here ({human_bytes(size)} of data files)")
    elif data:
        try:
            lines.append(_row_columns(store, ns, [str(e["key"]) for e in data]))
        except (StorageError, OSError, ValueError, KeyError) as exc:
            lines.append(f"rows per conversation: could not be read ({exc})")
    if any(k.startswith("conversations/") for k in keys):
        lines.append(f"one conversation, readable: datagen inspect {ns} --conversation [ID]")
    return lines


def _row_columns(store: ObjectStore, ns: str, keys: list[str]) -> str:
    """'12 conversations in 30 rows (user-turn segments), 41 loss spans' from the rows' conversation columns."""
    ids: set[str] = set()
    rows = spans = 0
    for key in keys:
        parquet = pq.ParquetFile(io.BytesIO(store.get_bytes(f"{ns}/{key}")))
        if "conversation_id" not in parquet.schema_arrow.names:  # written before the conversation columns existed
            return "rows per conversation: not recorded (rows written before the conversation columns)"
        for row in parquet.read(columns=["prompt_id", "conversation_id", "num_loss_spans"]).to_pylist():
            ids.add(str(row["conversation_id"] or row["prompt_id"]))
            rows += 1
            spans += int(row["num_loss_spans"] or 1)
    return f"conversations in the rows: {len(ids):,} in {rows:,} rows (user-turn segments), {spans:,} loss spans"


def inspect_namespace(store: ObjectStore, namespace: str, examples: int = 2) -> tuple[str, bool]:
    """(text, published?) describing the namespace: manifest summary, files, rejects by reason with examples, card."""
    ns = namespace.strip("/")
    objects = list(store.list(ns + "/"))
    if not objects:
        return f"{store.uri(ns + '/')}: nothing there (no such namespace)", False
    keys = {o.key[len(ns) + 1 :]: o for o in objects}
    lines = [f"namespace {ns}: {store.uri(ns + '/')}"]
    if MANIFEST not in keys:
        lines.append(
            f"NOT PUBLISHED: no {MANIFEST} ({len(objects)} objects, {human_bytes(sum(o.size for o in objects))}); "
            "an interrupted publish leaves this, and the same run resumes it"
        )
        return "\n".join(lines), False
    manifest: dict[str, Any] = json.loads(store.get_bytes(f"{ns}/{MANIFEST}"))
    lineage = manifest.get("lineage", {})
    totals = manifest.get("total_rows", {})
    # The flow records its counts in the lineage; the manifest counts each object's rows from the files themselves
    # (a namespace published before issue 47 has none there: total_rows 0).
    rows = lineage.get("rows") if isinstance(lineage.get("rows"), int) else totals.get("data", 0)
    rejects = lineage.get("rejects") if isinstance(lineage.get("rejects"), int) else totals.get("rejects", 0)
    lines += [
        f"published {manifest.get('created_at')}: {rows:,} rows, {rejects:,} rejects, "
        f"{len(manifest.get('objects', []))} objects, {human_bytes(int(manifest.get('total_bytes', 0)))}",
        f"model {lineage.get('model_path')} (fingerprint {str(lineage.get('model_fingerprint'))[:12]}), "
        f"engine {lineage.get('engine')} {lineage.get('engine_version') or ''}".rstrip(),
    ]
    if isinstance(lineage.get("duplicate_rows"), int):
        lines.append(
            f"identical rows: {lineage['duplicate_rows']:,} rows repeat an earlier row "
            f"({lineage.get('duplicate_row_groups', 0):,} distinct rows with copies; kept)"
        )
    lines += _conversation_counts(store, ns, manifest)
    lines += ["", "files:"]
    for entry in manifest.get("objects", []):
        rows = f", {entry['rows']:,} rows" if "rows" in entry else ""
        lines.append(f"  {entry['key']}  {human_bytes(int(entry['size']))}{rows}")
    reject_keys = [f"{ns}/{k}" for k in sorted(keys) if k.startswith("rejects/") and k.endswith(".parquet")]
    try:
        counts, shown = _rejects(store, reject_keys, examples)
    except (StorageError, OSError, ValueError) as exc:
        lines += ["", f"rejects: could not be read ({exc})"]
    else:
        lines += ["", "rejects by reason:" if counts else "rejects: none"]
        for label, n in counts.most_common():
            lines.append(f"  {label}: {n:,}")
            lines += [f"      e.g. {example}" for example in shown[label]]
    if CARD in keys:
        lines += ["", f"dataset card ({CARD}):", "", store.get_bytes(f"{ns}/{CARD}").decode("utf-8", "replace")]
    return "\n".join(lines), True
