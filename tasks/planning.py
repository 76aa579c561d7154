"""Shard planning: stream the run's prompt sources into fixed-size shard files and one load-rejects file.

Deterministic (same sources and shard size -> byte-identical files) and idempotent: a shard file that already
holds exactly what would be written is left untouched, so downstream checkpoints keyed on it stay valid. The
plan manifest (`plan.json` beside the shards) is written last and removed before the first file changes, so
its presence means the shard files it lists are complete.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import logging
import os
import re
import tempfile
from array import array
from collections import Counter
from collections.abc import Callable, Collection, Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import BaseModel, ConfigDict, Field

from datagen.checks.quality import GateReport, check_load_gate
from datagen.engine.memory_plan import PromptTokens
from datagen.identity import CONTENT_SCHEME, LEGACY_SCHEME, KnownPrompts, KnownRejects, PromptIdentity
from datagen.layout import RunLayout
from datagen.publishing.storage import sha256_file
from datagen.records import Prompt, Reject
from datagen.runspec import QualityGate, RunSpec
from datagen.sources.preparation import read_rendered, rendered_path, write_rendered
from datagen.sources.prompts import LoadReject, iter_prompts

__all__ = [
    "ShardEntry",
    "ShardPlan",
    "check_plan",
    "conversation_turns",
    "id_scheme",
    "plan_manifest_path",
    "plan_shards",
    "prompt_tokens",
    "read_plan",
]

log = logging.getLogger(__name__)

_SHARD_FILE_RE = re.compile(r"^shard-(\d{5,})\.prompts\.jsonl$")


class ShardEntry(BaseModel):
    """One shard file of a plan."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: int = Field(..., ge=0)
    n_prompts: int = Field(..., ge=1)
    sha256: str = Field(..., description="sha256 of the shard's prompts file.")


