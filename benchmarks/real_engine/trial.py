"""trial.py: start one real SGLang server on the lent GPU machine, ask each endpoint the project uses, optionally
run bench.py against it, stop it. Standard library only; device_run.sh calls it (PYTHONPATH = the unpacked site).

The server runs the model folder's config with random weights (--load-format dummy) and the backends the
trimmed sglang-kernel supports on Hopper (triton attention and vision attention, pytorch sampling). It writes:
  OUT/NAME.log   the server's whole log (server_args=ServerArgs(...), memory pool lines, CUDA graph capture)
  OUT/NAME.json  startup figures read from that log, each probe's status/time/answer, the benchmark's result

Arguments: --name, --layers N (a copy of the model folder with num_hidden_layers N), --context-length,
--extra "FLAGS" (more launch flags, e.g. the memory plan's), --bench N (requests; 0: none), --prompt-len,
--max-new, --ready-timeout S. The environment's SGL_UNTIL (epoch seconds) bounds the whole trial.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

HERE = Path(__file__).resolve().parent
SERVED_NAME = "qwen3.6-27b"
# Lines of the startup log that carry the sizing and the timing.
KEYS = (
    "server_args=ServerArgs(",
    "KV Cache",
    "Mamba",
    "mamba",
    "max_total_num_tokens",
    "max_running_requests",
    "context_len",
    "avail mem",
    "Load weight",
    "Capture",
    "capture",
    "memory pool",
    "ready to roll",
    "Error",
    "error",
    "Traceback",
    "Warning",
)


def now() -> float:
    return time.monotonic()


def http(method: str, url: str, body: dict | None = None, timeout: float = 120.0) -> dict:
    """One request: status, seconds, and the answer (JSON when it parses, else text), never raising."""
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    t = now()
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as e:
        raw, status = e.read(), e.code
    except Exception as e:  # connection refused, timeout
        return {"status": None, "seconds": round(now() - t, 3), "error": repr(e)}
    text = raw.decode("utf-8", "replace")
    try:
        answer = json.loads(text)
    except ValueError:
        answer = text[:2000]
    return {"status": status, "seconds": round(now() - t, 3), "answer": answer}


def model_copy(model: Path, layers: int | None, work: Path) -> Path:
    """The model folder itself, or a copy whose config has `layers` hidden layers."""
    if not layers:
        return model
    dst = work / f"model-{layers}l"
    if dst.exists():
        shutil.rmtree(dst)
    shutil.copytree(model, dst)
    cfg = json.loads((dst / "config.json").read_text())
    target = cfg.get("text_config", cfg)
    target["num_hidden_layers"] = layers
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def startup_lines(log: Path) -> list[str]:
    out = []
    for line in log.read_text(errors="replace").splitlines():
        if any(k in line for k in KEYS):
            out.append(line[:6000])
    return out[:400]


def parse_figures(log: Path) -> dict:
    """The sizing figures SGLang prints, by regular expression over its log (missing ones left out)."""
    text = log.read_text(errors="replace")
    figs: dict = {}
    patterns = {
        "max_total_num_tokens": r"max_total_num_tokens=(\d+)",
        "max_running_requests": r"max_running_requests=(\d+)",
        "context_len": r"context_len=(\d+)",
        "max_prefill_tokens": r"max_prefill_tokens=(\d+)",
        "chunked_prefill_size": r"chunked_prefill_size=(\d+)",
        "mem_fraction_static": r"mem_fraction_static=([0-9.]+)",
        "cuda_graph_max_bs": r"cuda_graph_max_bs(?:_decode)?=(\d+)",
        "max_mamba_cache_size": r"max_mamba_cache_size=(\w+)",
        "disable_radix_cache": r"disable_radix_cache=(\w+)",
        "mamba_radix_cache_strategy": r"mamba_radix_cache_strategy='?(\w+)",
        "attention_backend": r"attention_backend='?(\w+)",
    }
    for key, pat in patterns.items():
        m = re.findall(pat, text)
        if m:
            figs[key] = m if len(set(m)) > 1 else m[0]
    avail = re.findall(r"avail mem=([0-9.]+) GB", text)
    if avail:
        figs["avail_mem_gb_sequence"] = [float(a) for a in avail]
    return figs


def probes(base: str, vocab: int) -> dict:
    ids = list(range(1000, 1016))
    gen = {"max_new_tokens": 16, "ignore_eos": True}
    return {
        "health": http("GET", base + "/health"),
        "get_model_info": http("GET", base + "/get_model_info"),
        "model_info": http("GET", base + "/model_info"),
        "v1_models": http("GET", base + "/v1/models"),
        "generate_input_ids": http("POST", base + "/generate", {"input_ids": ids, "sampling_params": gen}),
        "generate_text": http("POST", base + "/generate", {"text": "The capital of France is", "sampling_params": gen}),
        "chat_completions": http(
            "POST",
            base + "/v1/chat/completions",
            {
                "model": SERVED_NAME,
                "messages": [{"role": "user", "content": "Explain held-out topic 1 in one paragraph."}],
                "max_tokens": 32,
                "temperature": 0.7,
            },
        ),
        "get_server_info": http("GET", base + "/get_server_info"),
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--site", required=True)
    p.add_argument("--model", required=True, type=Path)
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--name", required=True)
    p.add_argument("--layers", type=int)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--extra", default="")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--ready-timeout", type=float, default=480)
    p.add_argument("--bench", type=int, default=0)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--max-new", type=int, default=256)
    a = p.parse_args()
    until = float(os.environ.get("SGL_UNTIL", "0")) or time.time() + 10**6
    a.out.mkdir(parents=True, exist_ok=True)
    model = model_copy(a.model, a.layers, Path("/tmp/sgl"))
    vocab = json.loads((model / "config.json").read_text()).get("vocab_size", 151936)
    log = a.out / f"{a.name}.log"
    cmd = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(model),
        "--served-model-name",
        SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(a.port),
        "--tp-size",
        "1",
        "--reasoning-parser",
        "qwen3",
        "--context-length",
        str(a.context_length),
        "--load-format",
        "dummy",
        "--attention-backend",
        "triton",
        "--mm-attention-backend",
        "triton_attn",
        "--sampling-backend",
        "pytorch",
        "--enable-metrics",
        "--log-level",
        "info",
        # The start-up warmup of 0.5.17 sends a chat request with an image to a multimodal model; with the fixture it
        # fails (IndexError in qwen_vl.py _compute_image_only_mrope_positions_from_offsets) and the server exits.
        "--skip-server-warmup",
        *shlex.split(a.extra),
    ]
    result: dict = {"name": a.name, "command": cmd, "model": str(model)}
    print(f"[{a.name}] {' '.join(cmd)}", flush=True)
    t0 = now()
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True)
    ready = False
    deadline = min(t0 + a.ready_timeout, now() + (until - time.time()))
    while now() < deadline:
        if proc.poll() is not None:
            break
        if "ready to roll" in log.read_text(errors="replace"):
            ready = True
            break
        time.sleep(1.0)
    result["ready"] = ready
    result["startup_seconds"] = round(now() - t0, 1)
    print(f"[{a.name}] ready={ready} after {result['startup_seconds']} s (exit code {proc.poll()})", flush=True)
    base = f"http://127.0.0.1:{a.port}"
    try:
        if ready:
            result["probes"] = probes(base, vocab)
            for k, v in result["probes"].items():
                print(f"[{a.name}] {k}: {v.get('status')} in {v.get('seconds')} s", flush=True)
            if a.bench:
                sys.path.insert(0, str(HERE))
                import bench

                left = until - time.time() - 20
                result["bench"] = bench.run(
                    base, a.bench, a.prompt_len, a.max_new, vocab, timeout=max(30.0, left), log=log
                )
                b = result["bench"]
                print(f"[{a.name}] bench: {json.dumps({k: b[k] for k in b if not isinstance(b[k], list)})}", flush=True)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=10)
        result["exit_code"] = proc.returncode
        result["figures"] = parse_figures(log)
        result["startup_lines"] = startup_lines(log)
        (a.out / f"{a.name}.json").write_text(json.dumps(result, indent=1))
        print(f"[{a.name}] figures: {json.dumps(result['figures'])}", flush=True)
        if not ready:
            print("".join(log.read_text(errors="replace").splitlines(True)[-60:]), flush=True)
    return 0 if ready else 1


if __name__ == "__main__":
    sys.exit(main())
