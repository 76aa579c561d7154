"""Scale rehearsal: the real `expand-dataset` flow end to end at N prompts, measured per stage.

    python -m benchmarks.scale --prompts 10000 --out scale-10k.json [--prefect embedded|server|both]
    python -m benchmarks.scale --merge scale-10k.json scale-30k.json scale-100k.json --out scale.json --plot scale.png

Each run: N synthetic prompts, a fresh work dir and PREFECT_HOME, the local SeaweedFS S3 server, stand-in
servers with a fast timing model, and the flow run in a child process (planning, generation, validation,
tokenization, publish, catalog) on embedded Prefect or on a real `prefect server start` this script starts.
The parent samples every process of the run (pipeline, stand-ins, Prefect server) from /proc twice a second;
after the flow the child reads its task runs from the Prefect API. Per stage (task runs grouped by name):
wall time, CPU seconds by process group, peak RSS, task runs; per run: bytes written (work dir, Prefect
database, S3), Prefect's share of wall and CPU, and the time from the last generated token to the manifest.
With results at two or more N, each cost is fitted as a * N**b and extrapolated to 1M prompts.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import re
import resource
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from datetime import datetime
from pathlib import Path
from typing import Any
from uuid import UUID

__all__ = ["fit_power", "main"]

REPO_ROOT = Path(__file__).resolve().parents[1]
_TICK = os.sysconf("SC_CLK_TCK")
_PAGE = os.sysconf("SC_PAGE_SIZE")
SAMPLE_S = 0.5
CATEGORIES = ("explain", "math", "code", "writing")
# The timing model: 15 ms per decode step plus a little per running request, 128 slots, ~64-token outputs:
# ~7,900 tok/s, ~120 completions/s per server. The servers are the bottleneck, as GPUs are in production
# (~7 completions/s per 8-GPU box there); the client, ~2 ms of CPU per request on this box, has room to spare.
# `--step-base-ms 2` (the first setting) makes the client the bottleneck instead (~1,200 completions/s asked of
# two servers): every shard then advances at the client's pace and they all finish at once (see README).
STANDIN_ENV = {
    "DATAGEN_STANDIN_LENGTH_MEAN": "64",
    "DATAGEN_STANDIN_LENGTH_SIGMA": "0.5",
    "DATAGEN_STANDIN_LENGTH_MAX": "256",
    "DATAGEN_STANDIN_STEP_BASE_MS": "15",
    "DATAGEN_STANDIN_STEP_PER_REQ_MS": "0.01",
    "DATAGEN_STANDIN_MAX_RUNNING": "128",
    "DATAGEN_STANDIN_LOAD_S": "0.2",
    "DATAGEN_STANDIN_WARMUP_S": "0.2",
}


# --- /proc sampling ----------------------------------------------------------------------------------------


def _proc_stat(pid: int) -> tuple[float, int, int] | None:
    """(cpu seconds, rss bytes, start ticks) of a live process, or None."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK, int(fields[21]) * _PAGE, int(fields[19])


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for task in Path(f"/proc/{pid}/task").iterdir():
            try:
                out.extend(int(c) for c in (task / "children").read_text().split())
            except OSError:
                continue
    except OSError:
        pass
    return out


def _tree(root: int) -> list[tuple[int, int | None]]:
    """(pid, parent pid) of every process under `root`, parents first."""
    seen: list[tuple[int, int | None]] = []
    todo: list[tuple[int, int | None]] = [(root, None)]
    while todo:
        pid, parent = todo.pop(0)
        if all(pid != p for p, _ in seen):
            seen.append((pid, parent))
            todo.extend((c, pid) for c in _children(pid))
    return seen


def _group(pid: int, root: int, prefect_root: int | None) -> str:
    if pid == root:
        return "pipeline"
    if prefect_root is not None and pid == prefect_root:
        return "prefect_server"
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return "other"
    if "datagen.standin" in cmd:
        return "standin"
    if "prefect" in cmd or "uvicorn" in cmd:
        return "prefect_server"
    return "other"


