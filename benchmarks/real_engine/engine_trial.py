"""engine_trial.py: the memory plan and throughput against a real SGLang on the lent GPU machine (issue 37).

Runs on the device (device.sh sets PYTHONPATH: the carried SGLang site, datagen's wheels and source). Phases,
one server each, in the order given, each written to OUT/NAME.json and OUT/NAME.log as soon as it ends:

  defaults   SGLang's defaults at --context-length; its logged pools against the plan's prediction three ways
             (the probe's estimate as 0.5.23 would take it, with 0.5.17's reservations, and calibrated from
             this very log); then each --bench workload.
  plan:N     the plan for N-token requests (prompt + output), recalibrated from the defaults' log
             (`MemoryPlan.recalibrated`): its flags, its predicted pools against the ones SGLang logs, then
             the benches whose prompt + output is N.

Benches: PROMPTxOUTPUTxREQUESTS (e.g. 200x256x48): that many /generate requests of random token ids at once,
ignore_eos (bench.py). Each phase is skipped, with the reason in OUT/summary.json, when the time left
(SGL_UNTIL) cannot hold a server start and its benches.

  python3 engine_trial.py --model /tmp/sgl/model --out $OUT --phase defaults --phase plan:456 \
      --bench 200x256x48 --bench 3840x256x24
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (beside this file)
import trial  # noqa: E402

from datagen.engine.memory_plan import (  # noqa: E402
    EngineFlags,
    GpuMemory,
    LoggedPools,
    ModelShape,
    calibrated_gpu,
    card_bandwidth,
    decode_roofline,
    for_engine,
    plan_memory,
    pool_shortfall,
    sglang_sizing,
)

WEIGHTS_ESTIMATE = 54_714_000_000  # what the plan assumes for Qwen3.6-27B BF16 (no safetensors here: dummy weights)
START_S = 170.0  # a 64-layer server's start on the lent H100 (129-154 s seen), with margin
BASE_FLAGS = [
    "--load-format",
    "dummy",
    "--attention-backend",
    "triton",
    "--mm-attention-backend",
    "triton_attn",
    "--sampling-backend",
    "pytorch",
    "--enable-metrics",
    "--skip-server-warmup",
    "--log-level",
    "info",
]


def until() -> float:
    return float(os.environ.get("SGL_UNTIL", "0")) or time.time() + 10**6


def probe_gpu(fake: str | None) -> dict[str, Any]:
    """Name, total and free memory of GPU 0 (torch), as datagen's probe reads them, before any server."""
    if fake:  # a rehearsal without a GPU: NAME:TOTAL:FREE
        name, total, free = fake.rsplit(":", 2)
        return {"name": name, "total_bytes": int(total), "free_bytes": int(free)}
    import torch

    free, total = torch.cuda.mem_get_info(0)
    return {"name": torch.cuda.get_device_name(0), "total_bytes": total, "free_bytes": free}


