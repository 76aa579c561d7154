"""Shared run state of a multi-box run in S3: the plan, shard claims with leases, checkpoint parts, done markers.

Everything lives under `_runs/<namespace>/` in the store and is only ever created, never replaced:

    plan.json                                        the plan (shard ids, checksums) every box works from
    shards/shard-00042.prompts.jsonl                 a shard's prompts
    shards/shard-00042.input-ids.arrow               planning's render of them (a cache: datagen.sources.preparation)
    claims/shard-00042/000007.json                   claim number 7: box, owner token, lease expiry
    checkpoints/shard-00042/completions/part-<box>-<owner>-000003.jsonl   checkpoint rows, in immutable parts
    checkpoints/shard-00042/rejects/part-<box>-<owner>-000004.jsonl
    done/shard-00042.json                            written once every request of the shard is in the parts

Nothing can be overwritten, so a lease renewal or a takeover is the next claim number, created with
put_if_absent: two boxes racing for number n+1 cannot both win. The highest claim whose lease has not
expired owns the shard. Lease expiry is read against each box's own clock: keep boxes on NTP.
A box that loses its lease while still working only wastes work: parts may then hold a request twice,
and every reader dedupes by request_key (a completion wins over a reject, then the first part in key order).

In `turns: every` mode a row is one step of a conversation (request key `<key>:step-N`,
datagen/conversation/turn_mode.py) and rows are merged per conversation, not per key: two owners that both
generated step N (the first kept working after its lease was taken over) wrote two different step-N lines, and
step N+1 of each follows only its own.
Readers keep one chain of step lines per conversation, each line following the one before it
(`datagen.conversation.regeneration.follows`): a settled chain (its last line has an outcome, or a reject line
settles the step after it) over an unsettled one, then the longer, then the one whose line comes first in part
key order.
The other owner's lines are dropped and named in `ShardRows.conflicts`. A shard is complete when every one of
its conversations is settled.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from datagen.checkpoint import CheckpointLine, CheckpointTail, json_row, lines_of, read_lines, write_lines
from datagen.conversation.ledger import read_ledger
from datagen.conversation.regeneration import follows, split_step_key
from datagen.conversation.turn_mode import TurnMode
from datagen.layout import RunLayout
from datagen.publishing.run_lease import RUNS_PREFIX
from datagen.publishing.storage import ObjectExists, ObjectStore
from datagen.records import Completion
from datagen.sources.preparation import install_rendered, rendered_path
from tasks.generation import ShardResult
from tasks.planning import ShardPlan, plan_manifest_path

__all__ = [
    "RUNS_PREFIX",
    "CheckpointSync",
    "Claim",
    "CollectedShard",
    "IncompleteShard",
    "Lease",
    "RowMerge",
    "RunStateConflict",
    "ShardExchange",
    "ShardExchangeError",
    "ShardRows",
    "merge_steps",
]

logger = logging.getLogger("datagen.exchange")

_KINDS = ("completions", "rejects")


class ShardExchangeError(RuntimeError):
    """The shared run state in S3 is not what this run expects."""


class RunStateConflict(ShardExchangeError):
    """The namespace's run state was made by a different plan; it is never replaced (use a new namespace)."""


class IncompleteShard(ShardExchangeError):
    """A shard's checkpoint parts in S3 do not hold exactly its requests."""


class Claim(BaseModel):
    """One claim object: who holds a shard until when."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    shard_id: int
    seq: int = Field(..., ge=1, description="Claim number; the object's name.")
    box: str
    owner: str = Field(..., description="Token of the claiming process (one per per-box flow run).")
    expires_at: float = Field(..., description="Unix time the lease ends unless renewed (the claimer's clock).")


@dataclass
class Lease:
    """A claim this process holds (mutable: renewal moves seq and expiry)."""

    shard_id: int
    seq: int
    expires_at: float
    lost: bool = False


@dataclass
class ShardRows:
    """A shard's rows merged from every part: request_key -> JSON line, plus what the merge dropped."""

    completions: dict[str, str] = field(default_factory=dict)
    rejects: dict[str, str] = field(default_factory=dict)
    duplicates: int = 0
    rows_by_box: Counter[str] = field(default_factory=Counter)
    # `turns: every` only: the conversations the rows settle, the prompt id of each conversation seen, and a
    # message per conversation whose lines from two owners diverged (which were kept, which dropped).
    settled: set[str] = field(default_factory=set)
    conversations: dict[str, str] = field(default_factory=dict)
    conflicts: list[str] = field(default_factory=list)

    @property
    def keys(self) -> set[str]:
        return set(self.completions) | set(self.rejects)


