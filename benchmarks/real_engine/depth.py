"""depth.py: datagen's Dispatcher at queue_depth 4, 2 and 1 against one real SGLang server (lent GPU machine).

The dispatcher keeps at most (running capacity + queue_depth) requests at a server and holds the rest in its own
plan-ordered queue. A shallower queue shortens how long a conversation's next step waits in the server's FIFO queue;
the risk is running slots left idle between a request finishing and the dispatcher's next one arriving. One server
(engine_trial.py's start: random weights, metrics, `--disable-radix-cache --max-running-requests 32`), then the
runs of --order, each with a fresh `Dispatcher(queue_depth=D)` over HTTP (datagen's own client and transport, with
`ignore_eos` added to each /generate so every request makes exactly its max_new_tokens):

  single   N independent requests (random prompt ids), all submitted up front (one submitter thread; `submit`
           blocks while the dispatcher's queue is full, as a shard worker's does)
  chains   C conversations of 1..S steps; a step is submitted as soon as its conversation's previous step has
           come back; its prompt is the previous prompt + a few new random ids

Every run draws the same prompts and max_new_tokens (seeded; uniform MIN..MAX) whatever the depth. Each run's
wall (first submit to last answer), output tokens, output tok/s, per-request latency (submit to answer) and the
server's running / queued requests (/metrics every 0.5 s, and its "Decode batch" log lines) go to OUT/depth.json
as soon as the run ends. A run that the time left (SGL_UNTIL) cannot hold is skipped; the server is stopped at the
end however it goes.

  python3 depth.py --model /tmp/sgl/model --out $OUT
"""

from __future__ import annotations

import argparse
import concurrent.futures
import functools
import json
import queue
import random
import re
import statistics
import sys
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (beside this file)
import engine_trial  # noqa: E402

from datagen.engine.client import GenerateResult, SGLangClient  # noqa: E402
from datagen.engine.dispatcher import Dispatcher, GenerateJob, SubmitTimeout  # noqa: E402
from datagen.engine.endpoints import ServerEndpoint  # noqa: E402
from datagen.engine.memory_plan import LoggedPools  # noqa: E402
from datagen.engine.transport import H11PoolTransport  # noqa: E402

SAMPLING = {"temperature": 1.0, "top_p": 0.95, "top_k": 20}
STOP_S = 30.0  # the server's stop (SIGTERM, up to 20 s) and the last write, kept out of the runs' time


class IgnoreEos(httpx.AsyncBaseTransport):
    """datagen's transport with `ignore_eos: true` added to each /generate (its client sends only SAMPLING_KEYS)."""

    def __init__(self, inner: httpx.AsyncBaseTransport) -> None:
        self._inner = inner

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if request.method == "POST" and request.url.path == "/generate":
            body = json.loads(await request.aread())
            body["sampling_params"]["ignore_eos"] = True
            headers = [(k, v) for k, v in request.headers.multi_items() if k.lower() != "content-length"]
            request = httpx.Request(
                "POST", request.url, headers=headers, content=json.dumps(body).encode(), extensions=request.extensions
            )
        return await self._inner.handle_async_request(request)

    async def aclose(self) -> None:
        await self._inner.aclose()


def client_factory(endpoint: ServerEndpoint) -> SGLangClient:
    return SGLangClient(endpoint, max_connections=1024, transport=IgnoreEos(H11PoolTransport(1024)))


@dataclass(frozen=True, slots=True)
class Step:
    """One request of a workload: conversation index (its own index for `single`), step number, prompt, output."""

    conv: int
    step: int
    input_ids: list[int]
    max_new: int


def single_workload(n: int, prompt_len: int, out_min: int, out_max: int, vocab: int, seed: int) -> list[list[Step]]:
    """N one-step "conversations": all ready at once."""
    rng = random.Random(seed)
    return [
        [Step(i, 0, [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)], rng.randint(out_min, out_max))]
        for i in range(n)
    ]


def chain_workload(
    n: int, max_steps: int, prompt_len: int, step_new: int, out_min: int, out_max: int, vocab: int, seed: int
) -> list[list[Step]]:
    """N conversations of 1..max_steps steps; each step's prompt extends the previous one by `step_new` ids."""
    rng = random.Random(seed)
    convs = []
    for c in range(n):
        ids = [rng.randrange(1000, vocab - 1000) for _ in range(prompt_len)]
        steps = []
        for k in range(rng.randint(1, max_steps)):
            if k:
                ids = ids + [rng.randrange(1000, vocab - 1000) for _ in range(step_new)]
            steps.append(Step(c, k, ids, rng.randint(out_min, out_max)))
        convs.append(steps)
    return convs


