"""The run spec: what one run should do. It is the flow parameter, so the Prefect UI renders it as a form.

Every default lives here (Prefect merges run parameters shallowly: a run that sets one nested
field gets the model's defaults for the rest, never a deployment's).
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator

from datagen.checks.tuning import check_server_args
from datagen.operations.form_schema import json_box, optional_fields_as_plain_inputs

__all__ = ["AUTO_NAMESPACE", "PromptSource", "QualityGate", "RunSpec", "SamplingSpec", "Target", "ValidationSpec"]

AUTO_NAMESPACE = "auto"  # RunSpec.namespace value: the flow picks the next free `expansion_vN`
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
# Reasons of the rejects the prompt catalog lists (stages generate, validate, tokenize; load rejects have no
# prompt id and are always read again). Kept in step with tasks.generation, datagen.checks.quality.VALIDATION_REASONS
# and tasks.tokenization.TOKENIZE_REASONS (tests/e2e/test_expansion.py checks).
RETRYABLE_REASONS = frozenset(
    {
        # generate
        "template_error",
        "prompt_too_long",
        "server_rejected",
        "protocol_error",
        # validate
        "malformed_record",
        "empty_completion",
        "token_count_mismatch",
        "aborted",
        "unknown_finish_reason",
        "truncated",
        "invalid_utf8",
        "placeholder",
        "repeated_tail",
        "repeated_block",
        "unclosed_thinking",
        "malformed_thinking",
        "text_mismatch",
        "empty_thinking",
        "empty_answer",
        "repetition",
        "duplicate_request",
        "duplicate_completion",
        "earlier_turn_rejected",
        "missing_step",
        # tokenize
        "bridge_mismatch",
        "history_mismatch",
        "prompt_token_mismatch",
        "prompt_decode_mismatch",
        "completion_decode_mismatch",
        "rerender_unsupported",
        "rerender_prefix_mismatch",
    }
)
_BOX_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,62}$")
# A run directory's name under work_dir/runs/ (namespaces, pilots): one path component, never '.' or '..'.
RUN_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$"
SERVED_NAME_PATTERN = r"[A-Za-z0-9][A-Za-z0-9._/-]{0,127}"
# A field name of a prompt row: copied into reports, so a plain identifier (dots allowed for nested-looking keys).
FIELD_NAME_PATTERN = r"^[A-Za-z_][A-Za-z0-9_.-]{0,63}$"


class PromptSource(BaseModel):
    """One prompt source: a local file or a Hugging Face dataset."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=optional_fields_as_plain_inputs)

    path: str = Field(
        ...,
        description=(
            "Local .jsonl/.json/.parquet file, a directory of them, or a Hugging Face dataset name "
            "(loaded through `datasets`; offline works for local files)."
        ),
    )
    name: str | None = Field(None, description="Source label recorded with every sample; defaults to the file stem.")
    format: Literal["auto", "sharegpt", "openai", "alpaca"] = Field(
        "auto", description="Conversation format; auto-detected per row when 'auto'."
    )
    split: str = Field("train", description="Dataset split (Hugging Face datasets only).")
    category_field: str | None = Field(
        None,
        pattern=FIELD_NAME_PATTERN,
        description=(
            "Row field holding a category label (e.g. 'category'), used for mix reports and caps: a plain field "
            "name (letters, digits, '_', '.', '-'; at most 64)."
        ),
    )
    max_rows: int | None = Field(None, ge=1, description="Read at most this many rows from the source.")
    tools: list[dict[str, Any]] | None = Field(
        None,
        description=(
            "Functions the conversations may call (OpenAI function schemas), for rows that carry no 'tools' of "
            "their own: rendered into every such prompt by the model's chat template."
        ),
    )
    allow_partial_read: bool = Field(
        False,
        description=(
            "When a JSON list file cannot be read past a syntax error, keep the rows before it and record the "
            "rows counted after it as 'unreadable_rest' rejects, instead of failing the source."
        ),
    )


class SamplingSpec(BaseModel):
    """Sampling parameters sent to the server with every request."""

    model_config = ConfigDict(extra="forbid")

    max_new_tokens: int = Field(8192, ge=1, description="Maximum generated tokens per completion (thinking included).")
    temperature: float = Field(1.0, ge=0.0, le=2.0, description="Sampling temperature.")
    top_p: float = Field(0.95, gt=0.0, le=1.0, description="Nucleus sampling threshold.")
    top_k: int = Field(20, description="Top-k sampling; -1 means all tokens.")
    enable_thinking: bool = Field(True, description="Render the prompt with thinking on (Qwen3.6 default).")

    @field_validator("top_k")
    @classmethod
    def _top_k(cls, v: int) -> int:
        if v != -1 and v < 1:
            raise ValueError("top_k must be >= 1 or -1 (all tokens)")
        return v


