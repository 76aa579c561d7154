"""Tokenization throughput: the token-exact stage against a raw `tokenizers` batch encode of the same texts.

    python -m benchmarks.tokenization --out tokenization.json [--samples 2000 --mean-tokens 1500]

Synthesizes thinking-format completions (`{reasoning}\\n</think>\\n\\n{answer}<|im_end|>`) over the real
Qwen3.6 vocabulary (the fixture model directory), writes them as an accepted-completions JSONL shard,
then times `tokenize_accepted` end to end (JSONL read, template render, prompt encode, decode checks,
parquet write). The baseline encodes the full conversation texts (prompt + completion) with the Rust
tokenizer's batch encode, which is what a re-tokenizing pipeline would at least have to pay.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import re
import tempfile
import time
from pathlib import Path

import tokenizers

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.conversation.turn_mode import LastTurn
from datagen.identity import prompt_id_from_messages
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion, Message
from tasks.tokenization import tokenize_accepted

__all__ = ["main", "run_benchmark", "synthesize"]

_WORD = re.compile(r"^ [a-z]{2,12}$")


def _word_pool(chat: ChatTokenizer) -> list[str]:
    words = [chat.decode([i]) for i in range(500, 60_000)]
    return [w for w in words if _WORD.match(w)]


def _sentence(rng: random.Random, words: list[str], n: int) -> str:
    body = "".join(rng.choice(words) for _ in range(n)).strip()
    return body[:1].upper() + body[1:] + rng.choice([".", ".", ".", "?", ":"])


def _paragraphs(rng: random.Random, words: list[str], n_words: int) -> str:
    parts: list[str] = []
    left = n_words
    while left > 0:
        k = min(left, rng.randint(6, 24))
        parts.append(_sentence(rng, words, k))
        left -= k
        if rng.random() < 0.15:
            parts.append("\n\n")
        elif rng.random() < 0.05:
            parts.append("\n```python\nfor i in range(10):\n    print(i * 2)\n```\n")
        else:
            parts.append(" ")
    return "".join(parts).strip()


def synthesize(chat: ChatTokenizer, samples: int, mean_tokens: int, seed: int = 0) -> list[Completion]:
    """Thinking-format completions with canonical output ids, lengths spread around `mean_tokens`."""
    rng = random.Random(seed)
    words = _word_pool(chat)
    messages_list: list[list[Message]] = []
    texts: list[str] = []
    for i in range(samples):
        n_words = max(20, int(rng.lognormvariate(0, 0.6) * mean_tokens * 0.75))
        reasoning = _paragraphs(rng, words, int(n_words * 0.7))
        answer = _paragraphs(rng, words, n_words - int(n_words * 0.7))
        messages: list[Message] = [{"role": "user", "content": f"Task {i}: " + _paragraphs(rng, words, 40)}]
        if i % 4 == 0:
            messages.insert(0, {"role": "system", "content": "You are a helpful assistant."})
        messages_list.append(messages)
        texts.append(f"{reasoning}\n</think>\n\n{answer}")
    out_ids = chat.encode_batch(texts)
    prompt_ids = chat.encode_batch([chat.render(m, True) for m in messages_list])
    out: list[Completion] = []
    for i, (messages, text, ids, pids) in enumerate(zip(messages_list, texts, out_ids, prompt_ids, strict=True)):
        pid = prompt_id_from_messages("bench", messages)
        full = [*ids, IM_END_ID]
        out.append(Completion(pid, "bench", i, messages, f"rk-{pid}", len(pids), full, text, "stop", len(full)))
    return out


def _machine() -> dict[str, str | int | None]:
    cpu = platform.processor() or ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "tokenizers": tokenizers.__version__,
        "platform": platform.platform(),
    }


def run_benchmark(samples: int, mean_tokens: int, rows_per_file: int) -> dict[str, object]:
    """Time tokenize_accepted and a raw batch encode over the same synthesized completions."""
    chat = ChatTokenizer.from_model_dir(ensure_model_dir())
    completions = synthesize(chat, samples, mean_tokens)
    with tempfile.TemporaryDirectory() as tmp:
        shard = Path(tmp) / "shard-00000.accepted.jsonl"
        shard.write_text("".join(c.to_json() + "\n" for c in completions), encoding="utf-8")
        t0 = time.perf_counter()
        summary = tokenize_accepted(
            [shard], Path(tmp) / "dataset", chat, True, rows_per_file=rows_per_file, turns=LastTurn()
        )
        stage_s = time.perf_counter() - t0
        data_bytes = summary.data_bytes
    assert summary.rows == samples, summary.rejects_by_reason

    full_texts = [chat.render(c.messages, True) + c.text + "<|im_end|>" for c in completions]
    t0 = time.perf_counter()
    raw = chat.encode_batch(full_texts)
    raw_s = time.perf_counter() - t0
    raw_tokens = sum(len(r) for r in raw)

    tokens_per_s = summary.input_tokens / stage_s
    raw_tokens_per_s = raw_tokens / raw_s
    return {
        "samples": samples,
        "input_tokens": summary.input_tokens,
        "loss_tokens": summary.loss_tokens.total,
        "mean_completion_tokens": round(summary.loss_tokens.mean, 1),
        "stage_s": round(stage_s, 3),
        "tokens_per_s": round(tokens_per_s),
        "raw_tokens": raw_tokens,
        "raw_s": round(raw_s, 3),
        "raw_tokens_per_s": round(raw_tokens_per_s),
        "ratio": round(tokens_per_s / raw_tokens_per_s, 3),
        "parquet_bytes": data_bytes,
        "machine": _machine(),
    }


def main(argv: list[str] | None = None) -> None:
    """Run the benchmark, print a table and write the figures as JSON."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True, help="JSON file for the results.")
    parser.add_argument("--samples", type=int, default=2000)
    parser.add_argument("--mean-tokens", type=int, default=1500)
    parser.add_argument("--rows-per-file", type=int, default=10_000)
    args = parser.parse_args(argv)
    result = run_benchmark(args.samples, args.mean_tokens, args.rows_per_file)
    args.out.write_text(json.dumps(result, indent=1) + "\n", encoding="utf-8")
    print(f"{'measure':<34}{'value':>14}")
    for key in ("samples", "input_tokens", "mean_completion_tokens", "stage_s", "tokens_per_s", "raw_s"):
        print(f"{key:<34}{result[key]!s:>14}")
    print(f"{'raw_tokens_per_s':<34}{result['raw_tokens_per_s']!s:>14}")
    print(f"{'ratio (stage / raw encode)':<34}{result['ratio']!s:>14}")


if __name__ == "__main__":
    main()
