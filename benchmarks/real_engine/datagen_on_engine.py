"""datagen_on_engine.py: datagen's own launcher, client and dispatcher against one server (issue 37, item 2).

On the lent GPU machine the server is a real SGLang 0.5.17 (`--engine sglang`, DATAGEN_ENGINE_PYTHON =
sglang-python.sh); here the same script runs against the stand-in (`--engine standin`) as its rehearsal, and
the two JSON files are compared key by key (compare.py). Steps, each recorded in OUT/datagen-ENGINE.json as soon
as it ends:

  launch    ServerFleet with a memory plan for --plan-context-token requests, computed from datagen's own GPU
            probe (the probe's free memory, the plan's 0.5.23 reservations): the launcher's argv (key masked),
            key file mode, server environment names, health wait, then the pool check (relaunch recalibrated
            when the engine's pools are short), the final plan and the logged pools
  control   /health, /server_info (redacted keys), effective_max_running, /v1/loads, /metrics names
  generate  SGLangClient.generate: output_ids, finish reasons (length; stop where one comes), token counts
  cancel    a long request cancelled by the client: does the server abort it (/v1/loads running back to 0)?
  dispatch  the Dispatcher over the fleet: N requests of PROMPT tokens, output tokens/s as the client sees them
  hang      the server's process group stopped (SIGSTOP) with requests in flight: the hang detector marks it
            down; SIGCONT: it comes back and the requests finish (on_server_down only records, never restarts)
  stop      fleet.stop(): processes gone

  python3 datagen_on_engine.py --engine sglang --model /tmp/sgl/model --out $OUT --work /tmp/dg/work
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import signal
import stat
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import httpx
from pydantic import SecretStr

from datagen.checks.gpu import run_probe
from datagen.engine.client import SGLangClient
from datagen.engine.dispatcher import Dispatcher, GenerateJob
from datagen.engine.endpoints import ServerEndpoint
from datagen.engine.launcher import ServerFleet, mask_command
from datagen.engine.memory_plan import GpuMemory, ModelShape, card_bandwidth, plan_memory
from datagen.layout import RunLayout
from datagen.runspec import RunSpec, SamplingSpec
from datagen.settings import Settings

WEIGHTS_ESTIMATE = 54_714_000_000
KEY = SecretStr("k" + "realengine" * 3)


def until() -> float:
    return float(os.environ.get("SGL_UNTIL", "0")) or time.time() + 10**6


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.doc: dict[str, Any] = {"steps": {}}

    def step(self, name: str, fn: Callable[[], dict[str, Any]], need_s: float = 20.0) -> dict[str, Any] | None:
        if until() - time.time() < need_s:
            self.doc["steps"][name] = {"skipped": f"{until() - time.time():.0f} s left, {need_s:.0f} s needed"}
            self.save()
            return None
        t0 = time.monotonic()
        try:
            result = fn()
            result["seconds"] = round(time.monotonic() - t0, 2)
        except Exception as exc:  # the record is the point: what failed, and how
            result = {"error": f"{type(exc).__name__}: {exc}"[:3000], "seconds": round(time.monotonic() - t0, 2)}
        self.doc["steps"][name] = result
        self.save()
        print(f"[{name}] {json.dumps(result, default=str)[:600]}", flush=True)
        return result

    def save(self) -> None:
        self.path.write_text(json.dumps(self.doc, indent=1, default=str))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--engine", choices=("sglang", "standin"), required=True)
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--plan-context", type=int, default=4096)
    p.add_argument("--prompt-len", type=int, default=3840)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--requests", type=int, default=24)
    p.add_argument("--hang-timeout", type=float, default=15.0)
    p.add_argument("--start-timeout", type=float, default=420.0)
    p.add_argument("--attach", help="URL of a server started elsewhere (attach mode: no launch, no pool check)")
    p.add_argument("--attach-pgid", type=int, help="its process group, for the hang step")
    p.add_argument("--tag", default="", help="suffix of the result file's name")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    rec = Recorder(a.out / f"datagen-{a.engine}{a.tag}.json")
    os.environ.setdefault("DATAGEN_MODEL_ROOTS", str(a.model.parent))
    settings = Settings(
        engine=a.engine,
        engine_python=os.environ.get("DATAGEN_ENGINE_PYTHON", sys.executable),
        num_servers=1,
        base_port=0,
        server_start_timeout_s=a.start_timeout,
        work_dir=a.work,
        sglang_api_key=KEY,
        server_hang_timeout_s=a.hang_timeout,
        allowed_compute_capabilities=["9.0"],
        server_urls=[a.attach] if a.attach else [],
    )
    server_args = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--enable-metrics"]
    server_args += ["--skip-server-warmup"]
    spec = RunSpec(
        model_path=str(a.model),
        context_length=a.context_length,
        sampling=SamplingSpec(max_new_tokens=a.max_new),
        server_args=server_args,
        turns="last",
    )
    config = json.loads((a.model / "config.json").read_text())
    vocab = int(config.get("text_config", config).get("vocab_size", 248320))
    model = ModelShape.from_config(config)
    layout = RunLayout.for_run(settings.work_dir, "realengine")
    state: dict[str, Any] = {}

    def probe() -> dict[str, Any]:
        if a.engine == "standin":
            total = 81_559 * 2**20
            gpu = {"name": "stand-in (emulated H100)", "total_memory_bytes": total, "free_memory_bytes": total}
            doc: dict[str, Any] = {"devices": [gpu]}
        else:
            doc = run_probe(settings.engine_python)
        state["probe"] = doc
        return {"probe": doc}

    if a.attach:
        state["probe"] = {"devices": [{"name": "attached", "total_memory_bytes": 1, "free_memory_bytes": 1}]}
    else:
        rec.step("probe", probe, 30)
    devices = state.get("probe", {}).get("devices") or []
    if not devices:
        return 1
    dev = devices[0]
    free = dev.get("free_memory_bytes") or dev["total_memory_bytes"]
    gpu = GpuMemory(dev["total_memory_bytes"], free, WEIGHTS_ESTIMATE, card_bandwidth(str(dev.get("name", ""))))
    plan = (
        plan_memory(model, gpu, a.plan_context, context_source=f"{a.plan_context} tokens a request")
        if not a.attach
        else None
    )
    fleet = ServerFleet(settings, spec, layout, KEY, memory_plan=plan)

    def launch() -> dict[str, Any]:
        server = fleet._servers[0]
        t0 = time.monotonic()
        fleet.start()
        if plan is None:
            return {
                "attached": a.attach,
                "health_wait_seconds": round(time.monotonic() - t0, 1),
                "engine_version": fleet.engine_version,
                "endpoint_max_running": fleet.endpoints[0].max_running_requests if fleet.endpoints else None,
            }
        log = (layout.logs_dir / "server-0.log").read_text(errors="replace")
        final = fleet.memory_plan
        key_file = fleet._key_config
        return {
            "argv_masked": mask_command(server.argv),
            "key_in_argv": KEY.get_secret_value() in " ".join(server.argv),
            "key_in_log": KEY.get_secret_value() in log,
            "key_file_mode": oct(stat.S_IMODE(key_file.stat().st_mode)) if key_file.exists() else None,
            "env_names": sorted(server.env),
            "start_seconds": round(time.monotonic() - t0, 1),
            "plan_first": {"args": plan.plan_args, "launched": asdict(plan.launched) if plan.launched else None},
            "plan_final": {
                "args": final.plan_args if final else None,
                "launched": asdict(final.launched) if final and final.launched else None,
                "reasons": final.reasons if final else None,
            },
            "relaunched": "relaunching (recalibrated memory plan)" in log,
            "logged_pools": asdict(server.pools) if server.pools else None,
            "engine_version": fleet.engine_version,
            "endpoint_max_running": fleet.endpoints[0].max_running_requests if fleet.endpoints else None,
        }

    launched = rec.step("launch", launch, 60)
    try:
        if not launched or "error" in launched:
            return 1
        endpoint = fleet.endpoints[0]
        rec.step("control", lambda: asyncio.run(control(endpoint)))
        rec.step("generate", lambda: asyncio.run(generate(endpoint, vocab)))
        rec.step("cancel", lambda: asyncio.run(cancel(endpoint, vocab)), 40)
        need = 30 + a.requests * a.max_new / 150  # at least 150 output tok/s (the defaults gave 114-186 on the H100)
        rec.step("bench_raw", lambda: bench_raw(endpoint, a, vocab), need)
        rec.step("dispatch", lambda: dispatch(fleet, settings, a, vocab), need)
        pgid = a.attach_pgid or fleet.pids().get(endpoint.name)
        if pgid:
            rec.step("hang", lambda: hang(pgid, fleet, endpoint, a, vocab), a.hang_timeout * 3 + 40)
    finally:
        pids = fleet.pids()
        rec.step("stop", lambda: stop(fleet, pids), 0)
    return 0


async def control(endpoint: ServerEndpoint) -> dict[str, Any]:
    async with SGLangClient(endpoint) as client:
        info = await client.server_info()
        loads = await client.loads()
        async with httpx.AsyncClient(base_url=endpoint.url) as http:
            metrics = (await http.get("/metrics")).text
            no_key = (await http.get("/server_info")).status_code
        names = sorted({ln.split("{")[0].split(" ")[0] for ln in metrics.splitlines() if ln.startswith("sglang:")})
        return {
            "health": await client.health(),
            "server_info_keys": sorted(info),
            "server_info_api_key_masked": "realengine" not in json.dumps(info),
            "effective_max_running": await client.effective_max_running(),
            "loads": {k: v for k, v in asdict(loads).items() if k != "raw"},
            "loads_raw": loads.raw,
            "metrics_names": names,
            "server_info_without_key_status": no_key,
        }


async def generate(endpoint: ServerEndpoint, vocab: int) -> dict[str, Any]:
    rng = random.Random(1)
    out = []
    async with SGLangClient(endpoint) as client:
        for max_new in (1, 16, 64):
            ids = [rng.randrange(1000, vocab - 1000) for _ in range(32)]
            sampling = {"max_new_tokens": max_new, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
            r = await client.generate(ids, sampling, timeout_s=120)
            out.append(
                {
                    "max_new_tokens": max_new,
                    "finish_reason": r.finish_reason,
                    "finish_detail": r.finish_detail,
                    "completion_tokens": r.completion_tokens,
                    "output_ids_n": len(r.output_ids),
                    "prompt_tokens": r.prompt_tokens,
                    "text_chars": len(r.text),
                    "e2e_latency": r.e2e_latency,
                    "latency_s": round(r.latency_s, 3),
                }
            )
    return {"results": out}


async def cancel(endpoint: ServerEndpoint, vocab: int) -> dict[str, Any]:
    rng = random.Random(2)
    ids = [rng.randrange(1000, vocab - 1000) for _ in range(64)]
    sampling = {"max_new_tokens": 4000, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
    async with SGLangClient(endpoint) as client, SGLangClient(endpoint) as watcher:
        task = asyncio.create_task(client.generate(ids, sampling, timeout_s=300))
        running_before = 0
        for _ in range(40):
            await asyncio.sleep(0.25)
            running_before = (await watcher.loads()).num_running_reqs
            if running_before:
                break
        task.cancel()
        cancelled_at = time.monotonic()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        freed_after = None
        for _ in range(120):
            if (await watcher.loads()).num_running_reqs == 0:
                freed_after = round(time.monotonic() - cancelled_at, 2)
                break
            await asyncio.sleep(0.25)
    return {"running_before_cancel": running_before, "running_zero_after_s": freed_after}


def bench_raw(endpoint: ServerEndpoint, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    """The same workload as `dispatch`, sent by bench.py (one thread a request, ignore_eos): the bound to compare."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    headers = {"Authorization": f"Bearer {KEY.get_secret_value()}"}
    left = max(30.0, until() - time.time() - 20)
    r: dict[str, Any] = bench.run(endpoint.url, a.requests, a.prompt_len, a.max_new, vocab, left, None, 3, headers)
    r.pop("log_batch_lines", None)
    r.pop("metrics_samples", None)
    return r


