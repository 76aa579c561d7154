"""The dataset card (README.md) published with the data: Hugging Face YAML front matter plus a short description.

The front matter is what `datasets` and the Hub read (configs, features, split sizes); the `datagen`
block is the lineage a consumer needs to trust the data: which model and template produced it,
with which sampling, by which pipeline version, from which source mix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import yaml
from pydantic import BaseModel, Field

from datagen import __version__
from datagen.conversation.export import CONVERSATIONS_GLOB
from datagen.records import TOKEN_ROW_SCHEMA
from datagen.runspec import SamplingSpec

__all__ = ["CARD_NAME", "DatasetSizes", "Lineage", "arrow_features_yaml", "write_dataset_card"]

CARD_NAME = "README.md"


class DatasetSizes(BaseModel):
    """How big the published training data is."""

    num_examples: int = Field(..., ge=0, description="Training rows.")
    num_bytes: int = Field(0, ge=0, description="Bytes of the training parquet files.")
    num_input_tokens: int = Field(0, ge=0, description="Sum of len(input_ids).")
    num_loss_tokens: int = Field(0, ge=0, description="Sum of loss_mask (tokens trained on).")
    num_rejects: int = Field(0, ge=0, description="Rows of the rejects dataset.")
    num_files: int = Field(0, ge=0, description="Training parquet files.")
    # Every-turn runs (docs/conversations.md): one row per user turn, one conversations/ line per conversation.
    num_conversations: int = Field(0, ge=0, description="Every turn: conversations published.")
    num_turns: int = Field(0, ge=0, description="Every turn: user turns published (one training row each).")
    # Identical rows (issue 47): conversations that open the same way make byte-identical rows for their shared
    # turns under deterministic decoding. Kept (each is its conversation's turn) and counted here.
    num_duplicate_rows: int = Field(0, ge=0, description="Rows identical (input_ids and loss_mask) to an earlier row.")
    num_duplicate_groups: int = Field(0, ge=0, description="Distinct rows that have such copies.")


class Lineage(BaseModel):
    """Where the data came from, recorded in the card."""

    model_fingerprint: str = Field(..., description="ChatTokenizer.fingerprint of the model directory.")
    template_hash: str = Field(..., description="ChatTokenizer.template_hash of the chat template.")
    pipeline_version: str = Field(__version__, description="datagen version that produced the data.")
    tokenization_mode: str = Field("token_exact", description="token_exact or rerender.")
    source_mix: dict[str, int] = Field(default_factory=dict, description="Source -> training rows.")
    category_mix: dict[str, int] = Field(default_factory=dict, description="Category -> training rows.")
    speculative_decoding: str | None = Field(
        None, description="Server-side speculative decoding used while generating (e.g. 'NEXTN'), if any."
    )
    server_args: list[str] = Field(default_factory=list, description="Extra server launch flags.")
    numerics_flags: list[str] = Field(
        default_factory=list,
        description="Launch flags that change or may change outputs (SSM/KV dtype, quantization, speculative).",
    )
    memory_plan: list[str] = Field(default_factory=list, description="Tuning flags the engine's memory plan added.")
    memory_plan_by_box: dict[str, list[str]] = Field(
        default_factory=dict, description="Multi-box runs: each box's memory plan flags (from its own GPU probe)."
    )
    memory_plan_note: str | None = Field(
        None, description="How the plan was chosen when not by sizing alone (a pilot's side-by-side trial)."
    )
    skipped_published: int = Field(0, description="Prompts of the sources skipped as published by other namespaces.")
    old_rejects_skipped: int = Field(
        0, description="Rows of the sources other namespaces published as load rejects: skipped, not published again."
    )
    run_id: str | None = Field(None, description="Prefect flow run id.")
    created_at: str | None = Field(None, description="ISO timestamp of the run.")


def _arrow_dtype(t: pa.DataType) -> str:
    if pa.types.is_string(t) or pa.types.is_large_string(t):
        return "string"
    if pa.types.is_integer(t) or pa.types.is_boolean(t):
        return str(t)  # int8 .. uint64, bool: the same names in `datasets`
    if pa.types.is_floating(t):
        return {"halffloat": "float16", "float": "float32", "double": "float64"}[str(t)]
    raise ValueError(f"no dataset-card dtype for Arrow type {t}")


def arrow_features_yaml(schema: pa.Schema) -> list[dict[str, str]]:
    """The `dataset_info.features` list for an Arrow schema of scalar and list-of-scalar columns."""
    out: list[dict[str, str]] = []
    for f in schema:
        if pa.types.is_list(f.type):
            out.append({"name": f.name, "list": _arrow_dtype(f.type.value_type)})
        else:
            out.append({"name": f.name, "dtype": _arrow_dtype(f.type)})
    return out


def write_dataset_card(
    staging_dir: Path,
    *,
    namespace: str,
    model: str,
    sampling: SamplingSpec,
    lineage: Lineage,
    sizes: DatasetSizes,
    features: pa.Schema = TOKEN_ROW_SCHEMA,
) -> Path:
    """Write `staging_dir/README.md`: YAML front matter (configs, features, sizes, model, sampling, lineage) + prose."""
    front: dict[str, Any] = {
        "pretty_name": f"datagen {namespace}",
        "tags": ["datagen", "speculative-decoding", "synthetic", "tokenized"],
        "configs": [
            {"config_name": "default", "data_files": [{"split": "train", "path": "data/train-*.parquet"}]},
            {"config_name": "rejects", "data_files": [{"split": "train", "path": "rejects/rejects-*.parquet"}]},
            {"config_name": "conversations", "data_files": [{"split": "train", "path": CONVERSATIONS_GLOB}]},
        ],
        "dataset_info": {
            "config_name": "default",
            "features": arrow_features_yaml(features),
            "splits": [{"name": "train", "num_bytes": sizes.num_bytes, "num_examples": sizes.num_examples}],
            "download_size": sizes.num_bytes,
            "dataset_size": sizes.num_bytes,
        },
        "datagen": {
            "namespace": namespace,
            "model": model,
            "sampling": sampling.model_dump(),
            "lineage": lineage.model_dump(),
            # A `last` run's card is unchanged: the every-turn counts only when there are conversations.
            "sizes": sizes.model_dump(exclude=None if sizes.num_conversations else {"num_conversations", "num_turns"}),
        },
    }
    mix = sorted(lineage.source_mix.items(), key=lambda kv: -kv[1])
    total = sum(lineage.source_mix.values()) or 1
    mix_lines = "\n".join(f"| {name} | {n} | {n / total:.1%} |" for name, n in mix) or "| (none) | 0 | - |"
    thinking = "on" if sampling.enable_thinking else "off"
    if sizes.num_conversations:
        layout = f"""Every assistant turn was regenerated by the model against its own earlier turns (tool results
spliced back from the source). Each row of `data/` is one user turn of a conversation (`conversation_id`,
`turn_index`): the rendered conversation up to that user query, then every assistant and tool message that
answers it; `loss_mask` is 1 exactly on the tokens the model generated (`num_loss_spans` spans, each ending
as `span_finish_reasons` says), 0 on the prompt, tool results and template tokens ({lineage.tokenization_mode}).
`conversations/` holds each conversation once, in SpecForge's JSONL schema (every regenerated assistant turn
with `reasoning_content` and `tool_calls`, the tool turns between, `tools` as JSON text, and `outcome`: why
it ended), for trainers that render conversations themselves.
`rejects/` lists every sample that was not shipped, with its stage and reason.

