"""summarize.py: the figures of one device call's results folder as Markdown (for benchmarks/README.md).

.venv/bin/python benchmarks/real_engine/summarize.py benchmarks/results/real-engine-h100
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def load(path: Path) -> dict[str, Any] | None:
    return json.loads(path.read_text()) if path.is_file() else None


def pools(s: dict[str, Any] | None) -> str:
    if not s:
        return "-"
    return f"{s['max_mamba_cache_size']} / {s['max_total_num_tokens']:,} / {s['max_running_requests']}"


def main() -> None:
    d = Path(sys.argv[1])
    env = (d / "env.txt").read_text() if (d / "env.txt").is_file() else ""
    print("```\n" + "\n".join(env.splitlines()[:8]) + "\n```\n")
    defaults = load(d / "defaults.json")
    if defaults:
        print("| sizing (state slots / KV tokens / max running) | value |\n|---|---|")
        print(f"| SGLang 0.5.17 logged, defaults | {pools(defaults.get('logged'))} |")
        for k, v in (defaults.get("predicted") or {}).items():
            print(f"| plan's prediction, {k} | {pools(v)} |")
        print()
    for f in sorted(d.glob("plan-*.json")):
        p = load(f)
        if not p:
            continue
        plan = p.get("plan") or {}
        print(f"{f.stem}: flags `{' '.join(plan.get('args') or [])}`; predicted {pools(plan.get('launched'))}; ")
        print(
            f"logged {pools(p.get('logged'))}; KV error {p.get('kv_error')}; shortfall {p.get('shortfall_vs_plan')}\n"
        )
    rows = []
    for f in [d / "defaults.json", *sorted(d.glob("plan-*.json"))]:
        p = load(f)
        for b in (p or {}).get("benches") or []:
            if "skipped" in b:
                rows.append(f"| {f.stem} | {b['prompt_len']}x{b['max_new_tokens']}x{b['requests']} | skipped |||||")
                continue
            rows.append(
                f"| {f.stem} | {b['prompt_len']}+{b['max_new_tokens']} x {b['requests']} | {b['ok']} | "
                f"{b['output_tokens_per_s']} | {b.get('log_max_running_req')} | {b.get('log_median_gen_throughput')} | "
                f"{b.get('decode_roofline_tokens_per_s_at_running')} | {b['wall_seconds']} |"
            )
    if rows:
        print("| server | prompt+output x requests | ok | output tok/s (client) | most running (log) |")
        print("| median gen tok/s (log) | roofline tok/s at that batch | wall s |")
        print("|---|---|---|---|---|---|---|---|")
        print("\n".join(rows))
    for f in sorted(d.glob("datagen-*.json")):
        doc = load(f) or {}
        print(f"\n{f.name}:")
        for name, step in doc.get("steps", {}).items():
            text = json.dumps(step, default=str)
            print(f"- {name}: {text[:700]}")


if __name__ == "__main__":
    main()