class CollectedShard(BaseModel):
    """A shard collected from S3 into the local layout."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    result: ShardResult
    duplicates_dropped: int = Field(description="Rows found in more than one part (kept once).")
    rows_by_box: dict[str, int] = Field(description="Kept rows per box that generated them.")
    conflicts: list[str] = Field(
        default_factory=list,
        description="`turns: every`: conversations two owners generated differently, and whose lines were kept.",
    )


def _shard_name(shard_id: int) -> str:
    return f"shard-{shard_id:05d}"


def _request_key(line: str, where: str) -> str:
    """The row's request_key; `where` is its file (or part URI) and line, for CheckpointError and ours."""
    key = json_row(line, where).get("request_key")
    if not isinstance(key, str):
        raise ShardExchangeError(f"{where}: a row has no request_key")
    return key


def _part_box(key: str) -> str:
    # part-<box>-<owner>-<seq>.jsonl; box names may contain '-', owner and seq do not.
    return key.rsplit("/", 1)[-1].removeprefix("part-").rsplit("-", 2)[0]


def _local_rows(path: Path) -> list[tuple[str, str, str]]:
    """(file:line, box "", line) of a local checkpoint's committed lines (datagen.checkpoint's torn-line rule)."""
    return [(f"{path}:{line.lineno}", "", line.text) for line in read_lines(path)]


@dataclass(frozen=True, slots=True)
class _StepLine:
    line: str
    box: str  # the part's box ("" for a line of the local checkpoint)
    step: Completion

    @property
    def generation(self) -> tuple[str, tuple[int, ...]]:
        return self.step.text, tuple(self.step.output_ids)


def _chain(
    steps: dict[int, list[_StepLine]], rejected: set[int], enable_thinking: bool
) -> tuple[bool, list[_StepLine]]:
    """(settled, chain) of one conversation: the step lines kept, each following the one before it.

    A settled chain over an unsettled one, then the longer, then the first in the lines' order (part key order):
    lines of one generation written twice count once.
    """
    best: tuple[tuple[bool, int], list[_StepLine]] = ((False, -1), [])

    def walk(chain: list[_StepLine]) -> None:
        nonlocal best
        n = len(chain)
        ended = bool(chain) and chain[-1].step.outcome is not None
        options: dict[tuple[str, tuple[int, ...]], _StepLine] = {}
        if not ended:
            for s in steps.get(n, ()):
                if not chain or follows(chain[-1].step, s.step, enable_thinking):
                    options.setdefault(s.generation, s)
        if not options:
            score = (ended or n in rejected, n)
            if score > best[0]:
                best = (score, list(chain))
            return
        for s in options.values():
            walk([*chain, s])

    walk([])
    return best[0][0], best[1]


