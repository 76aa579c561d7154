"""Render once: what generation pays per prompt to prepare a request, rendering again vs reading planning's render.

    python -m benchmarks.preparation --out preparation.json [--prompts 3000 --mean-words 400 --shard-size 1000]

Plans N synthetic multi-turn prompts (OpenAI messages over real Qwen3.6 vocabulary words, the fixture model's
template and tokenizer) with `tasks.planning.plan_shards`, which renders every prompt once for its id and writes
each shard's ids (`shard-NNNNN.input-ids.arrow`). Then, per shard, times the two ways generation can get the
token ids it sends: `Preparer` on every prompt (render + tokenize: what generate_shard did before) and
`read_rendered` (what it does now), and checks both give the same ids. Single-threaded, no servers.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import tempfile
import time
from pathlib import Path

from datagen.chat import ChatTokenizer
from datagen.identity import PromptIdentity
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import PromptSource, RunSpec
from datagen.sources.preparation import read_rendered
from tasks.generation import read_prompts
from tasks.planning import plan_shards

__all__ = ["main", "run_benchmark"]


def _rows(n: int, mean_words: int, seed: int, chat: ChatTokenizer) -> list[dict[str, object]]:
    rng = random.Random(seed)
    words = [w for w in (chat.decode([i]) for i in range(1000, 40_000)) if w.startswith(" ") and w[1:].isalpha()]
    rows: list[dict[str, object]] = []
    for i in range(n):
        turns = rng.choice((1, 1, 2, 3))
        messages: list[dict[str, str]] = [{"role": "system", "content": "You are a careful assistant."}]
        for t in range(turns):
            k = max(5, int(rng.expovariate(1 / mean_words)) // turns)
            messages.append({"role": "user", "content": f"Task {i}.{t}:" + "".join(rng.choices(words, k=k))})
            if t < turns - 1:
                messages.append({"role": "assistant", "content": "".join(rng.choices(words, k=k // 2))})
        rows.append({"messages": messages})
    return rows


def run_benchmark(prompts: int, mean_words: int, shard_size: int, seed: int) -> dict[str, object]:
    """Plan, then time render-again against read-the-render for every shard."""
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.shared(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        source = Path(tmp) / "prompts.jsonl"
        source.write_text("".join(json.dumps(r) + "\n" for r in _rows(prompts, mean_words, seed, chat)))
        spec = RunSpec(sources=[PromptSource(path=str(source))], shard_size=shard_size, model_path=str(model_dir))
        layout = RunLayout(Path(tmp) / "run")
        t0 = time.perf_counter()
        plan = plan_shards(spec, layout)
        plan_s = time.perf_counter() - t0
        preparer = PromptIdentity.for_spec(spec).preparer
        render_s = read_s = 0.0
        tokens = 0
        for shard_id in plan.shard_ids:
            path = layout.shard_prompts(shard_id)
            shard = list(read_prompts(path))
            t0 = time.perf_counter()
            rendered = [preparer(p.messages) for p in shard]
            render_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            cache = read_rendered(path, preparer.render_key)
            assert cache is not None
            cached = [preparer.fitting(cache[row]) for row in range(len(shard))]  # as generate_shard takes them
            read_s += time.perf_counter() - t0
            if cached != rendered:
                raise AssertionError(f"shard {shard_id}: planning's render differs from rendering again")
            tokens += sum(len(ids) for ids in rendered)
    n = plan.n_prompts
    return {
        "prompts": n,
        "shards": len(plan.shard_ids),
        "mean_prompt_tokens": round(tokens / n, 1),
        "plan_s": round(plan_s, 3),
        "generation_render_again_s": round(render_s, 3),
        "generation_read_render_s": round(read_s, 3),
        "render_again_ms_per_prompt": round(render_s / n * 1000, 4),
        "read_render_ms_per_prompt": round(read_s / n * 1000, 4),
        "saved_s": round(render_s - read_s, 3),
        "saved_share_of_render": round(1 - read_s / render_s, 4) if render_s else 0.0,
        "machine": {"platform": platform.platform(), "python": platform.python_version(), "cpus": os.cpu_count()},
        "load_avg": os.getloadavg(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--prompts", type=int, default=3000)
    ap.add_argument("--mean-words", type=int, default=400)
    ap.add_argument("--shard-size", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=7)
    args = ap.parse_args()
    result = run_benchmark(args.prompts, args.mean_words, args.shard_size, args.seed)
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