class ValidationSpec(BaseModel):
    """Per-sample checks: a sample failing one becomes a reject row with that reason."""

    model_config = ConfigDict(extra="forbid")

    min_answer_tokens: int = Field(
        8,
        ge=0,
        description=(
            "An answer shorter than this is a placeholder when the reasoning is also shorter than "
            "min_reasoning_tokens (thinking off: on its own). A short answer after real reasoning is kept."
        ),
    )
    min_reasoning_tokens: int = Field(
        16, ge=0, description="Reasoning shorter than this counts as none for the placeholder check."
    )
    min_loop_tokens: int = Field(
        64, ge=1, description="Back-to-back copies of a block count as a loop only when they span this many tokens."
    )
    max_loop_share: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description=(
            "Reject when 3 or more back-to-back copies of one block (any block size) span more than this share of "
            "the completion; a completion that ends in 3 or more copies is rejected at any share. A block of "
            "structure (see structural_word_share) in a finished completion is exempt."
        ),
    )
    structural_word_share: float = Field(
        0.5,
        ge=0.0,
        le=1.0,
        description=(
            "A repeated block whose share of word tokens is below this (matrix rows, table rows, code, separators) "
            "is the answer's structure, not a loop, when the completion finished and it repeats at most "
            "max_structural_copies times."
        ),
    )
    max_structural_copies: int = Field(
        128, ge=1, description="More back-to-back copies than this of a block of structure count as a loop."
    )
    min_loop_copies: int = Field(
        5,
        ge=2,
        description=(
            "A prose 8-gram (5 or more of its 8 tokens are words) that occurs this many times, back to back or not, "
            "is part of a loop (a chorus sung up to min_loop_copies - 1 times is not)."
        ),
    )
    max_loop_coverage: float = Field(
        0.1,
        gt=0.0,
        le=1.0,
        description="Reject when the tokens inside looping prose 8-grams (see min_loop_copies) exceed this share.",
    )
    reject_truncated: bool = Field(True, description="Reject completions cut at max_new_tokens.")
    max_repeated_ngram_share: float = Field(
        0.5, gt=0.0, le=1.0, description="Reject when this share of the completion's 8-grams are repeats (loops)."
    )
    reject_duplicate_completions: bool = Field(True, description="Reject identical completions for different prompts.")


class QualityGate(BaseModel):
    """Dataset-level checks that must pass before anything is published."""

    model_config = ConfigDict(extra="forbid")

    max_reject_rate: float = Field(0.2, ge=0.0, le=1.0, description="Fail the run when more samples are rejected.")
    short_loss_tokens: int = Field(16, ge=0, description="A sample with at most this many loss tokens counts as short.")
    max_short_share: float = Field(0.05, ge=0.0, le=1.0, description="Fail when more samples than this are short.")
    min_median_completion_tokens: int = Field(32, ge=0, description="Fail when the median completion is shorter.")
    max_source_share: float = Field(1.0, gt=0.0, le=1.0, description="Fail when one source exceeds this share.")
    max_category_share: float = Field(1.0, gt=0.0, le=1.0, description="Fail when one category exceeds this share.")


