"""bench.py: a throughput baseline against one SGLang server (standard library only).

Sends N /generate requests at once (one thread each), each `prompt_len` random token ids (no shared prefix)
with sampling_params {max_new_tokens, ignore_eos: true}, so every request generates exactly max_new_tokens.
While they run it reads /metrics every 0.5 s (sglang:num_running_reqs, num_queue_reqs, gen_throughput,
token_usage; the server needs --enable-metrics). Afterwards it reads the server's own "Decode batch" log lines
written during the run (#running-req, token usage, gen throughput). Output tokens/s = completion tokens of all
requests / wall time from the first send to the last answer.

  python3 bench.py http://127.0.0.1:30000 --requests 256 --prompt-len 200 --max-new 256 --vocab 248320
trial.py imports `run` and stores its result in NAME.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import re
import statistics
import threading
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path


def _post(url: str, body: dict, timeout: float, headers: dict | None = None) -> tuple[float, dict | None, str | None]:
    t = time.monotonic()
    h = {"Content-Type": "application/json", **(headers or {})}
    req = urllib.request.Request(url, json.dumps(body).encode(), h, method="POST")
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return time.monotonic() - t, json.loads(r.read()), None
    except Exception as e:
        return time.monotonic() - t, None, repr(e)[:300]


_METRICS = ("num_running_reqs", "num_queue_reqs", "gen_throughput", "token_usage", "num_used_tokens")


def _metrics(base: str) -> dict:
    try:
        with urllib.request.urlopen(base + "/metrics", timeout=5) as r:
            text = r.read().decode()
    except Exception:
        return {}
    out = {}
    for line in text.splitlines():
        if line.startswith("sglang:"):
            for m in _METRICS:
                if line.startswith(f"sglang:{m}{{") or line.startswith(f"sglang:{m} "):
                    with contextlib.suppress(ValueError):
                        out[m] = float(line.rsplit(" ", 1)[1])
    return out


def run(
    base: str,
    requests: int,
    prompt_len: int,
    max_new: int,
    vocab: int,
    timeout: float = 500.0,
    log: Path | None = None,
    seed: int = 0,
    headers: dict | None = None,
) -> dict:
    rng = random.Random(seed)
    bodies = [
        {
            "input_ids": [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)],
            "sampling_params": {"max_new_tokens": max_new, "ignore_eos": True},
        }
        for _ in range(requests)
    ]
    log_start = log.stat().st_size if log is not None and log.exists() else 0
    samples: list[dict] = []
    stop = threading.Event()

    def poll() -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            m = _metrics(base)
            if m:
                m["t"] = round(time.monotonic() - t0, 2)
                samples.append(m)
            stop.wait(0.5)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    t0 = time.monotonic()
    with ThreadPoolExecutor(max_workers=requests) as ex:
        results = list(ex.map(lambda b: _post(base + "/generate", b, timeout, headers), bodies))
    wall = time.monotonic() - t0
    stop.set()
    poller.join(timeout=5)
    ok = [r for r in results if r[1] is not None]
    errors = [r[2] for r in results if r[1] is None]
    completion = sum(int(r[1].get("meta_info", {}).get("completion_tokens", 0)) for r in ok)
    prompt = sum(int(r[1].get("meta_info", {}).get("prompt_tokens", 0)) for r in ok)
    lat = sorted(r[0] for r in ok)
    decode_lines = []
    if log is not None and log.exists():
        with open(log, "rb") as f:
            f.seek(log_start)
            for line in f.read().decode(errors="replace").splitlines():
                if "Decode batch" in line or "Prefill batch" in line:
                    decode_lines.append(line[-400:])
    running = [int(x) for ln in decode_lines if "Decode batch" in ln for x in re.findall(r"#running-req: (\d+)", ln)]
    gen_tp = [float(x) for ln in decode_lines for x in re.findall(r"gen throughput \(token/s\): ([0-9.]+)", ln)]
    return {
        "requests": requests,
        "ok": len(ok),
        "errors": errors[:5],
        "prompt_len": prompt_len,
        "max_new_tokens": max_new,
        "wall_seconds": round(wall, 3),
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "output_tokens_per_s": round(completion / wall, 1) if wall > 0 else None,
        "total_tokens_per_s": round((completion + prompt) / wall, 1) if wall > 0 else None,
        "latency_s_p50": round(statistics.median(lat), 3) if lat else None,
        "latency_s_max": round(lat[-1], 3) if lat else None,
        "latency_s_min": round(lat[0], 3) if lat else None,
        "metrics_max_running_reqs": max((s.get("num_running_reqs", 0) for s in samples), default=None),
        "metrics_max_gen_throughput": max((s.get("gen_throughput", 0) for s in samples), default=None),
        "log_max_running_req": max(running, default=None),
        "log_max_gen_throughput": max(gen_tp, default=None),
        "log_median_gen_throughput": round(statistics.median(gen_tp), 1) if gen_tp else None,
        "metrics_samples": samples,
        "log_batch_lines": decode_lines[:200],
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("base")
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--vocab", type=int, default=248320)
    p.add_argument("--log", type=Path)
    a = p.parse_args()
    print(json.dumps(run(a.base, a.requests, a.prompt_len, a.max_new, a.vocab, log=a.log), indent=1))


if __name__ == "__main__":
    main()