class ShardPlan(BaseModel):
    """What planning wrote: shard ids, checksums and counts (a reference to the data, never the data)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_size: int
    shard_ids: list[int]
    shards: list[ShardEntry]
    n_rows: int = Field(..., description="Rows read from all sources: n_prompts + n_load_rejects.")
    n_prompts: int
    n_load_rejects: int
    prompts_by_source: dict[str, int]
    load_rejects_by_source: dict[str, int]
    load_rejects_by_reason: dict[str, int]
    prompts_by_category: dict[str, int] = Field(..., description="Prompts per category; see n_uncategorized.")
    n_uncategorized: int = Field(..., description="Prompts without a category.")
    load_rejects_sha256: str
    plan_sha256: str = Field(..., description="sha256 over everything above: equal plans, equal files.")
    n_rows_in_sources: int | None = Field(
        None,
        description="Rows the sources hold, before selection (skipped published prompts included); not in "
        "plan_sha256. 0: the sources are empty. None: a plan written before this was counted.",
    )
    n_skipped_published: int = Field(
        0, description="Prompts this run read and skipped because another namespace published them (not in the hash)."
    )
    n_old_rejects_skipped: int = Field(
        0,
        description="Rows this run read and skipped because another namespace published them as load rejects "
        "(catalog load-rejects parts): neither counted by the gates nor published again (not in the hash).",
    )
    id_scheme: str = Field(
        LEGACY_SCHEME,
        description="The prompt id scheme of the shards (datagen.identity; not in the hash). A plan written before "
        "issue 47 has none: its ids are the legacy ones.",
    )


def plan_manifest_path(layout: RunLayout) -> Path:
    """Where the plan manifest of a run lives (written last: it marks a complete plan)."""
    return layout.shards_dir / "plan.json"


def plan_shards(
    spec: RunSpec,
    layout: RunLayout,
    base_dir: Path | None = None,
    select: Callable[[Iterator[Prompt | Reject]], Iterator[Prompt | Reject]] | None = None,
    published: Collection[str] = frozenset(),
    old_rejects: Collection[str] = frozenset(),
) -> ShardPlan:
    """Stream the spec's prompt sources into shard files and load rejects; keep files that already match.

    `published` (prompt ids) and `old_rejects` (load reject keys, datagen.sources.prompts) are what other namespaces
    published: those rows are skipped and counted, never planned or rejected again. `select` (optional) filters
    and reorders the rest before it is cut into shards (see tasks.selection and tasks.ordering); shards are
    written in the order it yields, which is the dispatch order.
    """
    # Resolves every source first: a config error raises here, before any file is touched.
    # Prompt ids follow the rendered token ids under the model's template (see PromptIdentity); the ids it
    # renders are written beside each shard for generation (render once: datagen.sources.preparation).
    identity = PromptIdentity.for_spec(spec, id_scheme(layout))
    read = _Counted(iter_prompts(spec.sources, base_dir, identity))
    known = _SkipPublished(read, published, old_rejects)
    items: Iterator[Prompt | Reject] = iter(known)
    if select is not None:
        items = select(items)
    layout.shards_dir.mkdir(parents=True, exist_ok=True)
    layout.load_rejects.parent.mkdir(parents=True, exist_ok=True)
    manifest = plan_manifest_path(layout)
    invalidate = _Invalidator(manifest)

    shards: list[ShardEntry] = []
    by_source: Counter[str] = Counter()
    rejects_by_source: Counter[str] = Counter()
    rejects_by_reason: Counter[str] = Counter()
    by_category: Counter[str] = Counter()
    n_uncategorized = 0

    rejects_out = _HashingWriter(layout.load_rejects)
    shard_out: _HashingWriter | None = None
    shard_count = 0
    shard_ids_rendered: list[array[int] | None] = []

    def commit_shard(out: _HashingWriter) -> None:
        sha = out.commit(invalidate)
        shards.append(ShardEntry(shard_id=len(shards), n_prompts=shard_count, sha256=sha))
        write_rendered(out.target, sha, identity.preparer.render_key, shard_ids_rendered)
        shard_ids_rendered.clear()

    try:
        for item in items:
            if isinstance(item, Reject):
                rejects_out.write_line(item.to_json())
                rejects_by_source[item.source] += 1
                rejects_by_reason[item.reason] += 1
                continue
            if shard_out is None:
                shard_out = _HashingWriter(layout.shard_prompts(len(shards)))
                shard_count = 0
            shard_out.write_line(item.to_json())
            shard_ids_rendered.append(item.input_ids)
            shard_count += 1
            by_source[item.source] += 1
            if item.category is None:
                n_uncategorized += 1
            else:
                by_category[item.category] += 1
            if shard_count == spec.shard_size:
                commit_shard(shard_out)
                shard_out = None
        if shard_out is not None:
            commit_shard(shard_out)
            shard_out = None
        rejects_sha = rejects_out.commit(invalidate)
    finally:
        if shard_out is not None:
            shard_out.discard()
        rejects_out.discard()

    _remove_stale_shards(layout, len(shards), invalidate)
    n_prompts = sum(by_source.values())
    n_rejects = sum(rejects_by_source.values())
    body = {
        "shard_size": spec.shard_size,
        "shard_ids": [s.shard_id for s in shards],
        "shards": [s.model_dump() for s in shards],
        "n_rows": n_prompts + n_rejects,
        "n_prompts": n_prompts,
        "n_load_rejects": n_rejects,
        "prompts_by_source": dict(sorted(by_source.items())),
        "load_rejects_by_source": dict(sorted(rejects_by_source.items())),
        "load_rejects_by_reason": dict(sorted(rejects_by_reason.items())),
        "prompts_by_category": dict(sorted(by_category.items())),
        "n_uncategorized": n_uncategorized,
        "load_rejects_sha256": rejects_sha,
    }
    plan_sha = hashlib.sha256(json.dumps(body, sort_keys=True).encode("utf-8")).hexdigest()
    plan = ShardPlan.model_validate(
        {
            **body,
            "plan_sha256": plan_sha,
            "n_rows_in_sources": read.n,
            "n_skipped_published": known.n_published,
            "n_old_rejects_skipped": known.n_old_rejects,
            "id_scheme": identity.scheme,
        }
    )

    manifest_out = _HashingWriter(manifest)
    try:
        manifest_out.write_line(plan.model_dump_json(indent=2))
        manifest_out.commit(lambda: None)
    finally:
        manifest_out.discard()
    log.info(
        "planned %d prompts in %d shards (%d load rejects, %d files rewritten)",
        n_prompts,
        len(shards),
        n_rejects,
        invalidate.changed,
    )
    return plan


def id_scheme(layout: RunLayout) -> str:
    """The prompt id scheme of a run's work dir (datagen.identity), fixed by its first plan and kept from then on.

    A work dir the code before issue 47 planned (shard files and no scheme recorded) keeps the legacy ids, so its
    checkpoints (keyed by them) still settle its requests when the run is resumed; any other gets the content ids.
    """
    path = layout.id_scheme_file
    if path.is_file():
        recorded = path.read_text(encoding="utf-8").strip()
        if recorded in (CONTENT_SCHEME, LEGACY_SCHEME):
            return recorded
        raise ValueError(f"{path}: unknown prompt id scheme {recorded!r}")
    planned_before = layout.shards_dir.is_dir() and any(layout.shards_dir.glob("shard-*.prompts.jsonl"))
    scheme = LEGACY_SCHEME if planned_before else CONTENT_SCHEME
    if planned_before:
        log.warning(
            "%s was planned before prompt ids became the content's (issue 47): this run keeps the ids it had, so its "
            "checkpoints still count",
            layout.root,
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(scheme + "\n", encoding="utf-8")
    os.replace(tmp, path)
    return scheme


def check_plan(plan: ShardPlan, gate: QualityGate, layout: RunLayout) -> GateReport:
    """The gate on load rejects alone; raises QualityGateError (reasons, counts, reject file) when it fails."""
    report = check_load_gate(
        plan.n_rows,
        plan.n_prompts,
        plan.load_rejects_by_reason,
        gate,
        str(layout.load_rejects),
        n_skipped_published=plan.n_skipped_published,
        n_old_rejects=plan.n_old_rejects_skipped,
    )
    report.raise_if_failed()
    return report


def read_plan(layout: RunLayout, verify: bool = True) -> ShardPlan | None:
    """The run's complete plan, or None when there is none or (with verify) a listed file no longer matches."""
    manifest = plan_manifest_path(layout)
    if not manifest.is_file():
        return None
    plan = ShardPlan.model_validate_json(manifest.read_text(encoding="utf-8"))
    if not verify:
        return plan
    expected = [(layout.shard_prompts(s.shard_id), s.sha256) for s in plan.shards]
    expected.append((layout.load_rejects, plan.load_rejects_sha256))
    for path, sha in expected:
        if not path.is_file() or sha256_file(path) != sha:
            return None
    return plan