def merge_steps(
    completions: Iterable[tuple[str, str, str]], rejects: Iterable[tuple[str, str, str]], enable_thinking: bool
) -> ShardRows:
    """`turns: every`: one chain of step lines per conversation from (where, box, line) rows of every part.

    Rows are read in the order given (part key order): a conversation's rows keep that order's first of each
    generation. A reject line settles a chain only at the step after its last line (the first such reject wins);
    every other line is a duplicate (same generation) or a conflict (another owner's generation).
    """
    merged = ShardRows()
    lines: dict[str, dict[int, list[_StepLine]]] = {}
    reject_lines: dict[str, dict[int, list[tuple[str, str]]]] = {}
    order: dict[str, None] = {}  # conversations in the order their first row came
    total = 0
    for kind, rows in (("completions", completions), ("rejects", rejects)):
        for where, box, line in rows:
            total += 1
            key = _request_key(line, where)
            split = split_step_key(key)
            if split is None:
                raise ShardExchangeError(
                    f"{where}: row {key!r} is not a step of a conversation (`turns: every` writes `<key>:step-N`): "
                    "a part of another mode's run; use a new namespace"
                )
            conv, step = split
            order.setdefault(conv)
            if kind == "completions":
                c = Completion.from_json(line)
                merged.conversations.setdefault(conv, c.prompt_id)
                lines.setdefault(conv, {}).setdefault(step, []).append(_StepLine(line, box, c))
            else:
                merged.conversations.setdefault(conv, str(json_row(line, where).get("prompt_id", "?")))
                reject_lines.setdefault(conv, {}).setdefault(step, []).append((line, box))
    kept = 0
    for conv in order:
        steps, rejected = lines.get(conv, {}), reject_lines.get(conv, {})
        settled, chain = _chain(steps, set(rejected), enable_thinking)
        ended = bool(chain) and chain[-1].step.outcome is not None
        for s in chain:
            merged.completions[s.step.request_key] = s.line
            merged.rows_by_box[s.box] += 1
        kept += len(chain)
        if not ended and len(chain) in rejected:
            line, box = rejected[len(chain)][0]
            merged.rejects[_request_key(line, box)] = line
            merged.rows_by_box[box] += 1
            kept += 1
        if settled:
            merged.settled.add(conv)
        chosen = {s.generation for s in chain}
        other = [s for n, group in steps.items() for s in group if s.generation not in chosen]
        if other:
            merged.conflicts.append(
                f"conversation {merged.conversations[conv]} ({conv}): two owners generated it differently; kept "
                f"{len(chain)} step lines (boxes {', '.join(sorted({s.box for s in chain}))}), dropped "
                f"{len(other)} lines of another generation (steps {', '.join(str(s.step.step) for s in other)}, "
                f"boxes {', '.join(sorted({s.box for s in other}))})"
            )
    merged.duplicates = total - kept
    return merged


_Row = tuple[str, str, str]  # (where: file or part URI and line, box "" for the local checkpoint, the line)


class RowMerge(ABC):
    """How a shard's rows from several writers become one set: the run's turn mode's unit (`TurnMode.merge_unit`).

    Chosen once per exchange (`ShardExchange.merge`); each method is one place the exchange merges or checks rows.
    """

    @abstractmethod
    def read(self, parts: dict[str, list[_Row]]) -> ShardRows:
        """Every kind's rows of the shard's parts (`ShardExchange._part_rows`) merged."""

    @abstractmethod
    def restore(self, parts: dict[str, list[_Row]], completions_path: Path, rejects_path: Path) -> set[str]:
        """Merge the parts into the local checkpoint files (keeping local-only rows); return the keys whose kept
        line S3 holds."""

    @abstractmethod
    def incomplete(self, shard_id: int, remote: ShardRows, n_prompts: int) -> str | None:
        """Why the shard's rows in S3 do not finish its `n_prompts` prompts after the final upload (None: they do)."""

    @abstractmethod
    def collect(
        self,
        shard_id: int,
        rows: ShardRows,
        completions_path: Path,
        rejects_path: Path,
        expected: set[str] | dict[str, str],
    ) -> None:
        """Write the merged rows into the local checkpoint files; IncompleteShard unless they are exactly the
        `expected` conversations' (keys; a dict: each one's prompt id, for the messages)."""