- conversations: {sizes.num_conversations}, user turns: {sizes.num_turns}"""
    else:
        layout = (
            "Each row of `data/` is one conversation: `input_ids` are the rendered prompt's token ids followed by\n"
            "the completion's token ids exactly as the server generated them "
            f"({lineage.tokenization_mode});\n"
            "`loss_mask` is 0 over the prompt and 1 over the completion (thinking, answer and the closing EOS).\n"
            "`conversations/` holds the same rows as conversations in SpecForge's JSONL schema (`id` = the row's\n"
            "`conversation_id`; the prompt's messages, then the generated turn with `reasoning_content` split at\n"
            "`</think>`; `tools` as JSON text), for trainers that render conversations themselves.\n"
            "`rejects/` lists every sample that was not shipped, with its stage and reason.\n"
        )
    body = f"""# datagen {namespace}

Completions generated by **{model}** (thinking {thinking}, temperature {sampling.temperature}, top_p
{sampling.top_p}, top_k {sampling.top_k}, max_new_tokens {sampling.max_new_tokens}), validated and
tokenized for training a speculative-decoding drafter on the target model's own outputs.

{layout}
- rows: {sizes.num_examples}, files: {sizes.num_files}, bytes: {sizes.num_bytes}
- input tokens: {sizes.num_input_tokens}, loss tokens: {sizes.num_loss_tokens}, rejects: {sizes.num_rejects}
- identical rows: {sizes.num_duplicate_rows} rows repeat an earlier row ({sizes.num_duplicate_groups} distinct rows
  with copies; kept: conversations that open the same way share their first turns)
- skipped as published by earlier namespaces: {lineage.skipped_published} prompts and {lineage.old_rejects_skipped}
  rows rejected before (their rejects are in the namespace that first read them)
- model fingerprint `{lineage.model_fingerprint}`, chat template `{lineage.template_hash}`,
  datagen {lineage.pipeline_version}
- numerics: {" ".join(lineage.numerics_flags) or "BF16 weights, KV cache and conv state, FP32 SSM state (defaults)"};
  memory plan flags (no effect on outputs): {_memory_plan_line(lineage)}

| source | rows | share |
|---|---:|---:|
{mix_lines}
"""
    text = "---\n" + yaml.safe_dump(front, sort_keys=False, allow_unicode=True) + "---\n\n" + body
    path = staging_dir / CARD_NAME
    staging_dir.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{CARD_NAME}.tmp")
    tmp.write_text(text, encoding="utf-8")
    tmp.replace(path)
    return path


def _memory_plan_line(lineage: Lineage) -> str:
    """The card's memory plan flags: one list, or each box's; and how the plan was kept, when a trial chose it."""
    if lineage.memory_plan_by_box:
        line = "; ".join(
            f"{box}: {' '.join(args) or 'none'}" for box, args in sorted(lineage.memory_plan_by_box.items())
        )
    else:
        line = " ".join(lineage.memory_plan) or "none"
    return f"{line} ({lineage.memory_plan_note})" if lineage.memory_plan_note else line
