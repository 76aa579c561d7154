"""Large rows at load: time and peak memory to turn one 1/10/30/50 MB prompt row into a prompt or a reject.

Each size runs in its own child process (so its peak RSS is its own): the child loads the real Qwen3.6 tokenizer
(fixture model directory), notes its RSS, then streams a one-row JSONL file through `iter_prompts` with the run's
`PromptIdentity` (the load path of `plan shards`) and reports the seconds and the peak RSS above that baseline.
The text is random English-like words (about 5 characters per token). The token limit is a long-context run's
(context 262,144 - max_new_tokens 8,192 = 253,952 tokens), so rows up to 32.5 MB are under the length-only
shortcut (limit x 128 bytes) and must be counted.

`python -m benchmarks.large_rows --out large_rows.json [--sizes-mb 1 10 30 50] [--limit 253952]`
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.tokenization import _machine  # one description of the machine for every benchmark

WORDS = [
    "the",
    "of",
    "and",
    "to",
    "in",
    "is",
    "that",
    "for",
    "it",
    "as",
    "with",
    "was",
    "on",
    "be",
    "by",
    "at",
    "this",
    "from",
    "have",
    "or",
    "an",
    "are",
    "not",
    "but",
    "which",
    "one",
    "all",
    "their",
    "there",
    "were",
    "been",
    "has",
    "when",
    "who",
    "will",
    "more",
    "if",
    "no",
    "out",
    "so",
    "what",
    "up",
    "can",
    "about",
    "into",
    "than",
    "them",
    "only",
    "other",
    "new",
    "some",
    "could",
    "time",
    "these",
    "two",
    "may",
    "then",
    "first",
    "any",
    "like",
    "now",
    "my",
    "such",
    "make",
    "over",
    "our",
    "even",
    "most",
    "also",
    "after",
    "very",
]


def _child(path: str, limit: int) -> dict[str, float | str]:
    from datagen.chat import ChatTokenizer
    from datagen.identity import PromptIdentity
    from datagen.local.model_fixture import ensure_model_dir
    from datagen.records import Reject
    from datagen.runspec import PromptSource
    from datagen.sources.preparation import Preparer
    from datagen.sources.prompts import iter_prompts

    chat = ChatTokenizer.shared(ensure_model_dir())
    _ = chat.max_token_bytes  # computed once per tokenizer, not part of a row's cost
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    items = list(iter_prompts([PromptSource(path=path)], identity=PromptIdentity(Preparer(chat, True, limit))))
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    item = items[0]
    outcome = f"reject {item.reason}: {item.detail[:160]}" if isinstance(item, Reject) else "prompt"
    return {
        "seconds": round(seconds, 2),
        "baseline_rss_mb": round(base),
        "peak_rss_mb": round(peak),
        "outcome": outcome,
    }


def _row_file(directory: Path, mb: int) -> Path:
    rng = random.Random(mb)
    target = mb * 1_000_000
    parts: list[str] = []
    size = 0
    while size < target:
        sentence = " ".join(rng.choice(WORDS) for _ in range(12)).capitalize() + ". "
        parts.append(sentence)
        size += len(sentence)
    path = directory / f"row-{mb}mb.jsonl"
    path.write_text(json.dumps({"instruction": "".join(parts)[:target]}) + "\n", encoding="utf-8")
    return path


def main(argv: list[str] | None = None) -> None:
    """Run every size in a child process and write the JSON result."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sizes-mb", type=int, nargs="+", default=[1, 10, 30, 50])
    parser.add_argument("--limit", type=int, default=262_144 - 8_192)
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(_child(args.child, args.limit)))
        return
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mb in args.sizes_mb:
            path = _row_file(Path(tmp), mb)
            cmd = [sys.executable, "-m", "benchmarks.large_rows", "--out", "-", "--limit", str(args.limit)]
            done = subprocess.run([*cmd, "--child", str(path)], capture_output=True, text=True, check=True)
            result = json.loads(done.stdout.strip().splitlines()[-1])
            rows.append({"mb": mb, "chars": path.stat().st_size, **result})
            print(json.dumps(rows[-1]), flush=True)
            path.unlink()
    out = {"limit_tokens": args.limit, "rows": rows, "machine": _machine()}
    args.out.write_text(json.dumps(out, indent=1) + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()
