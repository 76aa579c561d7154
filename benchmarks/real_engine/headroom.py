"""headroom.py: the memory plan's fraction against SGLang's generic one and an expert's, on the lent GPU (issue 45).

Runs on the device (device.sh part `headroom`; PYTHONPATH: the carried SGLang site, datagen's wheels and source).
One server at a time, each written to OUT/NAME.json and OUT/NAME.log as soon as it ends; GPU memory polled all
along (NVML, else nvidia-smi) so each phase's used memory at ready and at its peak is known.

  today    datagen's plan as it was: SGLang's default fraction rounded down, pools balanced for --context-tokens
           requests, recalibrated from --calibrate-log (issue 37's defaults server on this card). Then a short
           chunk burst (--chunk-burst PROMPTxOUTPUTxN: long prompts, so prefill runs full chunks) and the bench.
           Its log gives the CUDA graphs' memory (`LoggedGraphs`); the used memory's growth over the chunk burst
           and the bench gives the activation peak: together the engine's headroom, measured here.
  new      datagen's plan with that measured headroom (`plan_memory(headroom=...)`), recalibrated from the
           `today` server's own log; the bench, then the worst-case burst (--burst PROMPTxOUTPUTxN: max-length
           prompts filling the batch): out-of-memory errors, retractions, the server alive after.
  expert   --disable-radix-cache --mem-fraction-static 0.88 (SGLang splits the rest); the bench.
  profile  (no server) the new plan from the committed profile (datagen.engine.headroom.HEADROOM) instead of
           this call's measurement, to launch as `new` does: `new:profile`.

  python3 headroom.py --model /tmp/sgl/model --out $OUT --calibrate-log defaults.log \
      --phase today --phase new --bench 200x512x152 --burst 7000x128x60
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

import bench  # noqa: E402  (beside this file)
import engine_trial  # noqa: E402

from datagen.engine.headroom import HEADROOM, Headroom, LoggedGraphs  # noqa: E402
from datagen.engine.memory_plan import (  # noqa: E402
    GpuMemory,
    LoggedPools,
    MemoryPlan,
    ModelShape,
    card_bandwidth,
    decode_roofline,
    for_engine,
    plan_memory,
)

_GIB = 1 << 30
ENGINE = "0.5.17"
EXPERT_FLAGS = ["--disable-radix-cache", "--mem-fraction-static", "0.88"]
MARGIN_BYTES = 1 * _GIB


class MemoryWatch:
    """GPU 0's used memory, polled every `interval` s from a thread (NVML, else nvidia-smi)."""

    def __init__(self, interval: float = 0.2) -> None:
        self.interval = interval
        self.samples: list[tuple[float, int]] = []
        self._stop = threading.Event()
        self._read = self._nvml() or self._smi
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _nvml() -> Any:
        try:
            import pynvml

            pynvml.nvmlInit()
            handle = pynvml.nvmlDeviceGetHandleByIndex(0)
            return lambda: int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
        except Exception:
            return None

    @staticmethod
    def _smi() -> int:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
            capture_output=True,
            text=True,
            check=False,
        ).stdout
        return int(out.split()[0]) * (1 << 20) if out.strip() else 0

    def _run(self) -> None:
        while not self._stop.is_set():
            with contextlib.suppress(Exception):  # a reading missed: the next one counts
                self.samples.append((time.time(), self._read()))
            self._stop.wait(self.interval)

    def start(self) -> MemoryWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def now(self) -> int:
        return self.samples[-1][1] if self.samples else 0

    def peak(self, since: float, until: float | None = None) -> int:
        return max((u for t, u in self.samples if t >= since and (until is None or t <= until)), default=0)


def _triple(text: str) -> tuple[int, int, int]:
    a, b, c = (int(x) for x in text.split("x"))
    return a, b, c


