"""Pure quality checks: one verdict per completion, summaries of what passed, and the dataset-level gate.

Nothing here reads or writes files (tasks/validation.py does). Per-sample checks look at the token ids
for structure (`</think>` 248069, stop ids 248046/248044) and at the server's text for content
(whitespace-only thinking or answers, U+FFFD). Summaries hold only counters, so a 1M-sample run
needs a few hundred kilobytes for them; duplicate detection holds one 8-byte hash per sample.

The gate answers the question the placeholder incident never asked: does the dataset, as a whole,
look like real model outputs on a diverse mix? It fails a run before publish with a report that
shows the distributions that tripped it.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections import Counter
from dataclasses import dataclass
from typing import Literal

import numpy as np
from pydantic import BaseModel, Field

from datagen.chat import ENDOFTEXT_ID, IM_END_ID, THINK_END_ID, THINK_START_ID
from datagen.checks.repetition import prose_loops, word_share
from datagen.records import Completion, Reject
from datagen.runspec import QualityGate, ValidationSpec

__all__ = [
    "NO_CATEGORY",
    "STOP_IDS",
    "VALIDATION_REASONS",
    "DuplicateIndex",
    "GateCheck",
    "GateReport",
    "Loop",
    "QualityGateError",
    "SummaryBuilder",
    "TokenDistribution",
    "ValidationSummary",
    "Verdict",
    "check_completion",
    "check_load_gate",
    "check_quality_gate",
    "completion_body",
    "find_loops",
    "reject_origin",
    "render_validation_report",
    "repeated_ngram_share",
]

STOP_IDS = frozenset({IM_END_ID, ENDOFTEXT_ID})
NO_CATEGORY = "(none)"
EXAMPLES_PER_REASON = 3
NGRAM = 8  # ValidationSpec.max_repeated_ngram_share is defined over 8-grams
# "\n" and "\n\n": the output format puts these between </think> and the answer; they are not answer tokens.
_NEWLINE_IDS = frozenset({198, 271})

# Every reason a validation reject can carry (stage "validate").
VALIDATION_REASONS: tuple[str, ...] = (
    "malformed_record",  # checkpoint line that is not a Completion
    "empty_completion",  # no output ids at all
    "token_count_mismatch",  # completion_tokens != len(output_ids): a corrupted record
    "aborted",  # finish_reason "abort"
    "unknown_finish_reason",
    "truncated",  # finish_reason "length" (when ValidationSpec.reject_truncated)
    "invalid_utf8",  # U+FFFD in the text: ids that do not decode to valid UTF-8
    "placeholder",  # tiny reasoning and a tiny answer (thinking off: a tiny answer): the "OK." incident
    "repeated_tail",  # the completion ends in 3+ back-to-back copies of a block: a loop (often cut at the limit)
    "repeated_block",  # back-to-back copies of one block (any size) span over max_loop_share of the completion
    "unclosed_thinking",  # thinking on, finished, real output, but no </think>
    "malformed_thinking",  # <think> in the output, several </think>, or </think> with thinking off
    "text_mismatch",  # ids hold </think> but the text does not
    "empty_thinking",  # whitespace-only reasoning before a real answer
    "empty_answer",  # whitespace-only answer after real reasoning
    "repetition",  # prose 8-grams recurring 5+ times over max_loop_coverage, or most 8-grams repeat: a loop in pieces
    "duplicate_request",  # the same request key twice (a checkpoint written twice)
    "duplicate_completion",  # the same output ids for a different prompt
    # Every-turn conversations (datagen/conversation/segments.py): a conversation is cut at its first failing step.
    "earlier_turn_rejected",  # a user turn after the one that cut its conversation
    "missing_step",  # the conversation's steps do not follow 0, 1, 2, ... (a step line is missing)
)


@dataclass(frozen=True, slots=True)
class Verdict:
    """The outcome of the per-sample checks for one completion."""

    reason: str | None  # None: accepted
    detail: str = ""
    answer_tokens: int = 0

    @property
    def accepted(self) -> bool:
        return self.reason is None


def completion_body(c: Completion) -> list[int]:
    """The output ids without the trailing stop token (the ids that the server's text decodes)."""
    ids = c.output_ids
    if ids and c.finish_reason == "stop" and ids[-1] in STOP_IDS:
        return ids[:-1]
    return ids


def repeated_ngram_share(ids: list[int], n: int = NGRAM) -> float:
    """Share of the n-gram windows of `ids` that repeat an earlier window (0 for fewer than n ids)."""
    windows = len(ids) - n + 1
    if windows <= 0:
        return 0.0
    unique = len(set(zip(*(ids[i:] for i in range(n)), strict=False)))
    return (windows - unique) / windows


def _answer_token_count(answer_ids: list[int]) -> int:
    i = 0
    while i < len(answer_ids) and answer_ids[i] in _NEWLINE_IDS:
        i += 1
    return len(answer_ids) - i


def _content_tokens(ids: list[int]) -> int:
    """Tokens that are not the newlines the output format puts around </think>."""
    return sum(1 for i in ids if i not in _NEWLINE_IDS)


@dataclass(frozen=True, slots=True)
class Loop:
    """Back-to-back copies of one block: where they start, the block size and the tokens they span."""

    start: int
    period: int
    span: int
    at_end: bool

    @property
    def copies(self) -> float:
        return self.span / self.period


def find_loops(ids: list[int], n: int = NGRAM, candidates: int = 16) -> tuple[Loop | None, Loop | None]:
    """The longest run of back-to-back copies of a block (of any size) in `ids`, and the one ending `ids`.

    Candidate block sizes are the distances between repeated n-grams, plus every size below n (such blocks
    repeat their n-grams at their own period too); each is then checked exactly, token by token: r >= p
    positions in a row with ids[i] == ids[i + p] are copies of a p-token block spanning r + p tokens.
    """
    size = len(ids)
    if size < 2:
        return None, None
    a = np.asarray(ids, dtype=np.int64)
    periods: list[int] = []
    if size > n:
        windows = np.lib.stride_tricks.sliding_window_view(a, n).astype(np.uint64)
        weights = np.array([pow(1_000_003, k, 1 << 64) for k in range(n)], dtype=np.uint64)
        hashes = (windows * weights).sum(axis=1, dtype=np.uint64)
        order = np.lexsort((np.arange(len(hashes)), hashes))
        same = hashes[order[1:]] == hashes[order[:-1]]
        gaps = (order[1:] - order[:-1])[same]
        if len(gaps):
            values, counts = np.unique(gaps, return_counts=True)
            periods = [int(v) for v in values[np.argsort(-counts, kind="stable")][:candidates]]
    periods += [p for p in range(1, n) if p not in periods]
    longest: Loop | None = None
    tail: Loop | None = None
    for p in periods:
        if 2 * p > size:
            continue
        eq = np.concatenate(([False], a[p:] == a[:-p], [False]))
        edges = np.flatnonzero(eq[1:] != eq[:-1])
        starts, ends = edges[::2], edges[1::2]  # runs of ids[i] == ids[i + p] over i in [start, end)
        runs = ends - starts
        if not len(runs) or int(runs.max()) < p:
            continue
        k = int(np.argmax(runs))
        if longest is None or int(runs[k]) + p > longest.span:
            longest = Loop(int(starts[k]), p, int(runs[k]) + p, int(ends[k]) == size - p)
        if int(ends[-1]) == size - p and int(runs[-1]) >= p and (tail is None or int(runs[-1]) + p > tail.span):
            tail = Loop(int(starts[-1]), p, int(runs[-1]) + p, True)
    return longest, tail


def _loop_verdict(c: Completion, body: list[int], spec: ValidationSpec, words: np.ndarray | None) -> Verdict | None:
    longest, tail = find_loops(body)

    def where(loop: Loop) -> str:
        copies = f"{loop.copies:.1f} back-to-back copies of a {loop.period}-token block"
        return f"{copies} span {loop.span} of {len(body)} tokens"

    def structure(loop: Loop) -> bool:
        """A finished completion's matrix, table, code or separator rows: the answer, not a loop."""
        if words is None or c.finish_reason != "stop" or loop.copies > spec.max_structural_copies:
            return False
        return word_share(body[loop.start : loop.start + loop.period], words) < spec.structural_word_share

    if tail is not None and tail.copies >= 3 and tail.span >= spec.min_loop_tokens and not structure(tail):
        cut = " until the token limit" if c.finish_reason == "length" else ""
        return Verdict(
            "repeated_tail", f"the completion ends in a loop{cut}: {where(tail)}; ends with {c.text[-80:]!r}"
        )
    if (
        longest is not None
        and longest.copies >= 3
        and longest.span >= spec.min_loop_tokens
        and longest.span > spec.max_loop_share * len(body)
        and not structure(longest)
    ):
        share = longest.span / len(body)
        return Verdict(
            "repeated_block",
            f"{where(longest)} ({share:.0%} > {spec.max_loop_share:.0%}), from token {longest.start}",
        )
    if words is not None:
        loops = prose_loops(body, words, spec.min_loop_copies, NGRAM)
        if loops.covered >= spec.min_loop_tokens and loops.covered > spec.max_loop_coverage * len(body):
            return Verdict(
                "repetition",
                f"{loops.covered} of {len(body)} tokens ({loops.covered / len(body):.0%} > "
                f"{spec.max_loop_coverage:.0%}) lie in prose {NGRAM}-grams that occur {spec.min_loop_copies} or more "
                f"times (the most repeated {loops.copies} times, first at token {loops.first}); ends with "
                f"{c.text[-80:]!r}",
            )
    return None


def check_completion(
    c: Completion, spec: ValidationSpec, enable_thinking: bool, words: np.ndarray | None = None
) -> Verdict:
    """Run every stateless per-sample check; the first failing one names the reject reason.

    `words` (datagen.checks.repetition.word_tokens) tells repeated structure from loops; without it every repeated
    block counts as a loop and interleaved prose loops are looked for only by the 8-gram share.

    Thinking outputs are judged on reasoning and answer together: tiny reasoning with a tiny answer is a
    placeholder, a short answer after real reasoning is kept; loops are looked for before truncation, so a
    completion that looped until the token limit is named for its loop.
    """
    ids = c.output_ids
    if not ids:
        return Verdict("empty_completion", "the server returned no output ids")
    if c.completion_tokens != len(ids):
        return Verdict(
            "token_count_mismatch", f"completion_tokens={c.completion_tokens} but {len(ids)} output ids were stored"
        )
    if c.finish_reason == "abort":
        return Verdict("aborted", f"generation aborted: {c.meta.get('finish_message', 'no message')}")
    if c.finish_reason not in ("stop", "length"):
        return Verdict("unknown_finish_reason", f"finish_reason={c.finish_reason!r}")
    truncated = c.finish_reason == "length"
    body = completion_body(c)
    loop = _loop_verdict(c, body, spec, words)
    if loop is not None:
        return loop
    if truncated and spec.reject_truncated:
        where = "inside the reasoning" if enable_thinking and THINK_END_ID not in body else "in the answer"
        return Verdict("truncated", f"cut at the token limit after {len(ids)} tokens, {where}")
    if "\ufffd" in c.text:
        pos = c.text.index("\ufffd")
        return Verdict("invalid_utf8", f"U+FFFD at character {pos}: {c.text[max(0, pos - 30) : pos + 10]!r}")

    n_end = body.count(THINK_END_ID)
    answer_ids = body
    answer_text = c.text
    tiny = spec.min_answer_tokens
    if enable_thinking:
        if THINK_START_ID in body or n_end > 1:
            return Verdict("malformed_thinking", f"{body.count(THINK_START_ID)} <think> and {n_end} </think> tokens")
        if n_end == 0:
            if truncated:
                # Kept truncated samples (reject_truncated off) may stop inside the thinking: no answer to judge.
                return _after_structure(c, body, spec, 0, words)
            if _content_tokens(body) < spec.min_reasoning_tokens + tiny:
                return Verdict("placeholder", f"{len(body)} tokens and no </think>: {c.text.strip()[:80]!r}")
            return Verdict("unclosed_thinking", f"no </think> ({THINK_END_ID}) in {len(body)} tokens")
        k = body.index(THINK_END_ID)
        reasoning_text, sep, answer_text = c.text.partition("</think>")
        if not sep:
            return Verdict("text_mismatch", "the output ids hold </think> but the text does not")
        answer_ids = body[k + 1 :]
        reasoning_tokens = _content_tokens(body[:k]) if reasoning_text.strip() else 0
        answer_tokens = _answer_token_count(answer_ids) if answer_text.strip() else 0
        if not truncated and reasoning_tokens < spec.min_reasoning_tokens and answer_tokens < tiny:
            return Verdict(
                "placeholder",
                f"{reasoning_tokens} reasoning and {answer_tokens} answer tokens: {answer_text.strip()[:80]!r}",
                answer_tokens,
            )
        if not reasoning_text.strip():
            return Verdict("empty_thinking", f"{k} reasoning tokens, all whitespace")
    elif THINK_START_ID in body or n_end:
        return Verdict("malformed_thinking", f"thinking is off but the output holds {n_end} </think> tokens")

    answer_tokens = _answer_token_count(answer_ids)
    if not truncated:
        if not answer_text.strip():
            return Verdict("empty_answer", f"answer is whitespace only ({answer_tokens} tokens)")
        if not enable_thinking and answer_tokens < tiny:
            return Verdict(
                "placeholder",
                f"answer has {answer_tokens} tokens (< {tiny}) and no reasoning: {answer_text.strip()[:80]!r}",
                answer_tokens,
            )
    return _after_structure(c, body, spec, answer_tokens, words)


def _after_structure(
    c: Completion, body: list[int], spec: ValidationSpec, answer_tokens: int, words: np.ndarray | None
) -> Verdict:
    # With the vocabulary's word tokens the prose-loop rule (_loop_verdict) replaces this one: a share of all
    # repeated 8-grams cannot tell a 12x12 zero matrix (91% repeats) from a loop.
    share = repeated_ngram_share(body) if words is None else 0.0
    if share > spec.max_repeated_ngram_share:
        return Verdict(
            "repetition",
            f"{share:.0%} of {NGRAM}-grams repeat (> {spec.max_repeated_ngram_share:.0%}); ends with {c.text[-80:]!r}",
            answer_tokens,
        )
    return Verdict(None, "", answer_tokens)


def _hash64(data: bytes) -> int:
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little")


class DuplicateIndex:
    """Remembers accepted samples by 8-byte hashes: the first one is kept, later copies are rejected.

    Every-turn steps are also remembered by their request (the history they were conditioned on): two
    conversations that open the same way send the same request, and a deterministic server (temperature 0) answers
    it the same way. That answer is each conversation's own turn, not a copy: it is kept in both, so neither loses
    its later, distinct turns. `steps` says which samples these are (the run's turn mode, never the record's shape).
    """

    def __init__(self, steps: bool = False) -> None:
        self.steps = steps  # every-turn steps: remembered by their request too
        self._requests: set[int] = set()
        self._outputs: dict[int, str] = {}
        self._step_requests: dict[int, int] = {}  # output key -> the step request that first produced it

    def check_and_add(self, c: Completion, reject_duplicate_completions: bool) -> Verdict:
        """Reject a repeated request key, or output ids already accepted for another prompt; else remember them."""
        rkey = _hash64(c.request_key.encode("utf-8"))
        if rkey in self._requests:
            return Verdict("duplicate_request", f"request key {c.request_key} was already accepted")
        okey = _hash64(array("i", c.output_ids).tobytes())
        request = _step_request(c) if self.steps else None
        if reject_duplicate_completions:
            first = self._outputs.get(okey)
            same_request = request is not None and self._step_requests.get(okey) == request
            if first is not None and first != c.prompt_id and not same_request:
                return Verdict("duplicate_completion", f"same output ids as prompt {first} (kept)")
        self._requests.add(rkey)
        self._outputs.setdefault(okey, c.prompt_id)
        if request is not None:
            self._step_requests.setdefault(okey, request)
        return Verdict(None)


def _step_request(c: Completion) -> int:
    """An every-turn step's request, hashed: the history it was sent with (and its bridge)."""
    history = [m.to_dict() for m in c.messages]
    body = json.dumps([history, c.bridge_ids, c.tools], sort_keys=True, ensure_ascii=False)
    return _hash64(body.encode("utf-8", "surrogatepass"))


class TokenDistribution(BaseModel):
    """Exact distribution of a per-sample token count, kept as value -> number of samples."""

    counts: dict[int, int] = Field(default_factory=dict, description="Token count -> number of samples.")

    def add(self, value: int) -> None:
        """Count one sample."""
        self.counts[value] = self.counts.get(value, 0) + 1

    @property
    def n(self) -> int:
        return sum(self.counts.values())

    @property
    def total(self) -> int:
        return sum(v * c for v, c in self.counts.items())

    @property
    def mean(self) -> float:
        return self.total / self.n if self.n else 0.0

    def percentile(self, q: float) -> int:
        """Nearest-rank percentile (q in 0..100); 0 for an empty distribution."""
        n = self.n
        if n == 0:
            return 0
        rank = max(1, -(-int(q * n) // 100))  # ceil(q/100 * n), at least 1
        seen = 0
        for value in sorted(self.counts):
            seen += self.counts[value]
            if seen >= rank:
                return value
        return max(self.counts)

    def percentiles(self) -> dict[str, int]:
        """min, p1 .. p99, max."""
        if not self.counts:
            return {}
        out = {"min": min(self.counts)}
        out.update({f"p{q}": self.percentile(q) for q in (1, 5, 10, 25, 50, 75, 90, 95, 99)})
        out["max"] = max(self.counts)
        return out

    def share_at_most(self, limit: int) -> float:
        """Share of samples with a value <= limit."""
        n = self.n
        return sum(c for v, c in self.counts.items() if v <= limit) / n if n else 0.0

    def most_common(self, k: int = 3) -> list[tuple[int, int]]:
        """The k most frequent values with their counts (a spike at one value is the placeholder signature)."""
        return Counter(self.counts).most_common(k)

    def histogram(self) -> list[tuple[int, int, int]]:
        """(low, high, count) over power-of-two bins [0,1), [1,2), [2,4), [4,8) ... up to the largest value."""
        if not self.counts:
            return []
        bins: list[tuple[int, int, int]] = []
        lo, hi = 0, 1
        top = max(self.counts)
        while lo <= top:
            bins.append((lo, hi, sum(c for v, c in self.counts.items() if lo <= v < hi)))
            lo, hi = hi, hi * 2
        return bins


class ValidationSummary(BaseModel):
    """What validation saw: counts per verdict, mix and length distributions of accepted samples, file paths."""

    total: int = Field(0, description="Completions read (accepted + rejected).")
    accepted: int = Field(0, description="Completions that passed every check.")
    rejected: int = Field(0, description="Completions rejected by validation.")
    reject_reasons: dict[str, int] = Field(default_factory=dict, description="Reason -> number of rejects.")
    reject_examples: dict[str, str] = Field(default_factory=dict, description="Reason -> detail of its first reject.")
    reject_samples: dict[str, list[str]] = Field(
        default_factory=dict,
        description=f"Reason -> up to {EXAMPLES_PER_REASON} example rejects: where the row came from, then the detail.",
    )
    accepted_by_source: dict[str, int] = Field(default_factory=dict, description="Source -> accepted samples.")
    rejected_by_source: dict[str, int] = Field(default_factory=dict, description="Source -> rejected samples.")
    accepted_by_category: dict[str, int] = Field(default_factory=dict, description="Category -> accepted samples.")
    finish_reasons: dict[str, int] = Field(default_factory=dict, description="Finish reason -> accepted samples.")
    loss_tokens: TokenDistribution = Field(
        default_factory=TokenDistribution,
        description="Accepted samples' loss tokens: the whole completion (thinking, answer and EOS).",
    )
    answer_tokens: TokenDistribution = Field(
        default_factory=TokenDistribution, description="Accepted samples' answer tokens (after </think>)."
    )
    conversation_outcomes: dict[str, int] = Field(
        default_factory=dict,
        description="Every turn: outcome -> conversations, as validation leaves them (its cuts included; a "
        "conversation a generation reject ended counts under that reject's reason).",
    )
    accepted_paths: list[str] = Field(default_factory=list, description="Accepted completions, JSONL, per shard.")
    reject_paths: list[str] = Field(default_factory=list, description="Validation rejects, JSONL, per shard.")


class SummaryBuilder:
    """Accumulates a ValidationSummary one sample at a time (counters only)."""

    def __init__(self) -> None:
        self.summary = ValidationSummary()

    def accept(self, c: Completion, verdict: Verdict) -> None:
        """Count an accepted completion."""
        s = self.summary
        s.total += 1
        s.accepted += 1
        _inc(s.accepted_by_source, c.source)
        _inc(s.accepted_by_category, c.category or NO_CATEGORY)
        _inc(s.finish_reasons, c.finish_reason)
        s.loss_tokens.add(len(c.output_ids))
        s.answer_tokens.add(verdict.answer_tokens)

    def reject(self, r: Reject) -> None:
        """Count a rejected completion."""
        s = self.summary
        s.total += 1
        s.rejected += 1
        _inc(s.reject_reasons, r.reason)
        _inc(s.rejected_by_source, r.source)
        s.reject_examples.setdefault(r.reason, r.detail)
        samples = s.reject_samples.setdefault(r.reason, [])
        if len(samples) < EXAMPLES_PER_REASON:
            samples.append(f"{reject_origin(r)}: {r.detail}")


def reject_origin(r: Reject) -> str:
    """Where a rejected row came from, for people: its file and line (else source row) and prompt id."""
    pid = f" (prompt {r.prompt_id})" if r.prompt_id else ""
    if r.location:
        return f"{r.location}{pid}"
    return f"{r.source} row {r.row}{pid}" if r.row is not None else f"{r.source}{pid}"


def _inc(d: dict[str, int], key: str) -> None:
    d[key] = d.get(key, 0) + 1


class GateCheck(BaseModel):
    """One dataset-level check: the measured value against its limit."""

    name: str
    passed: bool
    value: float
    limit: float
    comparison: Literal["<=", ">="]
    message: str


class GateReport(BaseModel):
    """The quality gate's verdict over the whole dataset, with the evidence."""

    passed: bool
    checks: list[GateCheck]
    evidence: list[str] = Field(default_factory=list, description="Distributions behind the failed checks.")
    # Paths on the box that ran the gate: for the CLI's text, never in the run's state message or artifacts.
    reject_files: list[str] = Field(default_factory=list, description="Reject rows (file, line, detail of each).")

    @property
    def failures(self) -> list[GateCheck]:
        return [c for c in self.checks if not c.passed]

    @property
    def text(self) -> str:
        """Plain-text report: verdict, each check, then the evidence for failures."""
        head = "quality gate PASSED" if self.passed else f"quality gate FAILED ({len(self.failures)} check(s))"
        lines = [head]
        for c in self.checks:
            mark = "ok  " if c.passed else "FAIL"
            lines.append(f"  [{mark}] {c.name}: {c.message}")
        lines.extend(self.evidence)
        if self.reject_files and not self.passed:
            lines.append("  reject rows (file, line and detail of each): " + ", ".join(self.reject_files))
        return "\n".join(lines)

    @property
    def summary(self) -> str:
        """A few short lines for a failed run's state message: the failed checks and the reasons, no paths."""
        head = "quality gate PASSED" if self.passed else f"quality gate FAILED ({len(self.failures)} check(s))"
        lines = [head, *(f"- {c.name}: {c.message}" for c in self.failures)]
        lines += [_clip(e.strip(), 240) for e in self.evidence[:3]]
        if not self.passed:
            lines.append("full report: the run's validation-report artifact")
        return "\n".join(lines)

    @property
    def headline(self) -> str:
        """One line for the run's state message: how many checks failed, each with its measured value."""
        failed = "; ".join(f"{c.name}: {c.message}" for c in self.failures)
        return f"{len(self.failures)} of {len(self.checks)} checks failed: {failed}" if failed else "passed"

    def raise_if_failed(self) -> None:
        """Raise QualityGateError (carrying this report) when any check failed."""
        if not self.passed:
            raise QualityGateError(self)


class QualityGateError(RuntimeError):
    """The dataset failed the quality gate; nothing may be published. `report` holds the evidence."""

    def __init__(self, report: GateReport | str) -> None:
        # A few lines (the task's state message and the run-failure artifact); `headline` is the run's one line.
        super().__init__(report if isinstance(report, str) else report.summary)
        self.report = report if isinstance(report, GateReport) else None
        self.headline = report.headline if isinstance(report, GateReport) else None


def _clip(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def _mix_evidence(title: str, counts: dict[str, int], total: int) -> str:
    rows = sorted(counts.items(), key=lambda kv: -kv[1])[:8]
    return f"  {title}: " + ", ".join(f"{k}={v} ({v / total:.1%})" for k, v in rows)


def _length_evidence(dist: TokenDistribution) -> str:
    pct = dist.percentiles()
    spikes = ", ".join(f"{v} tokens: {c} ({c / dist.n:.1%})" for v, c in dist.most_common(3))
    return (
        "  loss tokens per sample: "
        + ", ".join(f"{k}={v}" for k, v in pct.items())
        + f"\n  most common loss-token counts: {spikes}"
    )


def _reasons_line(title: str, reasons: dict[str, int], total: int) -> str:
    rows = sorted(reasons.items(), key=lambda kv: (-kv[1], kv[0]))
    return f"  {title}: " + ", ".join(f"{k}={v} ({v / total:.1%})" for k, v in rows)


def check_load_gate(
    n_rows: int,
    n_prompts: int,
    load_rejects_by_reason: dict[str, int],
    gate: QualityGate,
    rejects_path: str,
    n_skipped_published: int = 0,
    n_old_rejects: int = 0,
) -> GateReport:
    """Check the rows rejected at load against the gate before any server starts (GPU time is the cost).

    `n_rows` are this run's rows (new prompts and new load rejects). Rows other namespaces published count in
    the denominator (`n_skipped_published`: they are the source's good rows); rows they published as load
    rejects (`n_old_rejects`) count nowhere: each broken row is judged once, by the run that first read it.
    Load rejects alone are a lower bound of the final reject rate, so a run that fails here would fail the
    final gate too. A plan with rows but no usable prompt, from sources nothing was ever published from,
    always fails: its input is wrong, not merely thin.
    """
    n_rejects = sum(load_rejects_by_reason.values())
    checks: list[GateCheck] = []
    if n_rows and not n_prompts and not n_skipped_published:
        checks.append(
            GateCheck(
                name="usable_prompts",
                passed=False,
                value=0,
                limit=1,
                comparison=">=",
                message=f"all {n_rows} rows read were rejected at load: nothing could be generated",
            )
        )
    judged = n_rows + n_skipped_published
    rate = n_rejects / judged if judged else 0.0
    counted = f"{n_rejects}/{judged} rows rejected at load"
    if n_skipped_published or n_old_rejects:
        counted += (
            f" ({n_rows} new rows and {n_skipped_published} published before; "
            f"{n_old_rejects} rejects published before not counted)"
        )
    checks.append(
        GateCheck(
            name="load_reject_rate",
            passed=rate <= gate.max_reject_rate,
            value=rate,
            limit=gate.max_reject_rate,
            comparison="<=",
            message=f"{counted} = {rate:.1%} (limit {gate.max_reject_rate:.1%})",
        )
    )
    passed = all(c.passed for c in checks)
    evidence: list[str] = []
    if not passed:
        evidence.append(_reasons_line("load rejects by reason", load_rejects_by_reason, judged))
    return GateReport(passed=passed, checks=checks, evidence=evidence, reject_files=[rejects_path])


def check_quality_gate(
    summary: ValidationSummary,
    gate: QualityGate,
    upstream_rejects: int = 0,
    downstream_rejects: int = 0,
    upstream_reasons: dict[str, int] | None = None,
    reject_paths: list[str] | None = None,
    downstream_reasons: dict[str, int] | None = None,
    published_before: int = 0,
) -> GateReport:
    """Check the dataset against the gate.

    Reject rate counts every prompt that went in: load/generate rejects (`upstream_rejects`), validation
    rejects, and tokenization rejects (`downstream_rejects`, when the gate is re-run before publish).
    Length and mix checks look at the accepted samples. Samples without a category label count in the
    denominator of category shares but are not a category themselves. `upstream_reasons` ('stage/reason'
    -> count, summing to `upstream_rejects`), `downstream_reasons` (the same for `downstream_rejects`) and
    `reject_paths` name the rejects in the report. `published_before`: rows of the sources other namespaces
    published (an expansion skipped them); they count in the reject rate's denominator, as in the load gate.
    """
    accepted = summary.accepted - downstream_rejects
    attempted = summary.total + upstream_rejects
    rejected = summary.rejected + upstream_rejects + downstream_rejects
    checks: list[GateCheck] = []
    evidence: list[str] = []

    if accepted <= 0:
        checks.append(
            GateCheck(
                name="accepted_samples",
                passed=False,
                value=accepted,
                limit=1,
                comparison=">=",
                message=f"no accepted samples out of {attempted}",
            )
        )
    judged = attempted + published_before
    reject_rate = rejected / judged if judged else 0.0
    ok = reject_rate <= gate.max_reject_rate
    counted = f"{rejected}/{judged} rejected"
    if published_before:
        counted += f" ({attempted} rows of this run and {published_before} published before)"
    checks.append(
        GateCheck(
            name="reject_rate",
            passed=ok,
            value=reject_rate,
            limit=gate.max_reject_rate,
            comparison="<=",
            message=f"{counted} = {reject_rate:.1%} (limit {gate.max_reject_rate:.1%})",
        )
    )
    if not ok:
        reasons = {f"validate/{k}": v for k, v in summary.reject_reasons.items()}
        named = upstream_reasons or {}
        reasons.update(named)
        if upstream_rejects > sum(named.values()):
            reasons["load+generate (reasons not given)"] = upstream_rejects - sum(named.values())
        named_after = downstream_reasons or {}
        reasons.update(named_after)
        if downstream_rejects > sum(named_after.values()):
            reasons["tokenize (reasons not given)"] = downstream_rejects - sum(named_after.values())
        evidence.append(_reasons_line("rejects by reason", reasons, attempted))

    dist = summary.loss_tokens
    short = dist.share_at_most(gate.short_loss_tokens)
    ok = short <= gate.max_short_share
    checks.append(
        GateCheck(
            name="short_share",
            passed=ok,
            value=short,
            limit=gate.max_short_share,
            comparison="<=",
            message=f"{short:.1%} of samples have <= {gate.short_loss_tokens} loss tokens "
            f"(limit {gate.max_short_share:.1%})",
        )
    )
    median = dist.percentile(50)
    ok_median = median >= gate.min_median_completion_tokens
    checks.append(
        GateCheck(
            name="median_completion_tokens",
            passed=ok_median,
            value=median,
            limit=gate.min_median_completion_tokens,
            comparison=">=",
            message=f"median completion is {median} tokens (minimum {gate.min_median_completion_tokens})",
        )
    )
    if dist.n and not (ok and ok_median):
        evidence.append(_length_evidence(dist))

    n = summary.accepted
    for name, counts, limit, skip in (
        ("source_share", summary.accepted_by_source, gate.max_source_share, None),
        ("category_share", summary.accepted_by_category, gate.max_category_share, NO_CATEGORY),
    ):
        labelled = {k: v for k, v in counts.items() if k != skip}
        if not n or not labelled:
            continue
        top, top_n = max(labelled.items(), key=lambda kv: kv[1])
        share = top_n / n
        ok = share <= limit
        checks.append(
            GateCheck(
                name=name,
                passed=ok,
                value=share,
                limit=limit,
                comparison="<=",
                message=f"largest is {top!r} with {top_n}/{n} = {share:.1%} (limit {limit:.1%})",
            )
        )
        if not ok:
            evidence.append(_mix_evidence(name.split("_")[0] + " mix", counts, n))

    return GateReport(
        passed=all(c.passed for c in checks), checks=checks, evidence=evidence, reject_files=list(reject_paths or [])
    )


def _bar(count: int, biggest: int, width: int = 40) -> str:
    return "#" * (round(width * count / biggest) if biggest else 0)


def _mix_table(title: str, counts: dict[str, int]) -> list[str]:
    total = sum(counts.values()) or 1
    lines = [f"| {title} | samples | share |", "|---|---:|---:|"]
    for k, v in sorted(counts.items(), key=lambda kv: -kv[1]):
        lines.append(f"| {k} | {v} | {v / total:.1%} |")
    return lines


def render_validation_report(summary: ValidationSummary, gate_report: GateReport | None = None) -> str:
    """Markdown for a Prefect artifact: gate verdict, rejects by reason, length distributions, source/category mix."""
    out: list[str] = ["# Validation report", ""]
    if gate_report is not None:
        out += [f"**{'PASSED' if gate_report.passed else 'FAILED'}**: quality gate", ""]
        out += ["| check | result | value | limit |", "|---|---|---:|---:|"]
        for c in gate_report.checks:
            out.append(
                f"| {c.name} | {'ok' if c.passed else '**FAIL**'} | {c.value:.4g} | {c.comparison} {c.limit:.4g} |"
            )
        if gate_report.evidence:
            out += ["", "```", *(e.strip("\n") for e in gate_report.evidence), "```"]
        out.append("")
    rate = summary.rejected / summary.total if summary.total else 0.0
    out += [
        f"{summary.total} completions: {summary.accepted} accepted, {summary.rejected} rejected ({rate:.1%}).",
        "",
        "## Rejects by reason",
        "",
        "| reason | count | share of completions | examples |",
        "|---|---:|---:|---|",
    ]
    for reason, count in sorted(summary.reject_reasons.items(), key=lambda kv: (-kv[1], kv[0])):
        examples = summary.reject_samples.get(reason) or [summary.reject_examples.get(reason, "")]
        cell = "<br>".join(e.replace("|", "\\|").replace("\n", " ")[:160] for e in examples)
        out.append(f"| {reason} | {count} | {count / summary.total:.1%} | {cell} |")
    for title, dist in (("Loss tokens per sample", summary.loss_tokens), ("Answer tokens", summary.answer_tokens)):
        out += ["", f"## {title}", ""]
        pct = dist.percentiles()
        if not pct:
            out.append("(no accepted samples)")
            continue
        out += ["| " + " | ".join(pct) + " | mean |", "|" + "---:|" * (len(pct) + 1)]
        out.append("| " + " | ".join(str(v) for v in pct.values()) + f" | {dist.mean:.1f} |")
        hist = dist.histogram()
        biggest = max(c for _, _, c in hist)
        out += ["", "```"]
        for lo, hi, count in hist:
            out.append(f"{lo:>7}-{hi - 1:<7} {count:>9} {_bar(count, biggest)}")
        out.append("```")
    out += ["", "## Mix (accepted samples)", "", *_mix_table("source", summary.accepted_by_source), ""]
    out += _mix_table("category", summary.accepted_by_category)
    return "\n".join(out) + "\n"