class TreeSampler:
    """Samples CPU and RSS of the process trees under the given roots (our own children only)."""

    def __init__(self, roots: dict[int, str | None]) -> None:
        self.roots = roots  # pid -> forced group name (None: classify the tree from its root's child)
        self.samples: list[dict[str, Any]] = []
        self._last_cpu: dict[tuple[int, int], tuple[str, float]] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="tree-sampler", daemon=True)

    def __enter__(self) -> TreeSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()

    def _loop(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.sample()

    def sample(self) -> None:
        rss: dict[str, int] = {}
        for root, forced in self.roots.items():
            named: dict[int, str] = {}
            for pid, parent in _tree(root):
                st = _proc_stat(pid)
                if st is None:
                    continue
                cpu, resident, start = st
                key = (pid, start)
                # A child of a stand-in (or of the Prefect server) belongs to it; otherwise classify by command.
                inherited = named.get(parent) if parent is not None else None
                if inherited == "pipeline":
                    inherited = None
                name = forced or inherited or self._last_cpu.get(key, ("", 0.0))[0] or _group(pid, root, None)
                named[pid] = name
                self._last_cpu[key] = (name, cpu)
                rss[name] = rss.get(name, 0) + resident
                if name == "pipeline" and pid == root:
                    rss["pipeline_main"] = resident
        cpu_by: dict[str, float] = {}
        for name, cpu in self._last_cpu.values():  # exited processes keep their last reading
            cpu_by[name] = cpu_by.get(name, 0.0) + cpu
        self.samples.append({"t": time.time(), "cpu": cpu_by, "rss": rss})

    def window(self, t0: float, t1: float) -> dict[str, Any]:
        """CPU seconds per group and peak RSS per group between two wall-clock times."""
        inside = [s for s in self.samples if t0 - SAMPLE_S <= s["t"] <= t1 + SAMPLE_S] or self.samples[-1:]
        before = max((s for s in self.samples if s["t"] <= t0), key=lambda s: s["t"], default=self.samples[0])
        after = min((s for s in self.samples if s["t"] >= t1), key=lambda s: s["t"], default=self.samples[-1])
        groups = set(after["cpu"]) | set(before["cpu"])
        cpu = {g: round(after["cpu"].get(g, 0.0) - before["cpu"].get(g, 0.0), 2) for g in sorted(groups)}
        peak: dict[str, int] = {}
        for s in inside:
            for g, v in s["rss"].items():
                peak[g] = max(peak.get(g, 0), v)
        return {"cpu_s": cpu, "peak_rss_mb": {g: round(v / 1e6, 1) for g, v in sorted(peak.items())}}


# --- the child: one flow run ----------------------------------------------------------------------------------


def _thread_cpu() -> dict[int, tuple[str, float]]:
    names = {t.native_id: t.name for t in threading.enumerate() if t.native_id is not None}
    out: dict[int, tuple[str, float]] = {}
    for task in Path("/proc/self/task").iterdir():
        tid = int(task.name)
        st = _proc_stat_path(task / "stat")
        if st is not None:
            out[tid] = (names.get(tid, "?"), st)
    return out


def _proc_stat_path(path: Path) -> float | None:
    try:
        raw = path.read_text()
    except OSError:
        return None
    fields = raw[raw.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / _TICK


def _thread_group(name: str) -> str:
    # Prefect's own service threads (event and log shipping, its event loops) vs. the pipeline's threads.
    base = re.sub(r"[-_ ]?\d+(_\d+)?$", "", name)
    return base or name


@contextmanager
def _thread_cpu_sampler() -> Iterator[dict[int, tuple[str, float]]]:
    seen: dict[int, tuple[str, float]] = {}
    stop = threading.Event()

    def loop() -> None:
        while not stop.wait(1.0):
            for tid, (name, cpu) in _thread_cpu().items():
                old = seen.get(tid)
                seen[tid] = (name if name != "?" or old is None else old[0], cpu)

    thread = threading.Thread(target=loop, name="scale-thread-sampler", daemon=True)
    thread.start()
    try:
        yield seen
    finally:
        stop.set()
        thread.join()
        for tid, (name, cpu) in _thread_cpu().items():
            old = seen.get(tid)
            seen[tid] = (name if name != "?" or old is None else old[0], cpu)


def _task_runs(flow_run_id: str) -> list[dict[str, Any]]:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import FlowRunFilter, FlowRunFilterId, LogFilter, LogFilterFlowRunId

    runs: list[dict[str, Any]] = []
    with get_client(sync_client=True) as client:
        offset = 0
        while True:
            page = client.read_task_runs(
                flow_run_filter=FlowRunFilter(id=FlowRunFilterId(any_=[flow_run_id])), limit=200, offset=offset
            )
            runs.extend(
                {
                    "name": r.name,
                    "state": r.state_type.value if r.state_type else None,
                    "start": r.start_time.timestamp() if r.start_time else None,
                    "end": r.end_time.timestamp() if r.end_time else None,
                }
                for r in page
            )
            if len(page) < 200:
                break
            offset += 200
        flow_run = client.read_flow_run(UUID(flow_run_id))
        logs: list[str] = []
        while True:  # what the flow run's Logs tab shows: its own and its task runs' records
            page_logs = client.read_logs(
                log_filter=LogFilter(flow_run_id=LogFilterFlowRunId(any_=[UUID(flow_run_id)])),
                limit=200,
                offset=len(logs),
            )
            logs.extend(str(r.message) for r in page_logs)
            if len(page_logs) < 200:
                break
    runs.append(
        {"name": "__logs__", "lines": len(logs), "finished_lines": sum(m.startswith("Finished in") for m in logs)}
    )
    runs.append(
        {
            "name": "__flow__",
            "state": flow_run.state_type.value if flow_run.state_type else None,
            "start": flow_run.start_time.timestamp() if flow_run.start_time else None,
            "end": flow_run.end_time.timestamp() if flow_run.end_time else None,
        }
    )
    return runs


def _time_glue() -> dict[str, float]:
    """Wrap the flow body's own work between tasks in timers: seconds per call site, counted outside task runs only.

    The flow run's time covered by no task run is Prefect's (task submission, state changes, artifacts) plus this
    glue (tokenizer load, catalog read, prompt filter, fleet set-up and stop, dataset card, run report); timing the
    glue lets the parent subtract it instead of charging it to Prefect.
    """
    from prefect.context import TaskRunContext

    import flows.skeleton as fx
    from datagen.chat import ChatTokenizer
    from datagen.engine.dispatcher import Dispatcher
    from datagen.operations import report
    from datagen.publishing import catalog
    from tasks import finishing, ordering, provisioning

    seconds: dict[str, float] = {}

    def timed(name: str, fn: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if TaskRunContext.get() is not None:  # inside a task run: already covered
                return fn(*args, **kwargs)
            t = time.monotonic()
            try:
                return fn(*args, **kwargs)
            finally:
                seconds[name] = seconds.get(name, 0.0) + time.monotonic() - t

        return wrapper

    for owner, attr in [
        (catalog, "published_prompt_ids"),
        (catalog, "next_expansion_namespace"),
        (ordering, "run_filter"),
        (provisioning, "provision"),
        (report, "completion_lengths"),
        (report, "run_report"),
        (report, "dataset_link"),
        (fx, "write_dataset_card"),
        (fx, "render_validation_report"),
        (fx.validation, "count_reject_reasons"),
        (finishing, "StreamingFinish"),
    ]:
        setattr(owner, attr, timed(f"{getattr(owner, '__name__', owner)}.{attr}", getattr(owner, attr)))
    from_model_dir = ChatTokenizer.from_model_dir
    ChatTokenizer.from_model_dir = timed("ChatTokenizer.from_model_dir", from_model_dir)  # type: ignore[method-assign]
    fleet_cls = fx.provisioning.ServerFleet
    fleet_cls.stop = timed("ServerFleet.stop", fleet_cls.stop)  # type: ignore[method-assign]
    Dispatcher.__exit__ = timed("Dispatcher.__exit__", Dispatcher.__exit__)  # type: ignore[method-assign]
    Dispatcher.wait_ready = timed("Dispatcher.wait_ready", Dispatcher.wait_ready)  # type: ignore[method-assign]
    return seconds


def child_main(config_path: Path) -> int:
    """Run the flow once (config from the parent), then write task runs and thread CPU next to the config."""
    config = json.loads(config_path.read_text())
    t_import = time.time()
    import prefect  # noqa: F401  (timed on its own: Prefect's import cost)

    t_prefect_imported = time.time()
    from datagen.runspec import RunSpec
    from flows.expand_dataset import expand_dataset

    spec = RunSpec.model_validate(config["spec"])
    glue = _time_glue()
    with _thread_cpu_sampler() as threads:
        t_flow = time.time()
        state = expand_dataset(spec, return_state=True)
        t_flow_end = time.time()
    report = state.result()
    flow_run_id = str(state.state_details.flow_run_id)
    from prefect.logging.handlers import APILogWorker

    # Logs ship in batches: count them once all are in. The drain is the exit flush Prefect does anyway (it stays
    # in the teardown); the API reads that follow are measurement, subtracted from the teardown by the parent.
    APILogWorker.drain_all(timeout=30)
    t_reads = time.time()
    task_runs = _task_runs(flow_run_id)
    t_reads_end = time.time()
    by_group: dict[str, float] = {}
    for name, cpu in threads.values():
        g = _thread_group(name)
        by_group[g] = round(by_group.get(g, 0.0) + cpu, 2)
    out = {
        "report": report,
        "flow_run_id": flow_run_id,
        "t_import": t_import,
        "t_prefect_imported": t_prefect_imported,
        "t_flow_call": t_flow,
        "glue_s": {k: round(v, 3) for k, v in sorted(glue.items(), key=lambda kv: -kv[1])},
        "t_flow_return": t_flow_end,
        "measuring_s": t_reads_end - t_reads,
        "task_runs": task_runs,
        "thread_cpu_s": dict(sorted(by_group.items(), key=lambda kv: -kv[1])),
        "ru_maxrss_mb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e3, 1),
    }
    Path(config["result_path"]).write_text(json.dumps(out, indent=1, default=str))
    return 0


# --- the parent: one measured run ---------------------------------------------------------------------------


def write_prompts(path: Path, n: int) -> Path:
    """N distinct single-turn prompts in OpenAI messages format, with a category field."""
    with path.open("w", encoding="utf-8") as f:
        for i in range(n):
            cat = CATEGORIES[i % len(CATEGORIES)]
            text = f"Prompt {i}: {cat} the idea number {i * 7919 % 100003} in a few sentences."
            f.write(json.dumps({"messages": [{"role": "user", "content": text}], "category": cat}) + "\n")
    return path


def _du(path: Path) -> int:
    total = 0
    if path.is_file():
        return path.stat().st_size
    if not path.exists():
        return 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def _stage_name(task_run_name: str) -> str:
    name = re.sub(r" shard-\d+$", "", task_run_name)
    return re.sub(r"-[0-9a-f]{3}$", "", name)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def _stages(task_runs: list[dict[str, Any]], sampler: TreeSampler) -> dict[str, dict[str, Any]]:
    groups: dict[str, list[dict[str, Any]]] = {}
    for r in task_runs:
        if not r["name"].startswith("__") and r["start"] is not None and r["end"] is not None:
            groups.setdefault(_stage_name(r["name"]), []).append(r)
    stages: dict[str, dict[str, Any]] = {}
    for name, runs in sorted(groups.items(), key=lambda kv: min(r["start"] for r in kv[1])):
        t0, t1 = min(r["start"] for r in runs), max(r["end"] for r in runs)
        stages[name] = {
            "task_runs": len(runs),
            "start": t0,
            "end": t1,
            "wall_s": round(t1 - t0, 2),
            "busy_s": round(_union([(r["start"], r["end"]) for r in runs]), 2),
            **sampler.window(t0, t1),
        }
    return stages


def _s3_bytes(settings_env: dict[str, str], namespace: str) -> dict[str, int]:
    from datagen.publishing.storage import ObjectStore
    from datagen.settings import Settings

    saved = {k: os.environ.get(k) for k in settings_env}
    os.environ.update(settings_env)
    try:
        store = ObjectStore.from_settings(Settings())
        objects = list(store.list(""))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    ns = [o for o in objects if o.key.startswith(f"{namespace}/")]
    return {
        "dataset_bytes": sum(o.size for o in ns),
        "dataset_objects": len(ns),
        "all_bytes": sum(o.size for o in objects),
        "all_objects": len(objects),
    }


def _start_prefect_server(state: Path) -> tuple[subprocess.Popen[bytes], str, Path]:
    import httpx

    sys.path.insert(0, str(REPO_ROOT))
    from tests.prefect_fixtures import free_port

    home = state / "server-home"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_API_HOST": "127.0.0.1",
            "PREFECT_SERVER_API_PORT": str(port),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        }
    )
    log = (state / "server.log").open("wb")
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "prefect"), "server", "start"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}/api"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"prefect server exited {proc.returncode}: {(state / 'server.log').read_text()[-2000:]}")
        try:
            if httpx.get(f"{url}/health", timeout=2).json() is True:
                return proc, url, home
        except (httpx.HTTPError, ValueError):
            pass
        time.sleep(0.5)
    raise RuntimeError("prefect server not healthy after 300 s")