class RequestMerge(RowMerge):
    """`turns: last`: a conversation is one line; rows are deduped by request_key (completion over reject, then
    the first part in key order)."""

    def read(self, parts: dict[str, list[_Row]]) -> ShardRows:
        merged = ShardRows()
        for kind in _KINDS:
            target = merged.completions if kind == "completions" else merged.rejects
            for where, box, line in parts[kind]:
                request = _request_key(line, where)
                if request in merged.completions or request in target:
                    merged.duplicates += 1
                    continue
                target[request] = line
                merged.rows_by_box[box] += 1
        # A request completed by one box and rejected by another (both ran it after a lease takeover): keep one.
        for request in set(merged.rejects) & set(merged.completions):
            del merged.rejects[request]
            merged.duplicates += 1
        return merged

    def restore(self, parts: dict[str, list[_Row]], completions_path: Path, rejects_path: Path) -> set[str]:
        remote = self.read(parts)
        for kind, path in (("completions", completions_path), ("rejects", rejects_path)):
            rows = dict(remote.completions if kind == "completions" else remote.rejects)
            for where, _, line in _local_rows(path):
                request = _request_key(line, where)
                if request not in remote.completions and request not in rows:
                    rows[request] = line
            if kind == "rejects":
                # A local reject for a request another box completed: the completion wins.
                for request in list(rows):
                    if request in remote.completions:
                        del rows[request]
            write_lines(path, rows.values())
        return remote.keys

    def incomplete(self, shard_id: int, remote: ShardRows, n_prompts: int) -> str | None:
        if len(remote.keys) == n_prompts:
            return None
        return (
            f"shard {shard_id}: S3 parts hold {len(remote.keys)} of {n_prompts} requests after the final upload; "
            "not marking it done"
        )

    def collect(
        self,
        shard_id: int,
        rows: ShardRows,
        completions_path: Path,
        rejects_path: Path,
        expected: set[str] | dict[str, str],
    ) -> None:
        keys = set(expected)
        missing, extra = keys - rows.keys, rows.keys - keys
        if missing or extra:
            raise IncompleteShard(
                f"shard {shard_id}: parts hold {len(rows.keys)} requests; {len(missing)} of the shard's "
                f"{len(keys)} are missing and {len(extra)} do not belong to it (spec or model changed?)"
            )
        write_lines(completions_path, rows.completions.values())
        write_lines(rejects_path, rows.rejects.values())


class ConversationMerge(RowMerge):
    """`turns: every`: one chain of step lines per conversation (`merge_steps`); `enable_thinking`: the run's, which
    decides what a step's generated turn looks like in the next step's history."""

    def __init__(self, enable_thinking: bool) -> None:
        self.enable_thinking = enable_thinking

    def read(self, parts: dict[str, list[_Row]]) -> ShardRows:
        return merge_steps(parts["completions"], parts["rejects"], self.enable_thinking)

    def restore(self, parts: dict[str, list[_Row]], completions_path: Path, rejects_path: Path) -> set[str]:
        # Each conversation's chain is chosen over the parts' lines and then the local ones, so the ledger resumes
        # it after its last kept step.
        merged = merge_steps(
            [*parts["completions"], *_local_rows(completions_path)],
            [*parts["rejects"], *_local_rows(rejects_path)],
            self.enable_thinking,
        )
        write_lines(completions_path, merged.completions.values())
        write_lines(rejects_path, merged.rejects.values())
        in_s3 = {line for kind in _KINDS for _, _, line in parts[kind]}
        rows = {**merged.completions, **merged.rejects}
        return {key for key, line in rows.items() if line in in_s3}

    def incomplete(self, shard_id: int, remote: ShardRows, n_prompts: int) -> str | None:
        if len(remote.settled) == n_prompts:
            return None
        return (
            f"shard {shard_id}: S3 parts settle {len(remote.settled)} of {n_prompts} conversations after the "
            "final upload; not marking it done"
        )

    def collect(
        self,
        shard_id: int,
        rows: ShardRows,
        completions_path: Path,
        rejects_path: Path,
        expected: set[str] | dict[str, str],
    ) -> None:
        # The kept chains are written, then every expected conversation must be settled in them
        # (datagen/conversation/ledger.read_ledger reads the files written here, as a rerun of the shard would).
        extra = set(rows.conversations) - set(expected)
        if extra:
            raise IncompleteShard(
                f"shard {shard_id}: parts hold steps of {len(extra)} conversations that are not the shard's, e.g. "
                f"{rows.conversations[min(extra)]} (spec or model changed?)"
            )
        write_lines(completions_path, rows.completions.values())
        write_lines(rejects_path, rows.rejects.values())
        ledgers = read_ledger(completions_path, rejects_path, set(expected))
        unsettled = [key for key in expected if key not in ledgers or not ledgers[key].settled]
        if unsettled:

            def name(key: str) -> str:
                steps = len(ledgers[key].lines) if key in ledgers else 0
                pid = expected.get(key, key) if isinstance(expected, dict) else rows.conversations.get(key, key)
                return f"{pid} ({steps} step lines, no outcome or reject)"

            raise IncompleteShard(
                f"shard {shard_id}: {len(unsettled)} of its {len(expected)} conversations are not settled in the "
                f"parts (steps missing after the last one kept): " + "; ".join(name(k) for k in unsettled[:5])
            )