def start(
    name: str, model: Path, out: Path, context: int, flags: list[str], port: int, module: str
) -> tuple[Any, Path, float]:
    log = out / f"{name}.log"
    cmd = [
        sys.executable,
        "-m",
        module,
        "--model-path",
        str(model),
        "--served-model-name",
        trial.SERVED_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--tp-size",
        "1",
        "--reasoning-parser",
        "qwen3",
        "--context-length",
        str(context),
        *(BASE_FLAGS if module == "sglang.launch_server" else []),
        *flags,
    ]
    print(f"[{name}] {' '.join(cmd)}", flush=True)
    # The server sees SGLang's site alone (SGL_SITE), as device_run.sh gave it: datagen's wheels stay out.
    env = dict(os.environ)
    if os.environ.get("SGL_SITE"):
        env["PYTHONPATH"] = os.environ["SGL_SITE"]
    with open(log, "wb") as lf:
        proc = subprocess.Popen(cmd, stdout=lf, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    return proc, log, time.monotonic()


def wait_ready(proc: Any, log: Path, t0: float, deadline: float) -> bool:
    while time.time() < deadline:
        if proc.poll() is not None:
            return False
        if "ready to roll" in log.read_text(errors="replace"):
            return True
        time.sleep(1.0)
    return False


def stop(proc: Any) -> int | None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    return int(proc.returncode) if proc.returncode is not None else None


def sizing_dict(s: Any) -> dict[str, Any] | None:
    return asdict(s) if s is not None else None


def logged_dict(p: LoggedPools | None) -> dict[str, Any] | None:
    return asdict(p) if p is not None else None


def run_benches(base: str, log: Path, benches: list[tuple[int, int, int]], vocab: int) -> list[dict[str, Any]]:
    results = []
    for prompt, output, n in benches:
        left = until() - time.time() - 25
        if left < 30:
            results.append({"prompt_len": prompt, "max_new_tokens": output, "requests": n, "skipped": "no time"})
            continue
        r = bench.run(base, n, prompt, output, vocab, timeout=left, log=log)
        r.pop("log_batch_lines", None)
        samples = r.pop("metrics_samples", [])
        r["metrics_samples_n"] = len(samples)
        print(f"  bench {prompt}x{output}x{n}: {r['output_tokens_per_s']} tok/s, ok {r['ok']}", flush=True)
        results.append(r)
    return results


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--phase", action="append", default=[])
    p.add_argument("--bench", action="append", default=[])
    p.add_argument("--port", type=int, default=30100)
    p.add_argument("--server-module", default="sglang.launch_server", help="datagen.standin for a rehearsal")
    p.add_argument("--fake-gpu", help="NAME:TOTAL:FREE bytes, for a rehearsal without a GPU")
    p.add_argument(
        "--then-datagen",
        metavar="PYTHONPATH",
        help="after the last phase's benches, run datagen_on_engine.py attached to that server with this path",
    )
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    benches = [tuple(int(x) for x in b.split("x")) for b in a.bench]
    config = json.loads((a.model / "config.json").read_text())
    vocab = int(config.get("text_config", config).get("vocab_size", 248320))
    model = ModelShape.from_config(config)
    gpu_seen = probe_gpu(a.fake_gpu)
    probed = GpuMemory(
        gpu_seen["total_bytes"], gpu_seen["free_bytes"], WEIGHTS_ESTIMATE, card_bandwidth(gpu_seen["name"])
    )
    # A bench sends at least as many requests as the plan (with 0.5.17's reservations) expects to run at once at
    # its context, so a card larger than the one the sizes were chosen on is measured at its plan, not below it.
    scaled = []
    for prompt, output, n in benches:
        ctx_plan = plan_memory(model, for_engine(probed, "0.5.17"), prompt + output, context_source="bench size")
        expect = ctx_plan.launched.concurrency(prompt + output) if ctx_plan.launched else n
        scaled.append((prompt, output, min(256, max(n, expect))))
    benches = scaled
    summary: dict[str, Any] = {"gpu": gpu_seen, "phases": {}, "model_shape": asdict(model), "benches": benches}
    calibrated: GpuMemory | None = None
    calibrated_from: LoggedPools | None = None
    for i, phase in enumerate(a.phase):
        name = phase.replace(":", "-")
        need = START_S + 60 * sum(1 for b in benches if phase == "defaults" or b[0] + b[1] == _ctx(phase))
        if until() - time.time() < need:
            summary["phases"][name] = {"skipped": f"{until() - time.time():.0f} s left, {need:.0f} s needed"}
            continue
        record: dict[str, Any] = {"phase": phase}
        if phase == "defaults":
            flags: list[str] = []
            mine = benches
        else:
            ctx = _ctx(phase)
            if calibrated is None or calibrated_from is None:
                summary["phases"][name] = {"skipped": "no defaults log to calibrate from"}
                continue
            base_plan = plan_memory(model, probed, ctx, context_source=f"{ctx} tokens a request (bench)")
            plan = base_plan.recalibrated(calibrated_from, [])
            flags = list(plan.plan_args)
            mine = [b for b in benches if b[0] + b[1] == ctx]
            record["plan_uncalibrated"] = {"args": base_plan.plan_args, "launched": sizing_dict(base_plan.launched)}
            record["plan"] = {
                "args": plan.plan_args,
                "chosen": plan.chosen,
                "launched": sizing_dict(plan.launched),
                "concurrency": plan.launched.concurrency(ctx) if plan.launched else None,
                "roofline_tokens_per_s": plan.roofline_tokens_per_s,
                "reasons": plan.reasons,
            }
        proc, log, t0 = start(name, a.model, a.out, a.context_length, flags, a.port + i, a.server_module)
        ready = wait_ready(proc, log, t0, min(until() - 30, time.time() + 400))
        record["ready"] = ready
        record["startup_seconds"] = round(time.monotonic() - t0, 1)
        base = f"http://127.0.0.1:{a.port + i}"
        try:
            if ready:
                logged = LoggedPools.parse(log.read_text(errors="replace"))
                record["logged"] = logged_dict(logged)
                record["probes"] = {
                    k: {"status": v.get("status"), "seconds": v.get("seconds")}
                    for k, v in trial.probes(base, vocab).items()
                }
                if logged is not None and phase == "defaults":
                    d = EngineFlags()
                    calibrated = calibrated_gpu(model, for_engine(probed, "0.5.17"), d, logged)
                    calibrated_from = logged
                    record["predicted"] = {
                        "probe_as_0.5.23": sizing_dict(sglang_sizing(model, probed, d)),
                        "probe_with_0.5.17_reservations": sizing_dict(
                            sglang_sizing(model, for_engine(probed, "0.5.17"), d)
                        ),
                        "calibrated_from_this_log": sizing_dict(sglang_sizing(model, calibrated, d)),
                    }
                    record["calibrated_gpu"] = asdict(calibrated)
                elif logged is not None and "plan" in record:
                    expected = sglang_sizing(model, calibrated, EngineFlags.from_args(flags)) if calibrated else None
                    record["shortfall_vs_plan"] = pool_shortfall(expected, logged) if expected else None
                    if expected is not None:
                        record["kv_error"] = (logged.max_total_num_tokens - expected.max_total_num_tokens) / max(
                            1, expected.max_total_num_tokens
                        )
                record["benches"] = run_benches(base, log, mine, vocab)
                if a.then_datagen and i == len(a.phase) - 1 and until() - time.time() > 60:
                    env = dict(os.environ, PYTHONPATH=a.then_datagen)
                    cmd = [sys.executable, str(HERE / "datagen_on_engine.py"), "--engine", "sglang"]
                    cmd += ["--model", str(a.model), "--out", str(a.out), "--work", "/tmp/dg-attached-work"]
                    cmd += ["--attach", base, "--attach-pgid", str(proc.pid), "--tag=-attached"]
                    cmd += ["--requests", str(max(24, mine[0][2] if mine else 24)), "--hang-timeout", "10"]
                    if mine:
                        cmd += ["--prompt-len", str(mine[0][0]), "--max-new", str(mine[0][1])]
                    record["datagen_attached_exit"] = subprocess.run(cmd, env=env, check=False).returncode
                if calibrated is not None:
                    for b in record["benches"]:
                        running = b.get("log_max_running_req") or 0
                        roof = decode_roofline(model, calibrated, running, b["prompt_len"] + b["max_new_tokens"])
                        if roof and b.get("output_tokens_per_s"):
                            b["decode_roofline_tokens_per_s_at_running"] = round(roof, 1)
        finally:
            record["exit_code"] = stop(proc)
            record["figures"] = trial.parse_figures(log)
            (a.out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
            summary["phases"][name] = {k: record.get(k) for k in ("ready", "startup_seconds", "logged", "plan")}
            (a.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
            if not ready:
                print("".join(log.read_text(errors="replace").splitlines(True)[-40:]), flush=True)
    return 0


def _ctx(phase: str) -> int:
    return int(phase.split(":", 1)[1]) if ":" in phase else 0


if __name__ == "__main__":
    sys.exit(main())