def _loadavg() -> list[float]:
    return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]


def run_once(n: int, mode: str, s3: Any, root: Path, servers: int, shard_size: int) -> dict[str, Any]:
    """One measured flow run at `n` prompts on `mode` Prefect ('embedded' or 'server')."""
    from datagen.local.model_fixture import ensure_model_dir

    run_dir = root / f"{mode}-{n}"
    run_dir.mkdir(parents=True)
    prompts = write_prompts(run_dir / "prompts.jsonl", n)
    namespace = f"scale-{mode}-{n}-{int(time.time())}"
    spec = {
        "sources": [{"path": str(prompts), "category_field": "category"}],
        "model_path": str(ensure_model_dir()),
        "namespace": namespace,
        "shard_size": shard_size,
        "context_length": 8192,
        "sampling": {"max_new_tokens": 512},
        "quality_gate": {"max_reject_rate": 0.5, "min_median_completion_tokens": 16},
    }
    work = run_dir / "work"
    prefect_home = run_dir / "prefect-home"
    prefix = f"{namespace}-root/"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    datagen_env = {
        **s3.env(),
        "DATAGEN_S3_PREFIX": prefix,
        "DATAGEN_ENGINE": "standin",
        "DATAGEN_ENGINE_PYTHON": sys.executable,
        "DATAGEN_NUM_SERVERS": str(servers),
        "DATAGEN_BASE_PORT": "0",
        "DATAGEN_SKIP_GPU_CHECKS": "true",
        "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
        "DATAGEN_WORK_DIR": str(work),
        "DATAGEN_SERVER_START_TIMEOUT_S": "300",
        "DATAGEN_DATA_ROOTS": str(run_dir),  # the prompt file this run writes
    }
    env.update(datagen_env)
    env.update(STANDIN_ENV)
    env.update(
        {
            "PREFECT_HOME": str(prefect_home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300",
        }
    )
    server_proc = None
    roots: dict[int, str | None] = {}
    db_paths = [prefect_home / "prefect.db"]
    if mode == "server":
        server_proc, api_url, server_home = _start_prefect_server(run_dir)
        env["PREFECT_API_URL"] = api_url
        roots[server_proc.pid] = "prefect_server"
        db_paths = [server_home / "prefect.db"]
    config = run_dir / "child.json"
    result_path = run_dir / "child-result.json"
    config.write_text(json.dumps({"spec": spec, "result_path": str(result_path)}))
    load_before = _loadavg()
    t0 = time.time()
    log_path = run_dir / "flow.log"
    try:
        with log_path.open("wb") as log:
            proc = subprocess.Popen(
                [sys.executable, "-m", "benchmarks.scale", "--child", str(config)],
                cwd=REPO_ROOT,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
            )
            roots = {proc.pid: None, **roots}
            with TreeSampler(roots) as sampler:
                rc = proc.wait()
        t1 = time.time()
        if rc != 0:
            raise RuntimeError(f"flow child exited {rc}; log {log_path}:\n{log_path.read_text()[-4000:]}")
        db_bytes = sum(_du(p.with_name(p.name + sfx)) for p in db_paths for sfx in ("", "-wal", "-shm"))
    finally:
        if server_proc is not None:
            os.killpg(server_proc.pid, signal.SIGTERM)
            server_proc.wait(timeout=60)
    child = json.loads(result_path.read_text())
    flow = next(r for r in child["task_runs"] if r["name"] == "__flow__")
    stages = _stages(child["task_runs"], sampler)
    gen = stages.get("generate")
    tail_from = gen["end"] if gen else flow["start"]
    publish = stages.get("publish")
    last_token_to_manifest = round(publish["end"] - tail_from, 2) if publish else None
    task_intervals = [(s["start"], s["end"]) for s in stages.values()]
    outside_tasks = round((flow["end"] - flow["start"]) - _union(task_intervals), 2)
    total = sampler.window(t0, t1)
    prefect_threads = {
        k: v for k, v in child["thread_cpu_s"].items() if re.search(r"(?i)event|log|loop|prefect|api", k)
    }
    wall = round(t1 - t0, 2)
    result = {
        "prompts": n,
        "mode": mode,
        "shard_size": shard_size,
        "servers": servers,
        "wall_s": wall,
        "flow_wall_s": round(flow["end"] - flow["start"], 2),
        "startup_s": round(flow["start"] - t0, 2),
        "teardown_s": round(t1 - flow["end"] - child.get("measuring_s", 0.0), 2),
        "outside_tasks_s": outside_tasks,
        "generation_s": gen["wall_s"] if gen else None,
        "last_token_to_manifest_s": last_token_to_manifest,
        "tail_share_of_generation": (
            round(last_token_to_manifest / gen["wall_s"], 4) if gen and last_token_to_manifest is not None else None
        ),
        "pipeline_peak_rss_mb": child["ru_maxrss_mb"],
        "cpu_s": total["cpu_s"],
        "peak_rss_mb": total["peak_rss_mb"],
        "pipeline_thread_cpu_s": child["thread_cpu_s"],
        "prefect_client_thread_cpu_s": round(sum(prefect_threads.values()), 2),
        "prefect_server_cpu_s": total["cpu_s"].get("prefect_server", 0.0),
        "task_runs": sum(s["task_runs"] for s in stages.values()),
        "flow_run_log_lines": next((r["lines"] for r in child["task_runs"] if r["name"] == "__logs__"), None),
        "stages": stages,
        "bytes": {
            "work_dir": _du(work),
            "work_dir_by_part": {p.name: _du(p) for p in sorted((work / "runs" / namespace).glob("*"))},
            "task_results": _du(work / "runs" / namespace / "task-results"),
            "prefect_db": db_bytes,
            **_s3_bytes(datagen_env, namespace),
        },
        "report": child["report"],
        "load_avg_before": load_before,
        "load_avg_after": _loadavg(),
    }
    # Prefect's share: importing Prefect, the flow call to the flow run's start (the embedded server's start), the
    # event flush at exit, and the flow body's time outside any task less our own timed glue; plus the old upper
    # bound (the whole start and every uncovered second), and CPU of Prefect's processes/threads.
    # The start splits into the interpreter and our imports (ours), `import prefect`, and the flow call to the
    # flow run's start (Prefect: the embedded server's start, or the API calls that create the run).
    glue_s = round(sum(child.get("glue_s", {}).values()), 2)
    prefect_import = child["t_prefect_imported"] - child["t_import"]
    flow_start = flow["start"] - child["t_flow_call"]
    result["startup_split_s"] = {
        "interpreter": round(child["t_import"] - t0, 2),
        "import_prefect": round(prefect_import, 2),
        "import_datagen_and_flow": round(child["t_flow_call"] - child["t_prefect_imported"], 2),
        "flow_call_to_flow_run_start": round(flow_start, 2),
    }
    result["glue_outside_tasks_s"] = glue_s
    result["glue_by_call_s"] = child.get("glue_s", {})
    result["prefect_overhead_upper_bound_wall_s"] = round(result["startup_s"] + result["teardown_s"] + outside_tasks, 2)
    result["prefect_overhead_wall_s"] = round(
        prefect_import + flow_start + result["teardown_s"] + max(0.0, outside_tasks - glue_s), 2
    )
    result["prefect_overhead_wall_share"] = round(result["prefect_overhead_wall_s"] / wall, 4)
    all_cpu = sum(total["cpu_s"].values())
    prefect_cpu = result["prefect_server_cpu_s"] + result["prefect_client_thread_cpu_s"]
    result["prefect_cpu_share"] = round(prefect_cpu / all_cpu, 4) if all_cpu else None
    return result


# --- fits, table, plot ----------------------------------------------------------------------------------------


def fit_power(ns: list[float], ys: list[float]) -> dict[str, float] | None:
    """Least-squares fit of y = a * n**b in log space; None with fewer than two positive points."""
    pts = [(math.log(n), math.log(y)) for n, y in zip(ns, ys, strict=True) if n > 0 and y > 0]
    if len(pts) < 2 or len({x for x, _ in pts}) < 2:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    b = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    a = math.exp(my - b * mx)
    return {"a": a, "b": round(b, 3), "at_1m": round(a * 1_000_000**b, 2)}


def _metrics(r: dict[str, Any]) -> dict[str, float]:
    m: dict[str, float] = {
        "wall_s": r["wall_s"],
        "pipeline_peak_rss_mb": r["pipeline_peak_rss_mb"],
        "pipeline_cpu_s": r["cpu_s"].get("pipeline", 0.0),
        "standin_cpu_s": r["cpu_s"].get("standin", 0.0),
        "prefect_server_cpu_s": r["prefect_server_cpu_s"],
        "prefect_overhead_wall_s": r["prefect_overhead_wall_s"],
        "last_token_to_manifest_s": r["last_token_to_manifest_s"] or 0.0,
        "work_dir_bytes": r["bytes"]["work_dir"],
        "prefect_db_bytes": r["bytes"]["prefect_db"],
        "s3_dataset_bytes": r["bytes"]["dataset_bytes"],
        "task_runs": r["task_runs"],
    }
    for name, s in r["stages"].items():
        m[f"stage:{name}:wall_s"] = s["wall_s"]
        m[f"stage:{name}:pipeline_cpu_s"] = s["cpu_s"].get("pipeline", 0.0)
    return m


def fits(results: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per mode, each metric fitted against N."""
    out: dict[str, dict[str, Any]] = {}
    for mode in sorted({r["mode"] for r in results}):
        runs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["prompts"])
        if len({r["prompts"] for r in runs}) < 2:
            continue
        metrics = [_metrics(r) for r in runs]
        keys = sorted(set().union(*metrics))
        ns = [float(r["prompts"]) for r in runs]
        out[mode] = {}
        for k in keys:
            ys = [float(m.get(k, 0.0)) for m in metrics]
            f = fit_power(ns, ys)
            if f is not None:
                out[mode][k] = f
    return out


def table(results: list[dict[str, Any]]) -> str:
    """The short table printed and pasted into benchmarks/README.md."""
    head = (
        "| mode | prompts | shards | wall s | gen s | tail s (share) | Prefect wall share (upper bound) "
        "| Prefect CPU share | pipeline peak RSS MB | task runs | log lines | work dir MB | Prefect DB MB | S3 MB |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in sorted(results, key=lambda r: (r["mode"], r["prompts"])):
        b = r["bytes"]
        share = r["tail_share_of_generation"]
        lines.append(
            f"| {r['mode']} | {r['prompts']:,} | {r['report'].get('shards')} | {r['wall_s']:.0f} | "
            f"{r['generation_s']:.0f} | {r['last_token_to_manifest_s']:.1f} ({100 * (share or 0):.1f}%) | "
            f"{100 * r['prefect_overhead_wall_share']:.1f}% "
            f"({100 * r.get('prefect_overhead_upper_bound_wall_s', 0) / r['wall_s']:.1f}%) | "
            f"{100 * (r['prefect_cpu_share'] or 0):.1f}% | "
            f"{r['pipeline_peak_rss_mb']:.0f} | {r['task_runs']} | {r.get('flow_run_log_lines', '-')} | "
            f"{b['work_dir'] / 1e6:.0f} | "
            f"{b['prefect_db'] / 1e6:.1f} | {b['dataset_bytes'] / 1e6:.0f} |"
        )
    return "\n".join(lines)


def plot(results: list[dict[str, Any]], path: Path) -> bool:
    """Cost against N (log-log) per mode; False when matplotlib is not installed (the `bench` extra)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    series = [
        ("wall_s", "wall s"),
        ("pipeline_cpu_s", "pipeline CPU s"),
        ("standin_cpu_s", "stand-in CPU s"),
        ("prefect_server_cpu_s", "Prefect server CPU s"),
        ("last_token_to_manifest_s", "last token -> manifest s"),
        ("pipeline_peak_rss_mb", "pipeline peak RSS MB"),
        ("prefect_db_bytes", "Prefect DB MB"),
        ("work_dir_bytes", "work dir MB"),
    ]
    fig, axes = plt.subplots(1, 2, figsize=(12, 5))
    for mode, style in (("embedded", "-o"), ("server", "--s")):
        runs = sorted((r for r in results if r["mode"] == mode), key=lambda r: r["prompts"])
        if not runs:
            continue
        ns = [r["prompts"] for r in runs]
        for i, (key, label) in enumerate(series):
            ys = [_metrics(r)[key] / (1e6 if key.endswith("bytes") else 1) for r in runs]
            ax = axes[0] if i < 5 else axes[1]
            ax.plot(ns, ys, style, label=f"{label} ({mode})", color=f"C{i}")
    for ax, title in zip(axes, ("time", "memory and bytes"), strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("prompts (N)")
        ax.set_title(f"expand-dataset cost against N: {title}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def _machine() -> dict[str, Any]:
    cpu = platform.processor()
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            cpu = line.split(":", 1)[1].strip()
            break
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=REPO_ROOT, capture_output=True, text=True, check=False
    ).stdout.strip()
    dirty = bool(
        subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            check=False,
        ).stdout.strip()
    )
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "commit": commit + ("+dirty" if dirty else ""),
        "date": datetime.now().astimezone().isoformat(timespec="seconds"),
    }


def main(argv: list[str] | None = None) -> int:
    """Run (or merge) measured flow runs, print the table, write JSON (and the plot)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=int, nargs="*", default=[], help="N prompts per run (several: one each).")
    parser.add_argument("--prefect", choices=["embedded", "server", "both"], default="embedded")
    parser.add_argument("--merge", type=Path, nargs="*", default=[], help="Earlier --out files to fit together.")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--plot", type=Path, help="PNG of cost against N (needs the `bench` extra).")
    parser.add_argument("--servers", type=int, default=2, help="Stand-in servers.")
    parser.add_argument("--shard-size", type=int, default=1000)
    parser.add_argument(
        "--step-base-ms", type=float, default=15.0, help="Stand-in decode step time (2: client-bound, see README)."
    )
    parser.add_argument("--keep", action="store_true", help="Keep the run directories (printed).")
    args = parser.parse_args(argv)
    if args.child is not None:
        return child_main(args.child)
    if args.out is None:
        parser.error("--out is required")
    results: list[dict[str, Any]] = []
    for path in args.merge:
        results.extend(json.loads(path.read_text())["runs"])
    if args.prompts:
        from datagen.local.localstack import LocalS3

        modes = ["embedded", "server"] if args.prefect == "both" else [args.prefect]
        root = Path(tempfile.mkdtemp(prefix="datagen-scale-"))
        machine = _machine()  # the commit measured is the one the runs start from
        with LocalS3(root / "s3") as s3:
            for n in args.prompts:
                for mode in modes:
                    print(f"running {n:,} prompts on {mode} Prefect (load {_loadavg()}) ...", flush=True)
                    STANDIN_ENV["DATAGEN_STANDIN_STEP_BASE_MS"] = f"{args.step_base_ms:g}"
                    r = run_once(n, mode, s3, root, args.servers, args.shard_size)
                    r["standin_step_base_ms"] = args.step_base_ms
                    r["machine"] = machine
                    results.append(r)
                    print(table([r]).splitlines()[-1], flush=True)
                    args.out.write_text(json.dumps({"runs": results, "fits": fits(results)}, indent=1))
        if not args.keep:
            subprocess.run(["rm", "-rf", str(root)], check=False)
        else:
            print(f"run directories kept under {root}")
    fitted = fits(results)
    args.out.write_text(json.dumps({"runs": results, "fits": fitted}, indent=1))
    print(table(results))
    for mode, f in fitted.items():
        print(f"\n{mode}: growth exponent b (cost ~ N**b) and extrapolation to 1M prompts")
        for key in ("wall_s", "pipeline_peak_rss_mb", "prefect_server_cpu_s", "prefect_db_bytes", "task_runs"):
            if key in f:
                print(f"  {key:28s} b={f[key]['b']:<6} at 1M: {f[key]['at_1m']:,}")
    if args.plot is not None:
        print(f"plot: {args.plot}" if plot(results, args.plot) else "plot skipped: pip install -e '.[bench]'")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