class Target(BaseModel):
    """A cap on the new prompts a run takes from one source or category."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., min_length=1, description="Source label (see a source's Name) or category.")
    count: int = Field(..., ge=0, description="At most this many new prompts; 0 takes none this run.")


class RunSpec(BaseModel):
    """What this run should do: prompts, model, sampling, sharding and where the dataset goes."""

    model_config = ConfigDict(extra="forbid", json_schema_extra=optional_fields_as_plain_inputs)

    sources: list[PromptSource] = Field(
        default_factory=lambda: [PromptSource(path="data/prompts", category_field="category")],
        description="Prompt sources, read in order.",
    )
    model_path: str = Field(
        "/dev/shm/Qwen3.6-27B",
        description="Model directory on the GPU box; its tokenizer and chat template are used for every prompt.",
    )
    sampling: SamplingSpec = Field(default_factory=SamplingSpec, title="Sampling", description="Sampling parameters.")
    shard_size: int = Field(1000, ge=1, description="Prompts per shard (unit of checkpointing and caching).")
    namespace: str = Field(
        "expansion_v1",
        pattern=_NAMESPACE_RE.pattern,
        description=(
            "Output namespace in the bucket; must not hold data already (publishing never overwrites). "
            "1-128 letters, digits, '.', '_' or '-', starting with a letter or digit. "
            "'auto' picks the next free expansion_vN."
        ),
    )
    skip_published: bool = Field(
        True,
        description=(
            "Skip every prompt id already published in an earlier namespace (the prompt catalog in S3), "
            "so a run generates only new prompts. A prompt that an earlier run rejected after loading "
            "(generate, validate or tokenize stage) counts as published unless its reason is in retry_rejected."
        ),
    )
    retry_rejected: list[str] = Field(
        default_factory=list,
        description=(
            "Reject reasons (e.g. truncated, server_rejected) whose prompts this run generates again although an "
            "earlier namespace published them as rejects: for causes that were a setting (a max_new_tokens that "
            "truncated them), not the prompt. Default: none, every rejected prompt stays skipped for good."
        ),
    )
    source_targets: list[Target] = Field(
        default_factory=list,
        description="At most this many new prompts from a source (by its label), a seeded random sample.",
    )
    category_targets: list[Target] = Field(
        default_factory=list,
        description="At most this many new prompts of a category, a seeded random sample.",
    )
    selection_seed: int = Field(0, description="Seed of the random sample that source/category targets take.")
    pilot: str | None = Field(
        None,
        pattern=RUN_NAME_PATTERN,
        description=(
            "Name of a finished pilot run (flow `pilot`) on this box: its completions are reused instead of "
            "generated again, and its length estimates order dispatch when order is 'long_first'."
        ),
    )
    turns: Literal["every", "last"] = Field(
        "every",
        description=(
            "Which assistant turns the target writes: 'every' regenerates each assistant turn of a conversation in "
            "order against its own earlier answers (recorded tool results spliced in), one training row per user "
            "turn: on-policy history, the data a draft model learns from (docs/conversations.md); 'last' only the "
            "final one after the row's own history, one row per prompt. Both modes run on one box and on several."
        ),
    )
    order: Literal["source", "long_first"] = Field(
        "source",
        description=(
            "Dispatch order: 'source' (as read) or 'long_first' (longest predicted outputs first, from the "
            "pilot's estimates; shortens the end-of-run tail where GPUs idle)."
        ),
    )

    # --- Advanced: rarely changed; last in the run form, titled 'Advanced: ...' --------------------------
    served_model_name: str = Field(
        "qwen3.6-27b",
        title="Advanced: Served Model Name",
        description="Name the servers report: letters, digits, . _ / - (no ':', no spaces).",
    )
    # One JSON box each in the form (datagen.operations.form_schema): 17 thresholds drawn field by field were a
    # quarter of it.
    validation: Annotated[ValidationSpec, WithJsonSchema(json_box(ValidationSpec))] = Field(
        default_factory=ValidationSpec,
        title="Advanced: Validation",
        description=(
            f"Per-sample checks, as JSON: keys {', '.join(ValidationSpec.model_fields)} "
            "(docs/data-quality.md says what each does)."
        ),
    )
    quality_gate: Annotated[QualityGate, WithJsonSchema(json_box(QualityGate))] = Field(
        default_factory=QualityGate,
        title="Advanced: Quality Gate",
        description=(
            f"Dataset-level checks before publish, as JSON: keys {', '.join(QualityGate.model_fields)} "
            "(docs/data-quality.md says what each does)."
        ),
    )
    server_args: list[str] = Field(
        default_factory=list,
        title="Advanced: Server Args",
        description=(
            "Extra tuning flags for every server, written in full (--flag value or --flag=value): only flags on "
            "the allow-list in docs/real-engine.md; flags the box manages (host, port, keys, model, tokenizer, "
            "code loading) are refused. Values are judged by the engine's own parser."
        ),
    )
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        title="Advanced: Max Prompt Tokens",
        description="Reject prompts longer than this; default: context length minus max_new_tokens.",
    )
    context_length: int = Field(
        262144,
        ge=1,
        title="Advanced: Context Length",
        description="Model context length (prompt + completion must fit).",
    )

    @field_validator("namespace")
    @classmethod
    def _namespace(cls, v: str) -> str:
        if not _NAMESPACE_RE.match(v) or ".." in v:
            raise ValueError(
                "namespace must be 1-128 characters of letters, digits, '.', '_' or '-', "
                "starting with a letter or digit"
            )
        return v

    @field_validator("server_args")
    @classmethod
    def _server_args(cls, v: list[str]) -> list[str]:
        check_server_args(v)  # a ValueError: the run form or the flow refuses the run before anything starts
        return v

    @field_validator("served_model_name")
    @classmethod
    def _served_name(cls, v: str) -> str:
        if ":" in v:
            raise ValueError("served_model_name must not contain ':' (SGLang reads it as base:lora-adapter)")
        # It goes into the servers' argv: a name, never something SGLang's parser could read as a flag or two.
        if not re.fullmatch(SERVED_NAME_PATTERN, v):
            raise ValueError(
                f"served_model_name must be a name ({SERVED_NAME_PATTERN}: starts with a letter or digit, then "
                f"letters, digits, . _ / -, at most 128 characters), not {v[:100]!r}"
            )
        return v

    @field_validator("retry_rejected")
    @classmethod
    def _retry_reasons(cls, v: list[str]) -> list[str]:
        bad = [r for r in v if r not in RETRYABLE_REASONS]
        if bad:
            raise ValueError(
                f"retry_rejected: {', '.join(map(repr, bad))} not a reason a published reject can carry "
                f"(one of: {', '.join(sorted(RETRYABLE_REASONS))})"
            )
        return sorted(set(v))

    @field_validator("source_targets", "category_targets", mode="before")
    @classmethod
    def _targets(cls, v: object) -> object:
        # YAML configs and `--set` write a mapping (label: count); the run form writes a list of {name, count}.
        if isinstance(v, dict):
            bad = sorted(k for k, n in v.items() if isinstance(n, int) and n < 0)
            if bad:
                raise ValueError(f"targets must be >= 0 (got negative targets for {bad})")
            return [{"name": k, "count": n} for k, n in v.items()]
        return v

    @field_validator("source_targets", "category_targets")
    @classmethod
    def _unique_targets(cls, v: list[Target]) -> list[Target]:
        names = [t.name for t in v]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(f"each name may have one target (got several for {dupes})")
        return v

    @property
    def source_target_counts(self) -> dict[str, int]:
        """source_targets as label -> count."""
        return {t.name: t.count for t in self.source_targets}

    @property
    def category_target_counts(self) -> dict[str, int]:
        """category_targets as category -> count."""
        return {t.name: t.count for t in self.category_targets}

    @model_validator(mode="after")
    def _long_first_needs_pilot(self) -> RunSpec:
        if self.order == "long_first" and not self.pilot:
            raise ValueError("order 'long_first' needs a pilot: its measured lengths are what the order follows")
        return self

    @model_validator(mode="after")
    def _fits(self) -> RunSpec:
        if self.sampling.max_new_tokens >= self.context_length:
            raise ValueError(
                f"sampling.max_new_tokens ({self.sampling.max_new_tokens}) leaves no room for a prompt "
                f"in context_length ({self.context_length})"
            )
        return self

    @property
    def prompt_token_limit(self) -> int:
        """Longest prompt (in tokens) that can still be sent."""
        fit = self.context_length - self.sampling.max_new_tokens
        return min(fit, self.max_prompt_tokens) if self.max_prompt_tokens else fit


class ExchangeSpec(BaseModel):
    """How GPU boxes share a run's shards through S3: leases, checkpoint uploads, shards per box."""

    model_config = ConfigDict(extra="forbid")

    lease_s: float = Field(
        120.0,
        gt=0,
        description="A shard claim lasts this long unless renewed; a dead box's shards are taken over after it.",
    )
    sync_interval_s: float = Field(
        10.0, gt=0, description="How often a box uploads new checkpoint rows of its shards (and renews leases)."
    )
    shards_in_flight: int = Field(
        2, ge=1, le=64, description="Shards one box generates at once (keeps its servers full across shard ends)."
    )

    @model_validator(mode="after")
    def _renew_in_time(self) -> ExchangeSpec:
        if self.sync_interval_s * 2 > self.lease_s:
            raise ValueError(
                f"sync_interval_s ({self.sync_interval_s}) must be at most half of lease_s ({self.lease_s}): "
                "leases are renewed from the sync loop"
            )
        return self