def _log_since(log: Path, offset: int) -> str:
    with open(log, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _events(text: str) -> dict[str, Any]:
    """Out-of-memory errors and retractions in a stretch of a server log."""
    retracted = sum(int(x) for x in re.findall(r"#retracted_reqs: (\d+)", text))
    oom = [ln[-300:] for ln in text.splitlines() if "out of memory" in ln.lower() or "OutOfMemoryError" in ln]
    return {"retracted_requests": retracted, "retraction_lines": text.count("Retract"), "oom_lines": oom[:5]}


def _bench(base: str, log: Path, size: tuple[int, int, int], vocab: int, watch: MemoryWatch) -> dict[str, Any]:
    prompt, output, n = size
    offset = log.stat().st_size
    t0 = time.time()
    left = engine_trial.until() - time.time() - 20
    r = bench.run(base, n, prompt, output, vocab, timeout=max(30.0, left), log=log)
    r.pop("metrics_samples", None)
    lines = r.pop("log_batch_lines", [])
    r["log_batch_lines_n"] = len(lines)
    r["peak_used_bytes"] = watch.peak(t0)
    r.update(_events(_log_since(log, offset)))
    print(
        f"  bench {prompt}x{output}x{n}: {r['output_tokens_per_s']} tok/s out, {r['total_tokens_per_s']} total, "
        f"ok {r['ok']}/{n}, running <= {r['log_max_running_req']}, steady {r['log_median_gen_throughput']}, "
        f"retracted {r['retracted_requests']}, oom {len(r['oom_lines'])}, "
        f"peak used {r['peak_used_bytes'] / _GIB:.2f} GiB",
        flush=True,
    )
    return r


def _alive(base: str) -> bool:
    try:
        engine_trial.trial.http("GET", base + "/health", timeout=10)
        return True
    except Exception:
        return False


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--calibrate-log", type=Path, required=True, help="a defaults server's log on this card")
    p.add_argument("--context-length", type=int, default=32768)
    p.add_argument("--context-tokens", type=int, default=712, help="a request's prompt + output, for the plan")
    p.add_argument("--phase", action="append", default=[])
    p.add_argument("--bench", type=_triple, default=(200, 512, 152))
    p.add_argument("--new-bench-waves", type=float, default=2.0, help="`new`'s bench: this many times its cap")
    p.add_argument("--chunk-burst", type=_triple, default=(7000, 8, 8))
    p.add_argument("--burst", type=_triple, default=(7000, 128, 60))
    p.add_argument("--port", type=int, default=30300)
    p.add_argument("--server-module", default="sglang.launch_server", help="datagen.standin for a rehearsal")
    p.add_argument("--fake-gpu", help="NAME:TOTAL:FREE bytes, for a rehearsal without a GPU")
    a = p.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    config = json.loads((a.model / "config.json").read_text())
    vocab = int(config.get("text_config", config).get("vocab_size", 248320))
    model = ModelShape.from_config(config)
    seen = engine_trial.probe_gpu(a.fake_gpu)
    probed = for_engine(
        GpuMemory(seen["total_bytes"], seen["free_bytes"], engine_trial.WEIGHTS_ESTIMATE, card_bandwidth(seen["name"])),
        ENGINE,
    )
    calibration = LoggedPools.parse(a.calibrate_log.read_text(errors="replace"))
    if calibration is None:
        raise SystemExit(f"{a.calibrate_log}: no pools in this log")
    ctx = a.context_tokens

    def plan(headroom: Headroom | None, logged: LoggedPools, launched: list[str]) -> MemoryPlan:
        base = plan_memory(model, probed, ctx, context_source=f"{ctx} tokens a request (bench)", headroom=headroom)
        return base.recalibrated(logged, launched)

    watch = MemoryWatch().start()
    summary: dict[str, Any] = {"gpu": seen, "engine": ENGINE, "context_tokens": ctx, "phases": {}}
    measured: Headroom | None = None
    today_log: tuple[LoggedPools, list[str]] | None = None
    try:
        for i, phase in enumerate(a.phase):
            name = phase.replace(":", "-")
            record: dict[str, Any] = {"phase": phase}
            if phase == "today":
                chosen = plan(None, calibration, [])
            elif phase.startswith("new"):
                source = phase.split(":", 1)[1] if ":" in phase else "measured"
                headroom = HEADROOM[ENGINE] if source == "profile" else measured
                if headroom is None:
                    summary["phases"][name] = {"skipped": "no headroom measured (run `today` first)"}
                    continue
                logged, launched = today_log if today_log is not None else (calibration, [])
                chosen = plan(headroom, logged, launched)
                record["headroom"] = asdict(headroom)
            elif phase == "expert":
                chosen = None
            else:
                raise SystemExit(f"unknown phase {phase}")
            flags = list(chosen.plan_args) if chosen is not None else list(EXPERT_FLAGS)
            if chosen is not None:
                record["plan"] = {
                    "args": chosen.plan_args,
                    "chosen": chosen.chosen,
                    "fraction": chosen.fraction,
                    "launched": asdict(chosen.launched) if chosen.launched else None,
                    "concurrency": chosen.launched.concurrency(ctx) if chosen.launched else None,
                    "roofline_tokens_per_s": chosen.roofline_tokens_per_s,
                    "reasons": chosen.reasons,
                }
            if engine_trial.until() - time.time() < engine_trial.START_S:
                summary["phases"][name] = {"skipped": f"{engine_trial.until() - time.time():.0f} s left"}
                continue
            idle = watch.now()
            proc, log, t0 = engine_trial.start(
                name, a.model, a.out, a.context_length, flags, a.port + i, a.server_module
            )
            ready = engine_trial.wait_ready(proc, log, t0, min(engine_trial.until() - 30, time.time() + 400))
            record.update(ready=ready, startup_seconds=round(time.monotonic() - t0, 1), flags=flags)
            base = f"http://127.0.0.1:{a.port + i}"
            try:
                if not ready:
                    continue
                time.sleep(1.0)
                text = log.read_text(errors="replace")
                logged = LoggedPools.parse(text)
                graphs = LoggedGraphs.parse(text)
                record["logged"] = asdict(logged) if logged else None
                record["graphs"] = asdict(graphs) if graphs else None
                at_ready = watch.now()
                record["used_idle_bytes"], record["used_at_ready_bytes"] = idle, at_ready
                if phase == "today":
                    t = time.time()
                    record["chunk_burst"] = _bench(base, log, a.chunk_burst, vocab, watch)
                    record["chunk_burst_peak_bytes"] = watch.peak(t)
                record["bench"] = _bench(
                    base,
                    log,
                    a.bench
                    if not phase.startswith("new") or chosen is None or chosen.launched is None
                    else (
                        a.bench[0],
                        a.bench[1],
                        max(a.bench[2], round(a.new_bench_waves * chosen.launched.max_running_requests)),
                    ),
                    vocab,
                    watch,
                )
                if phase.startswith("new"):
                    record["burst"] = _bench(base, log, a.burst, vocab, watch)
                    record["alive_after_burst"] = _alive(base)
                running = record["bench"].get("log_max_running_req") or 0
                if logged is not None:
                    gpu = for_engine(probed, ENGINE)
                    gpu = GpuMemory(
                        gpu.total_bytes,
                        gpu.free_bytes,
                        gpu.weights_bytes,
                        gpu.bandwidth_bytes_per_s,
                        measured_pre_model_load_bytes=logged.pre_model_load_bytes,
                    )
                    roof = decode_roofline(model, gpu, running, ctx)
                    record["decode_roofline_tokens_per_s_at_running"] = round(roof, 1) if roof else None
                peak = watch.peak(t0)
                record["peak_used_bytes"] = peak
                record["activation_peak_bytes"] = max(0, peak - at_ready)
                if phase == "today" and graphs is not None and logged is not None:
                    measured = Headroom.measured(
                        ENGINE,
                        graphs,
                        record["activation_peak_bytes"],
                        margin_bytes=MARGIN_BYTES,
                        source=f"measured on {seen['name']} in this call (headroom.py today)",
                    )
                    record["measured_headroom"] = asdict(measured)
                    today_log = (logged, flags)
                    print(f"  measured headroom: {measured.describe(graphs.chunk_tokens, graphs.decode_graph_batch)}")
            finally:
                record["exit_code"] = engine_trial.stop(proc)
                record["figures"] = engine_trial.trial.parse_figures(log)
                (a.out / f"{name}.json").write_text(json.dumps(record, indent=1, default=str))
                summary["phases"][name] = {
                    k: record.get(k)
                    for k in ("ready", "startup_seconds", "flags", "activation_peak_bytes", "alive_after_burst")
                }
                summary["phases"][name]["bench"] = {
                    k: (record.get("bench") or {}).get(k)
                    for k in ("output_tokens_per_s", "log_max_running_req", "log_median_gen_throughput", "ok")
                }
                (a.out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
                if not ready:
                    print("".join(log.read_text(errors="replace").splitlines(True)[-40:]), flush=True)
    finally:
        watch.stop()
        os.sync()
    return 0


if __name__ == "__main__":
    sys.exit(main())