# Each turn mode's merge unit -> its merge, made with the run's thinking setting.
_MERGES: dict[str, Callable[[bool], RowMerge]] = {
    "request": lambda enable_thinking: RequestMerge(),
    "conversation": ConversationMerge,
}


class ShardExchange:
    """One box's (or the parent's) handle on a namespace's run state in S3."""

    def __init__(
        self,
        store: ObjectStore,
        namespace: str,
        box: str,
        owner: str,
        lease_s: float = 120.0,
        clock: Callable[[], float] = time.time,
        *,
        mode: TurnMode,
        enable_thinking: bool = True,
    ) -> None:
        """`mode`, `enable_thinking`: the run's turn mode and thinking setting, which say how rows from several
        writers merge (`RowMerge`: per request key, or per conversation, a step's generated turn as thinking shows
        it in the next step's history). `mode` has no default: one would contradict the run's whenever the two
        differ (`RunSpec.turns` defaults to every turn), and rows would merge by the wrong unit."""
        if not owner.isalnum():
            raise ValueError(f"owner token must be letters and digits (it is part of object names): {owner!r}")
        self.store = store
        self.namespace = namespace
        self.box = box
        self.owner = owner
        self.lease_s = lease_s
        self.clock = clock
        self.merge = _MERGES[mode.merge_unit](enable_thinking)
        self.root = f"{RUNS_PREFIX}/{namespace}"

    # --- names ---------------------------------------------------------------------------------------

    @property
    def plan_key(self) -> str:
        return f"{self.root}/plan.json"

    def prompts_key(self, shard_id: int) -> str:
        return f"{self.root}/shards/{_shard_name(shard_id)}.prompts.jsonl"

    def render_cache_key(self, shard_id: int) -> str:
        return str(rendered_path(Path(self.prompts_key(shard_id))))

    def claims_prefix(self, shard_id: int) -> str:
        return f"{self.root}/claims/{_shard_name(shard_id)}/"

    def parts_prefix(self, shard_id: int, kind: str = "") -> str:
        base = f"{self.root}/checkpoints/{_shard_name(shard_id)}/"
        return f"{base}{kind}/" if kind else base

    def done_key(self, shard_id: int) -> str:
        return f"{self.root}/done/{_shard_name(shard_id)}.json"

    # --- plan and prompts ----------------------------------------------------------------------------

    def _put_same(self, key: str, data: bytes | Path, sha256: str) -> None:
        """Create key, or accept it when it already holds these bytes (re-runs); anything else is a conflict."""
        try:
            self.store.put_if_absent(key, data, sha256=sha256)
        except ObjectExists as exc:
            if exc.existing_sha256 != sha256:
                raise RunStateConflict(
                    f"{self.store.uri(key)} holds other content (sha256 {exc.existing_sha256}, this run's is "
                    f"{sha256}): namespace {self.namespace!r} was planned from different prompts or settings; "
                    "use a new namespace"
                ) from None

    def publish_plan(self, plan: ShardPlan, layout: RunLayout) -> None:
        """Upload the shard prompt files and render caches, then the plan (last: every shard file is there)."""
        for entry in plan.shards:
            prompts = layout.shard_prompts(entry.shard_id)
            self._put_same(self.prompts_key(entry.shard_id), prompts, entry.sha256)
            cache = rendered_path(prompts)
            if cache.is_file():
                # A cache, checked by each reader against the prompts and its render: the first upload stays.
                with contextlib.suppress(ObjectExists):
                    self.store.put_if_absent(self.render_cache_key(entry.shard_id), cache)
        body = plan_manifest_path(layout).read_bytes()
        self._put_same(self.plan_key, body, hashlib.sha256(body).hexdigest())

    def fetch_plan(self) -> ShardPlan:
        """The plan the parent published for this namespace."""
        if self.store.head(self.plan_key) is None:
            raise ShardExchangeError(f"{self.store.uri(self.plan_key)} is missing: the parent flow plans first")
        return ShardPlan.model_validate_json(self.store.get_bytes(self.plan_key))

    def fetch_prompts(self, plan: ShardPlan, shard_id: int, layout: RunLayout) -> Path:
        """The shard's prompts file in the local layout (downloaded unless it already matches the plan).

        The parent's render cache comes with it when the parent uploaded one, so generation sends the ids planning
        rendered instead of rendering every prompt again (`read_rendered` decides whether they are this box's).
        """
        entry = next(s for s in plan.shards if s.shard_id == shard_id)
        path = layout.shard_prompts(shard_id)
        if path.is_file() and hashlib.sha256(path.read_bytes()).hexdigest() == entry.sha256:
            if not rendered_path(path).is_file():
                self._fetch_render_cache(shard_id, path)
            return path
        data = self.store.get_bytes(self.prompts_key(shard_id))
        if hashlib.sha256(data).hexdigest() != entry.sha256:
            raise ShardExchangeError(f"{self.store.uri(self.prompts_key(shard_id))} does not match the plan")
        write_lines(path, (line.text for line in lines_of(data, self.store.uri(self.prompts_key(shard_id)))))
        self._fetch_render_cache(shard_id, path)
        return path

    def _fetch_render_cache(self, shard_id: int, prompts_path: Path) -> None:
        """The parent's render of the shard beside its prompts file; none uploaded (or damaged): no cache here."""
        key = self.render_cache_key(shard_id)
        info = self.store.head(key)
        data = self.store.get_bytes(key) if info is not None else b""
        if info is None or hashlib.sha256(data).hexdigest() != info.sha256:
            if info is not None:
                logger.warning("%s does not match its stored sha256; this box renders the shard itself", key)
            rendered_path(prompts_path).unlink(missing_ok=True)
            return
        install_rendered(prompts_path, data)

    # --- claims --------------------------------------------------------------------------------------

    def claims(self, shard_id: int) -> list[Claim]:
        """Every claim of a shard, oldest first."""
        keys = sorted(o.key for o in self.store.list(self.claims_prefix(shard_id)))
        return [Claim.model_validate_json(self.store.get_bytes(k)) for k in keys]

    def latest_claim(self, shard_id: int) -> Claim | None:
        """The shard's highest-numbered claim."""
        keys = sorted(o.key for o in self.store.list(self.claims_prefix(shard_id)))
        return Claim.model_validate_json(self.store.get_bytes(keys[-1])) if keys else None

    def _write_claim(self, shard_id: int, seq: int) -> Lease | None:
        expires = self.clock() + self.lease_s
        claim = Claim(shard_id=shard_id, seq=seq, box=self.box, owner=self.owner, expires_at=expires)
        try:
            self.store.put_if_absent(f"{self.claims_prefix(shard_id)}{seq:06d}.json", claim.model_dump_json().encode())
        except ObjectExists:
            return None  # another box wrote this number first
        return Lease(shard_id=shard_id, seq=seq, expires_at=expires)

    def try_claim(self, shard_id: int) -> Lease | None:
        """Claim a shard that is not done and unclaimed, lease-expired or already ours; None if someone holds it."""
        if self.store.head(self.done_key(shard_id)) is not None:
            return None
        latest = self.latest_claim(shard_id)
        if latest is not None and latest.owner != self.owner and latest.expires_at > self.clock():
            return None
        if latest is not None and latest.owner != self.owner:
            logger.warning(
                "shard %d: taking over from box %s (lease expired %.0f s ago)",
                shard_id,
                latest.box,
                self.clock() - latest.expires_at,
            )
        return self._write_claim(shard_id, latest.seq + 1 if latest else 1)

    def renew(self, lease: Lease) -> bool:
        """Extend a lease with the next claim number; False (and lease.lost) when another box took the shard."""
        renewed = self._write_claim(lease.shard_id, lease.seq + 1)
        if renewed is None:
            lease.lost = True
            logger.warning("shard %d: lease lost to another box; its parts are deduped when collected", lease.shard_id)
            return False
        lease.seq, lease.expires_at = renewed.seq, renewed.expires_at
        return True

    def done_ids(self) -> set[int]:
        """Shards with a done marker."""
        prefix = f"{self.root}/done/"
        return {int(o.key[len(prefix) :].removeprefix("shard-").removesuffix(".json")) for o in self.store.list(prefix)}

    def claim_next(self, shard_ids: Iterable[int], exclude: set[int]) -> Lease | None:
        """The first shard (in order) this box can claim now, claimed; None when every open shard is held."""
        done = self.done_ids()
        for shard_id in shard_ids:
            if shard_id in done or shard_id in exclude:
                continue
            lease = self.try_claim(shard_id)
            if lease is not None:
                return lease
        return None

    # --- checkpoint parts ----------------------------------------------------------------------------

    def _part_rows(self, shard_id: int) -> dict[str, list[tuple[str, str, str]]]:
        """Each kind's rows of the shard's parts, in part key order: (part URI, box, line)."""
        out: dict[str, list[tuple[str, str, str]]] = {}
        for kind in _KINDS:
            out[kind] = []
            for key in sorted(o.key for o in self.store.list(self.parts_prefix(shard_id, kind))):
                uri = self.store.uri(key)
                for line in lines_of(self.store.get_bytes(key), uri):
                    out[kind].append((f"{uri}:{line.lineno}", _part_box(key), line.text))
        return out

    def read_rows(self, shard_id: int) -> ShardRows:
        """Every row of the shard's parts, merged as the run's turn mode says (`RowMerge.read`)."""
        return self.merge.read(self._part_rows(shard_id))

    def restore_checkpoint(self, shard_id: int, layout: RunLayout) -> set[str]:
        """Merge the shard's S3 parts into its local checkpoint (keeping local-only rows); return the keys in S3.

        Afterwards generate_shard's ledger skips every request any box already finished (`RowMerge.restore`).
        """
        return self.merge.restore(
            self._part_rows(shard_id), layout.shard_completions(shard_id), layout.shard_rejects(shard_id)
        )

    def upload_part(self, shard_id: int, kind: str, lines: list[str], seq: int) -> str:
        """Upload checkpoint rows as a new immutable part; returns its key."""
        key = f"{self.parts_prefix(shard_id, kind)}part-{self.box}-{self.owner}-{seq:06d}.jsonl"
        self.store.put_if_absent(key, ("\n".join(lines) + "\n").encode("utf-8"))
        return key

    def mark_done(
        self, result: ShardResult, engine_version: str | None, memory_plan: dict[str, object] | None = None
    ) -> bool:
        """Write the shard's done marker once S3 holds all its requests; False when another box was first.

        `memory_plan`: this box's plan (flags, running requests, from its own GPU probe), for the run's lineage.
        """
        remote = self.read_rows(result.shard_id)
        why = self.merge.incomplete(result.shard_id, remote, result.n_prompts)
        if why is not None:
            raise IncompleteShard(why)
        body = {
            "shard_id": result.shard_id,
            "box": self.box,
            "owner": self.owner,
            "n_prompts": result.n_prompts,
            "n_completed": len(remote.completions),
            "n_rejected": len(remote.rejects),
            "engine_version": engine_version,
            "memory_plan": memory_plan,
            "finished_at": self.clock(),
        }
        try:
            self.store.put_if_absent(self.done_key(result.shard_id), json.dumps(body, sort_keys=True).encode())
        except ObjectExists:
            logger.info("shard %d: already marked done by another box", result.shard_id)
            return False
        return True

    def done_marker(self, shard_id: int) -> dict[str, object]:
        """The shard's done marker."""
        data: dict[str, object] = json.loads(self.store.get_bytes(self.done_key(shard_id)))
        return data

    # --- collecting (parent) -------------------------------------------------------------------------

    def collect_shard(
        self, shard_id: int, layout: RunLayout, expected_keys: set[str] | dict[str, str]
    ) -> CollectedShard:
        """Write the shard's merged rows into the local checkpoint files; they must hold exactly expected_keys.

        `turns: every`: expected_keys are the shard's conversation keys (a dict: each one's prompt id, for the
        messages), and every conversation must be settled by its kept chain (datagen/conversation/ledger.read_ledger
        reads the files written here, as a rerun of the shard would).
        """
        if self.store.head(self.done_key(shard_id)) is None:
            raise IncompleteShard(f"shard {shard_id} has no done marker at {self.store.uri(self.done_key(shard_id))}")
        rows = self.read_rows(shard_id)
        completions_path, rejects_path = layout.shard_completions(shard_id), layout.shard_rejects(shard_id)
        self.merge.collect(shard_id, rows, completions_path, rejects_path, expected_keys)
        data = completions_path.read_bytes()
        tokens = sum(int(json.loads(line)["completion_tokens"]) for line in rows.completions.values())
        result = ShardResult(
            shard_id=shard_id,
            completions_path=str(completions_path),
            rejects_path=str(rejects_path),
            n_prompts=len(expected_keys),
            n_completed=len(rows.completions),
            n_rejected=len(rows.rejects),
            n_sent=0,
            output_tokens=tokens,
            completions_sha256=hashlib.sha256(data).hexdigest(),
        )
        for conflict in rows.conflicts:
            logger.warning("shard %d: %s", shard_id, conflict)
        return CollectedShard(
            result=result,
            duplicates_dropped=rows.duplicates,
            rows_by_box=dict(rows.rows_by_box),
            conflicts=rows.conflicts,
        )


