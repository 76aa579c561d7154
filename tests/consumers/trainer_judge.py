"""Run a trainer's own data preprocessing on a downloaded datagen namespace; print its rows as JSON.

Runs in a subprocess whose path holds the pinned trainer wheels and a CPU torch (tests/consumers/conftest.py),
never in the pytest process. Usage: trainer_judge.py {specforge|speculators} MODEL_DIR NAMESPACE_DIR OUT_JSON
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

MAX_LENGTH = 32768  # above every row here, so neither trainer truncates


def specforge_rows(model_dir: str, namespace: Path) -> list[dict[str, list[int]]]:
    """SpecForge 0.2.0: its JSON loading (datasets' json builder) and build_eagle3_dataset with `qwen3.5`."""
    from datasets import load_dataset
    from specforge.data.preprocessing import build_eagle3_dataset
    from transformers import AutoTokenizer

    files = sorted(str(p) for p in (namespace / "conversations").glob("conversations-*.jsonl"))
    raw = load_dataset("json", data_files=files, split="train")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = build_eagle3_dataset(raw, tokenizer, chat_template="qwen3.5", max_length=MAX_LENGTH, num_proc=None)
    return [
        {"input_ids": r["input_ids"].reshape(-1).tolist(), "loss_mask": r["loss_mask"].reshape(-1).tolist()}
        for r in out
    ]


def speculators_rows(model_dir: str, namespace: Path) -> list[dict[str, list[int]]]:
    """speculators 0.9.0: load_raw_dataset on `hf:<namespace>` (the dataset card's default config: data/), then
    build_speculator_training_dataset, the two steps of its load_and_preprocess_dataset.

    The processor is the tokenizer: their CLI's AutoProcessor makes a Qwen3.6 directory a vision processor,
    which needs PIL and torchvision (not installed here); on pre-tokenized rows the processor only decides
    whether rows are multimodal, and the pass-through returns before that matters.
    """
    from speculators.data_generation.preprocessing import build_speculator_training_dataset, load_raw_dataset
    from transformers import AutoTokenizer

    raw, _ = load_raw_dataset(f"hf:{namespace}")
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    out = build_speculator_training_dataset(raw, tokenizer, max_length=MAX_LENGTH, num_proc=1)
    return [{"input_ids": r["input_ids"].tolist(), "loss_mask": r["loss_mask"].tolist()} for r in out]


def main() -> None:
    trainer, model_dir, namespace, out = sys.argv[1:5]
    judge = {"specforge": specforge_rows, "speculators": speculators_rows}[trainer]
    Path(out).write_text(json.dumps(judge(model_dir, Path(namespace))))


if __name__ == "__main__":
    main()