class _Counted:
    """Passes a stream through, counting its items (rows read before any selection)."""

    def __init__(self, items: Iterator[Prompt | Reject]) -> None:
        self._items = items
        self.n = 0

    def __iter__(self) -> Iterator[Prompt | Reject]:
        return self

    def __next__(self) -> Prompt | Reject:
        item = next(self._items)
        self.n += 1
        return item


class _SkipPublished:
    """Drops (and counts) the prompts and load rejects other namespaces published; passes the rest through.

    A prompt is published when the catalog holds either of its ids (datagen.identity.KnownPrompts); a load reject
    when either of its keys is listed (the content key, or the key the code before issue 47 gave it). A second row
    of a published prompt (a `duplicate_prompt` reject: the same prompt in another file, or again in its own) is a
    published prompt too: skipped and counted as one, never a new reject.
    """

    def __init__(self, items: Iterator[Prompt | Reject], published: Collection[str], old_rejects: Collection[str]):
        self._items = items
        self._published = published
        self._old_rejects = old_rejects
        self.n_published = 0
        self.n_old_rejects = 0

    def _holds(self, prompt_id: str | None, alias: str | None, rendered: array[int] | None) -> bool:
        published = self._published
        if isinstance(published, KnownPrompts):
            return published.holds(prompt_id, alias, rendered)
        return (prompt_id is not None and prompt_id in published) or (alias is not None and alias in published)

    def _old(self, item: Reject) -> bool:
        old = self._old_rejects
        if not isinstance(item, LoadReject):
            return item.request_key is not None and item.request_key in old
        if isinstance(old, KnownRejects):
            return old.holds(item.request_key, item.row, item.legacy_content)
        return item.request_key in old or item.legacy_key in old

    def __iter__(self) -> Iterator[Prompt | Reject]:
        for item in self._items:
            if isinstance(item, Reject):
                if self._old(item):
                    self.n_old_rejects += 1
                    continue
                if (
                    isinstance(item, LoadReject)
                    and item.reason == "duplicate_prompt"
                    and self._holds(item.prompt_id, item.alias, item.rendered)
                ):
                    self.n_published += 1
                    continue
            elif self._holds(item.prompt_id, item.alias, item.input_ids):
                self.n_published += 1
                continue
            yield item