def dispatch(fleet: ServerFleet, settings: Settings, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(3)
    sampling = {"max_new_tokens": a.max_new, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
    jobs = [
        GenerateJob([rng.randrange(1000, vocab - 1000) for _ in range(a.prompt_len)], sampling, label=f"j{i}")
        for i in range(a.requests)
    ]
    with Dispatcher(fleet.endpoints, hang_timeout_s=settings.server_hang_timeout_s) as d:
        d.wait_ready(60)
        t0 = time.monotonic()
        futures = [d.submit(j) for j in jobs]
        results = [f.result(timeout=max(30.0, until() - time.time() - 20)) for f in futures]
        wall = time.monotonic() - t0
        stats = d.stats()
    completion = sum(r.completion_tokens for r in results)
    reasons: dict[str, int] = {}
    for r in results:
        reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
    return {
        "requests": len(results),
        "prompt_len": a.prompt_len,
        "max_new_tokens": a.max_new,
        "completion_tokens": completion,
        "wall_seconds": round(wall, 2),
        "output_tokens_per_s": round(completion / wall, 1),
        "finish_reasons": reasons,
        "stats": {k: v for k, v in asdict(stats).items() if k != "servers"},
    }


def hang(pgid: int, fleet: ServerFleet, endpoint: ServerEndpoint, a: argparse.Namespace, vocab: int) -> dict[str, Any]:
    rng = random.Random(4)
    # Long enough to be in flight when the server stops (1024 decode steps: ~22 s on the lent H100).
    sampling = {"max_new_tokens": 1024, "temperature": 1.0, "top_p": 0.95, "top_k": 20}
    downs: list[float] = []
    t0 = time.monotonic()
    with Dispatcher(
        fleet.endpoints, on_server_down=lambda _s: downs.append(time.monotonic() - t0), hang_timeout_s=a.hang_timeout
    ) as d:
        d.wait_ready(60)
        futures = [
            d.submit(GenerateJob([rng.randrange(1000, vocab - 1000) for _ in range(64)], sampling)) for _ in "xxxx"
        ]
        time.sleep(2.0)
        os.killpg(pgid, signal.SIGSTOP)
        stopped_at = time.monotonic() - t0
        deadline = time.monotonic() + a.hang_timeout * 2 + 10
        while not downs and time.monotonic() < deadline:
            time.sleep(0.2)
        os.killpg(pgid, signal.SIGCONT)
        resumed_at = time.monotonic() - t0
        results = [f.result(timeout=max(30.0, until() - time.time() - 15)) for f in futures]
        finished_at = time.monotonic() - t0
    return {
        "stopped_at_s": round(stopped_at, 2),
        "marked_down_at_s": [round(x, 2) for x in downs],
        "detected_after_s": round(downs[0] - stopped_at, 2) if downs else None,
        "resumed_at_s": round(resumed_at, 2),
        "all_finished_at_s": round(finished_at, 2),
        "finish_reasons": sorted({r.finish_reason for r in results}),
    }


def stop(fleet: ServerFleet, pids: dict[str, int]) -> dict[str, Any]:
    fleet.stop()
    alive = {}
    for name, pid in pids.items():
        try:
            os.killpg(pid, 0)
            alive[name] = True
        except ProcessLookupError:
            alive[name] = False
    return {"pids": pids, "group_alive_after_stop": alive}


if __name__ == "__main__":
    sys.exit(main())