class Sampler:
    """The server's /metrics every 0.5 s while a run goes (bench.py's reader)."""

    def __init__(self, base: str) -> None:
        self.base = base
        self.samples: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(timeout=10)

    def _poll(self) -> None:
        t0 = time.monotonic()
        while not self._stop.is_set():
            m = bench._metrics(self.base)
            if m:
                m["t"] = round(time.monotonic() - t0, 2)
                self.samples.append(m)
            self._stop.wait(0.5)


def log_batches(log: Path, start: int) -> dict[str, Any]:
    """The server's "Decode batch" lines written since byte `start`: #running-req, #queue-req, gen throughput."""
    with open(log, "rb") as f:
        f.seek(start)
        lines = [ln for ln in f.read().decode(errors="replace").splitlines() if "Decode batch" in ln]
    running = [int(x) for ln in lines for x in re.findall(r"#running-req: (\d+)", ln)]
    queued = [int(x) for ln in lines for x in re.findall(r"#queue-req: (\d+)", ln)]
    gen = [float(x) for ln in lines for x in re.findall(r"gen throughput \(token/s\): ([0-9.]+)", ln)]
    return {
        "decode_lines": len(lines),
        "mean_running": round(statistics.fmean(running), 2) if running else None,
        "mean_queued": round(statistics.fmean(queued), 2) if queued else None,
        "median_gen_throughput": round(statistics.median(gen), 1) if gen else None,
    }