class MultiBoxSpec(BaseModel):
    """Which GPU boxes a multi-box run uses and how the parent flow waits for them."""

    model_config = ConfigDict(extra="forbid")

    boxes: list[str] = Field(
        default_factory=lambda: ["box-1"],
        min_length=1,
        description="Box names; each is the work queue its box's worker serves (one child flow run per box).",
    )
    deployment: str = Field(
        "generate-on-box/per-box", description="Deployment of the per-box flow, as 'flow-name/deployment-name'."
    )
    exchange: ExchangeSpec = Field(default_factory=ExchangeSpec, description="Shard leases and checkpoint uploads.")
    poll_s: float = Field(5.0, gt=0, description="How often the parent checks shard markers and child states.")
    child_exit_grace_s: float = Field(
        300.0,
        ge=0,
        description=(
            "After every shard is done, how long a box's child run may take to end before the parent marks it "
            "Crashed (its box died: nothing reports for it any more)."
        ),
    )

    @field_validator("boxes")
    @classmethod
    def _boxes(cls, v: list[str]) -> list[str]:
        bad = [b for b in v if not _BOX_RE.match(b)]
        if bad:
            raise ValueError(f"box names must be 1-63 letters, digits, '_' or '-': {bad}")
        if len(set(v)) != len(v):
            raise ValueError(f"box names must be unique: {v}")
        return v