class _Invalidator:
    """Removes the manifest once, just before the first planned file changes (a crash then leaves no manifest)."""

    def __init__(self, manifest: Path) -> None:
        self._manifest = manifest
        self.changed = 0

    def __call__(self) -> None:
        if self.changed == 0:
            self._manifest.unlink(missing_ok=True)
        self.changed += 1


class _HashingWriter:
    """Writes to a temp file beside `target`, hashing as it goes; commit() renames it over the target atomically."""

    def __init__(self, target: Path) -> None:
        self.target = target
        fd, name = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
        # mkstemp makes the file private (0600); shard files are ordinary data files others may read.
        os.fchmod(fd, 0o644)
        self._tmp = Path(name)
        self._file = os.fdopen(fd, "wb")
        self._sha = hashlib.sha256()
        self._size = 0

    def write_line(self, line: str) -> None:
        data = (line + "\n").encode("utf-8")
        self._file.write(data)
        self._sha.update(data)
        self._size += len(data)

    def commit(self, before_change: Callable[[], None]) -> str:
        """Replace the target unless it already holds these bytes; returns their sha256."""
        digest = self._sha.hexdigest()
        self._file.flush()
        os.fsync(self._file.fileno())
        self._file.close()
        target = self.target
        if target.is_file() and target.stat().st_size == self._size and sha256_file(target) == digest:
            # Identical: keep the existing file (same inode and mtime) so nothing downstream sees a change.
            self._tmp.unlink()
        else:
            before_change()
            os.replace(self._tmp, target)
        return digest

    def discard(self) -> None:
        """Drop the temp file if it was not committed."""
        if not self._file.closed:
            self._file.close()
        self._tmp.unlink(missing_ok=True)


def _remove_stale_shards(layout: RunLayout, n_shards: int, before_change: Callable[[], None]) -> None:
    # A smaller plan than last time: shard files past its end belong to no plan any more.
    for path in sorted(layout.shards_dir.iterdir()):
        match = _SHARD_FILE_RE.match(path.name)
        if match and int(match.group(1)) >= n_shards:
            before_change()
            path.unlink()
            rendered_path(path).unlink(missing_ok=True)


def prompt_tokens(plan: ShardPlan, layout: RunLayout, spec: RunSpec) -> PromptTokens | None:
    """The planned prompts' lengths in tokens, from the render cache planning wrote beside each shard.

    For the memory plan (expected context, longest request). Shards without a cache made for this render (none
    is written when a row has no ids) are left out and the source says how many were measured; None when no
    shard has one.
    """
    render_key = PromptIdentity.for_spec(spec).preparer.render_key
    chunks: list[pa.Array] = []
    for entry in plan.shards:
        rendered = read_rendered(layout.shard_prompts(entry.shard_id), render_key)
        if rendered is not None:
            chunks.append(rendered.lengths())
    lengths = pa.chunked_array(chunks, pa.int32())
    if len(lengths) == 0:
        return None
    where = f"measured at planning from the rendered prompts of {len(chunks)} of {len(plan.shards)} shards"
    # Arrow computes over the offsets: no Python int per prompt at 1M prompts.
    p99 = pc.quantile(lengths, q=PromptTokens.PERCENTILE, interpolation="higher")[0].as_py()
    return PromptTokens(len(lengths), pc.mean(lengths).as_py(), int(p99), pc.max(lengths).as_py(), where)


def conversation_turns(plan: ShardPlan, layout: RunLayout, sample: int = 20_000) -> float:
    """Mean turns a conversation would generate if every turn were regenerated: 1 + its assistant turns.

    Read from the first prompts of every shard, up to `sample` in all (a mean needs no full pass over 1M rows).
    """
    per_shard = max(1, sample // max(1, len(plan.shards)))
    counts: list[int] = []
    for entry in plan.shards:
        with open(layout.shard_prompts(entry.shard_id), encoding="utf-8") as f:
            for line in itertools.islice((ln for ln in f if ln.strip()), per_shard):
                prompt = Prompt.from_json(line)
                counts.append(1 + sum(1 for m in prompt.messages if m.role == "assistant"))
    return sum(counts) / len(counts) if counts else 1.0