def run_once(
    base: str, log: Path, workload: str, convs: list[list[Step]], depth: int, deadline: float
) -> dict[str, Any]:
    """One Dispatcher at `depth` over the workload; steps submitted as soon as they are ready."""
    endpoint = ServerEndpoint(name="server-0", url=base, log_path=str(log))
    ready: queue.Queue[Step | None] = queue.Queue()
    results: list[tuple[Step, float, GenerateResult | None, str]] = []
    lock = threading.Lock()
    left = [sum(len(c) for c in convs)]
    log_start = log.stat().st_size
    with Dispatcher([endpoint], queue_depth=depth, client_factory=client_factory, hang_timeout_s=60.0) as d:
        if not d.wait_ready(60):
            return {"error": "server not up for the dispatcher"}
        limit = d.queue_limit

        def done(step: Step, sent: float, fut: concurrent.futures.Future[GenerateResult]) -> None:
            # On the dispatcher's loop thread: never block here; the submitter thread sends the next step.
            exc = fut.exception()
            with lock:
                results.append((step, time.monotonic() - sent, None if exc else fut.result(), repr(exc) if exc else ""))
                left[0] -= 1
                finished = left[0] == 0
            if exc is None and step.step + 1 < len(convs[step.conv]):
                ready.put(convs[step.conv][step.step + 1])
            elif finished:
                ready.put(None)
            elif exc is not None:  # the conversation's remaining steps will not run
                with lock:
                    left[0] -= len(convs[step.conv]) - step.step - 1
                    if left[0] == 0:
                        ready.put(None)

        for conv in convs:
            ready.put(conv[0])
        with Sampler(base) as sampler:
            t0 = time.monotonic()
            timed_out = False
            while True:
                try:
                    item = ready.get(timeout=max(0.1, deadline - time.time()))
                except queue.Empty:
                    timed_out = True
                    break
                if item is None:
                    break
                job = GenerateJob(
                    item.input_ids,
                    {"max_new_tokens": item.max_new, **SAMPLING},
                    label=f"c{item.conv}s{item.step}",
                    order=(item.conv, item.step),
                    affinity=f"c{item.conv}" if workload == "chains" else "",
                )
                sent = time.monotonic()
                try:
                    fut = d.submit(job, timeout=max(1.0, deadline - time.time()))
                except SubmitTimeout:
                    timed_out = True
                    break
                fut.add_done_callback(functools.partial(done, item, sent))
            wall = time.monotonic() - t0
        stats = d.stats()
    ok = [r for r in results if r[2] is not None]
    completion = sum(r[2].completion_tokens for r in ok if r[2] is not None)
    lat = sorted(r[1] for r in ok)
    reasons: dict[str, int] = {}
    for _, _, res, _ in ok:
        if res is not None:
            reasons[res.finish_reason] = reasons.get(res.finish_reason, 0) + 1
    running = [s["num_running_reqs"] for s in sampler.samples if "num_running_reqs" in s]
    queued = [s["num_queue_reqs"] for s in sampler.samples if "num_queue_reqs" in s]
    return {
        "workload": workload,
        "depth": depth,
        "queue_limit": limit,
        "requests": sum(len(c) for c in convs),
        "ok": len(ok),
        "errors": sorted({r[3] for r in results if r[3]})[:3],
        "timed_out": timed_out,
        "wall_seconds": round(wall, 2),
        "output_tokens": completion,
        "expected_output_tokens": sum(s.max_new for c in convs for s in c),
        "output_tokens_per_s": round(completion / wall, 1) if wall > 0 else None,
        "finish_reasons": reasons,
        "latency_s_mean": round(statistics.fmean(lat), 2) if lat else None,
        "latency_s_p50": round(statistics.median(lat), 2) if lat else None,
        "latency_s_p90": round(lat[int(0.9 * (len(lat) - 1))], 2) if lat else None,
        "metrics_samples": len(running),
        "metrics_mean_running": round(statistics.fmean(running), 2) if running else None,
        "metrics_mean_queued": round(statistics.fmean(queued), 2) if queued else None,
        "log": log_batches(log, log_start),
        "dispatcher": {k: v for k, v in asdict(stats).items() if k != "servers"},
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--port", type=int, default=30300)
    p.add_argument("--server-module", default="sglang.launch_server", help="datagen.standin for a rehearsal")
    p.add_argument("--max-running", type=int, default=32)
    p.add_argument(
        "--order", default="chains:4,chains:2,chains:1,single:4,single:2,single:1,chains:4,chains:2,chains:1"
    )
    p.add_argument("--singles", type=int, default=240)
    p.add_argument("--chains", type=int, default=48)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--prompt-len", type=int, default=200)
    p.add_argument("--step-new", type=int, default=8, help="new ids a chain step adds to the previous prompt")
    p.add_argument("--out-min", type=int, default=16)
    p.add_argument("--out-max", type=int, default=320)
    p.add_argument("--guess-s", type=float, default=45.0, help="a run's time before one of its workload has run")
    p.add_argument("--seed", type=int, default=50)
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    config = json.loads((a.model / "config.json").read_text())
    vocab = int(config.get("text_config", config).get("vocab_size", 248320))
    workloads = {
        "single": single_workload(a.singles, a.prompt_len, a.out_min, a.out_max, vocab, a.seed),
        "chains": chain_workload(
            a.chains, a.max_steps, a.prompt_len, a.step_new, a.out_min, a.out_max, vocab, a.seed + 1
        ),
    }
    runs = [(w, int(d)) for w, d in (x.split(":") for x in a.order.split(","))]
    doc: dict[str, Any] = {
        "args": {k: str(v) for k, v in vars(a).items()},
        "workloads": {
            w: {
                "conversations": len(c),
                "requests": sum(len(x) for x in c),
                "output_tokens": sum(s.max_new for x in c for s in x),
                "longest_prompt": max(len(s.input_ids) for x in c for s in x),
            }
            for w, c in workloads.items()
        },
        "runs": [],
    }
    path = a.out / "depth.json"

    def save() -> None:
        path.write_text(json.dumps(doc, indent=1, default=str))

    flags = ["--disable-radix-cache", "--max-running-requests", str(a.max_running)]
    if a.server_module != "sglang.launch_server":  # engine_trial.py's BASE_FLAGS (metrics among them) are SGLang's
        flags.append("--enable-metrics")
    proc, log, t0 = engine_trial.start("depth", a.model, a.out, a.context_length, flags, a.port, a.server_module)
    try:
        ready = engine_trial.wait_ready(proc, log, t0, min(engine_trial.until() - 60, time.time() + 400))
        doc["server"] = {"ready": ready, "startup_seconds": round(time.monotonic() - t0, 1), "flags": flags}
        save()
        if not ready:
            print("".join(log.read_text(errors="replace").splitlines(True)[-40:]), flush=True)
            return 1
        logged = LoggedPools.parse(log.read_text(errors="replace"))
        doc["server"]["logged"] = asdict(logged) if logged else None
        base = f"http://127.0.0.1:{a.port}"
        # Kernels for the first batch shapes compile on first use: a short unrecorded warm-up before the runs.
        warm = single_workload(a.max_running, a.prompt_len, 8, 16, vocab, a.seed + 2)
        doc["warmup"] = {"wall_seconds": run_once(base, log, "single", warm, 4, time.time() + 60)["wall_seconds"]}
        save()
        seen: dict[str, float] = {}
        for workload, depth in runs:
            need = 1.2 * seen.get(workload, a.guess_s) + 10
            left = engine_trial.until() - time.time() - STOP_S
            if left < need:
                doc["runs"].append({"workload": workload, "depth": depth, "skipped": f"{left:.0f} s left, {need:.0f}"})
                save()
                continue
            r = run_once(base, log, workload, workloads[workload], depth, time.time() + left)
            seen[workload] = max(seen.get(workload, 0.0), float(r.get("wall_seconds") or 0.0))
            doc["runs"].append(r)
            save()
            print(
                f"[{workload} d{depth}] wall {r.get('wall_seconds')} s, {r.get('output_tokens_per_s')} tok/s, "
                f"running {r.get('metrics_mean_running')} (log {r.get('log', {}).get('mean_running')}), "
                f"ok {r.get('ok')}/{r.get('requests')}",
                flush=True,
            )
    finally:
        doc.setdefault("server", {})["exit_code"] = engine_trial.stop(proc)
        save()
    return 0


if __name__ == "__main__":
    sys.exit(main())