class CheckpointSync:
    """Background thread for one claimed shard: uploads new checkpoint rows as parts and renews the lease.

    Only complete lines are uploaded, and only rows whose request_key S3 does not hold yet.
    """

    def __init__(
        self,
        exchange: ShardExchange,
        lease: Lease,
        layout: RunLayout,
        known_keys: set[str],
        interval_s: float,
    ) -> None:
        self.exchange = exchange
        self.lease = lease
        self.interval_s = interval_s
        self.known = set(known_keys)
        self.paths = {
            "completions": layout.shard_completions(lease.shard_id),
            "rejects": layout.shard_rejects(lease.shard_id),
        }
        self.tails = {kind: CheckpointTail(path) for kind, path in self.paths.items()}
        self._pending: dict[str, list[CheckpointLine]] = {kind: [] for kind in _KINDS}  # read, not yet uploaded
        self.seq = 0
        self.uploaded_rows = 0
        self.error: BaseException | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"sync-shard-{lease.shard_id}", daemon=True)

    def __enter__(self) -> CheckpointSync:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                self.sync_once()
                if not self.lease.lost and self.exchange.clock() > self.lease.expires_at - self.exchange.lease_s / 2:
                    self.exchange.renew(self.lease)
            except Exception as exc:  # keep going: the next tick retries; the final sync raises
                self.error = exc
                logger.warning("shard %d: checkpoint sync failed, retrying: %s", self.lease.shard_id, exc)

    def sync_once(self) -> int:
        """Upload rows appended since the last call; returns how many rows went up."""
        with self._lock:
            sent = 0
            for kind, path in self.paths.items():
                pending = self._pending[kind]
                pending += self.tails[kind].read()  # a line still being written waits for the next call
                lines = []
                for line in pending:
                    if (request := _request_key(line.text, f"{path}:{line.lineno}")) not in self.known:
                        lines.append(line.text)
                        self.known.add(request)
                if lines:
                    self.seq += 1
                    try:
                        self.exchange.upload_part(self.lease.shard_id, kind, lines, self.seq)
                    except BaseException:
                        self.known.difference_update(_request_key(line, str(path)) for line in lines)
                        raise
                    sent += len(lines)
                pending.clear()
            self.uploaded_rows += sent
            return sent
