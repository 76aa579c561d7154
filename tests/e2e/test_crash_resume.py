"""SIGKILL the expand-dataset flow mid-generation, run it again: every prompt once, only unrecorded work redone.

The flow runs as a real separate process (its own ephemeral Prefect server under a private PREFECT_HOME) and
starts its own stand-in servers. A SIGKILL cannot be intercepted, so those servers outlive it: the test finds
them by the run's work dir in their environment, reads their request counters, then kills them, as an
operator would before restarting the run.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from datasets import load_dataset

from datagen.identity import PromptIdentity
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.publishing.storage import ObjectStore
from datagen.records import Message
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec

pytestmark = pytest.mark.slow

N_PROMPTS = 48
SHARD_SIZE = 8
NUM_SERVERS = 2
SLOTS = 4  # running requests per server: small, so generation runs in many waves and the kill lands mid-run
KILL_AFTER = 12  # settled requests in the checkpoints before the SIGKILL
NAMESPACE = "crash_v1"
REPO_ROOT = Path(__file__).resolve().parents[2]

# Runs one flow and writes what the generation stage reported per shard (the `shard N done` log records'
# arguments: shard, completed, rejected, sent now, output tokens) next to the flow's report.
RUNNER = textwrap.dedent(
    """
    import json, logging, sys
    from flows.expand_dataset import expand_dataset
    from datagen.runspec import RunSpec

    done = []

    class Collect(logging.Handler):
        def emit(self, record):
            if record.msg.startswith("shard %d done"):
                done.append(dict(zip(("shard", "completed", "rejected", "sent", "tokens"), record.args)))

    gen_log = logging.getLogger("datagen.generation")
    gen_log.setLevel(logging.INFO)
    gen_log.addHandler(Collect())
    spec = RunSpec.model_validate_json(open(sys.argv[1]).read())
    report = expand_dataset(spec)
    with open(sys.argv[2], "w") as f:
        json.dump({"report": report, "shards": done}, f)
    """
)


def _messages(i: int) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"Question {i}: why is {i} + {i} equal to {2 * i}? Explain briefly."}]


def _env(local_s3: LocalS3, tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(local_s3.env())
    env.update(
        {
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
            "DATAGEN_S3_PREFIX": f"crash-{tmp_path.name}/",
            "DATAGEN_ENGINE": "standin",
            "DATAGEN_NUM_SERVERS": str(NUM_SERVERS),
            "DATAGEN_BASE_PORT": "0",
            "DATAGEN_SKIP_GPU_CHECKS": "true",
            "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
            "DATAGEN_WORK_DIR": str(tmp_path / "work"),
            # Prompts and models in temporary directories: the roots tests/conftest.py names.
            "DATAGEN_DATA_ROOTS": os.environ["DATAGEN_DATA_ROOTS"],
            "DATAGEN_MODEL_ROOTS": os.environ["DATAGEN_MODEL_ROOTS"],
            "DATAGEN_SERVER_START_TIMEOUT_S": "180",
            # ~25 tokens/s per request: a mean output of 80 tokens takes ~3 s, the whole set ~40 s.
            "DATAGEN_STANDIN_LENGTH_MEAN": "80",
            "DATAGEN_STANDIN_LENGTH_MAX": "240",
            "DATAGEN_STANDIN_STEP_BASE_MS": "40",
            "DATAGEN_STANDIN_TOKENS_PER_STEP": "4",
            "PYTHONUNBUFFERED": "1",
        }
    )
    return env


def _marked(work_dir: Path) -> list[int]:
    """Pids of processes started (directly or not) by a flow run on `work_dir`: the flow's by its environment, the
    servers' (which inherit only an allow-listed environment) by their key file under the work dir."""
    marker = f"DATAGEN_WORK_DIR={work_dir}".encode()
    key_dir = f"{work_dir}/fleets/".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        with contextlib.suppress(OSError):
            if marker in (entry / "environ").read_bytes().split(b"\0") or key_dir in (entry / "cmdline").read_bytes():
                found.append(int(entry.name))
    return found


def _kill_all(work_dir: Path) -> None:
    """SIGKILL every process group holding a process of this run, until none is left."""
    for _ in range(50):
        pids = _marked(work_dir)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.2)
    raise AssertionError(f"processes of {work_dir} survive SIGKILL: {_marked(work_dir)}")


@contextlib.contextmanager
def _cleanup(work_dir: Path) -> Iterator[None]:
    try:
        yield
    finally:
        _kill_all(work_dir)


def _settled(shards_dir: Path) -> int:
    """Complete (newline-terminated) rows in every shard checkpoint: completions plus generation rejects."""
    total = 0
    for path in [*shards_dir.glob("*.completions.jsonl"), *shards_dir.glob("*.rejects.jsonl")]:
        with contextlib.suppress(FileNotFoundError):
            total += path.read_bytes().count(b"\n")
    return total


def _standin_ports(work_dir: Path) -> list[int]:
    ports = []
    for pid in _marked(work_dir):
        with contextlib.suppress(OSError):
            argv = (Path("/proc") / str(pid) / "cmdline").read_bytes().split(b"\0")
            if b"datagen.standin" in argv and b"--port" in argv:
                ports.append(int(argv[argv.index(b"--port") + 1]))
    return ports


def _port_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _metric(text: str, name: str) -> float:
    match = re.search(rf"^sglang:{name}\{{[^}}]*\}} (\S+)$", text, re.MULTILINE)
    assert match, f"/metrics has no sglang:{name}"
    return float(match.group(1))


def _drained_counters(port: int, timeout_s: float = 120.0) -> dict[str, float]:
    """A server's request counters once nothing runs or waits on it any more."""
    deadline = time.monotonic() + timeout_s
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        busy = _metric(text, "num_running_reqs") + _metric(text, "num_queue_reqs")
        if busy == 0:
            return {k: _metric(text, k) for k in ("num_requests_total", "num_aborted_requests_total")}
        assert time.monotonic() < deadline, f"server on port {port} still has {busy} requests"
        time.sleep(0.2)


def _run_flow(env: dict[str, str], spec_path: Path, out: Path, log: Path) -> subprocess.Popen[bytes]:
    with open(log, "ab") as log_file:
        return subprocess.Popen(
            [sys.executable, "-c", RUNNER, str(spec_path), str(out)],
            cwd=REPO_ROOT,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # one group with its ephemeral Prefect server: one killpg ends both
        )


def _tail(log: Path) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-40:])


def test_sigkill_mid_generation_then_rerun_yields_every_prompt_once(local_s3: LocalS3, tmp_path: Path) -> None:
    model_dir = ensure_model_dir()
    prompts = tmp_path / "crashy.jsonl"
    prompts.write_text("".join(json.dumps({"messages": _messages(i)}) + "\n" for i in range(N_PROMPTS)))
    spec = RunSpec(
        sources=[PromptSource(path=str(prompts))],
        model_path=str(model_dir),
        namespace=NAMESPACE,
        turns="last",
        shard_size=SHARD_SIZE,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=1024),
        quality_gate=QualityGate(max_reject_rate=0.5, min_median_completion_tokens=16),
        server_args=["--max-running-requests", str(SLOTS), "--enable-metrics"],
    )
    spec_path = tmp_path / "spec.json"
    spec_path.write_text(spec.model_dump_json())
    env = _env(local_s3, tmp_path)
    work_dir = Path(env["DATAGEN_WORK_DIR"])
    shards_dir = work_dir / "runs" / NAMESPACE / "shards"
    log = tmp_path / "flow.log"

    with _cleanup(work_dir):
        # Run 1: killed once the checkpoints hold some results and before they hold all.
        first = _run_flow(env, spec_path, tmp_path / "first.json", log)
        deadline = time.monotonic() + 600
        while _settled(shards_dir) < KILL_AFTER:
            assert first.poll() is None, f"the first run ended before the kill:\n{_tail(log)}"
            assert time.monotonic() < deadline, f"no {KILL_AFTER} results within 600 s:\n{_tail(log)}"
            time.sleep(0.05)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
        settled_at_kill = _settled(shards_dir)
        assert settled_at_kill < N_PROMPTS, "generation finished before the kill: slow the stand-in down"

        # The servers outlive the flow; the disconnect aborted what was still running or queued on them.
        ports = _standin_ports(work_dir)
        assert len(ports) == NUM_SERVERS, f"expected {NUM_SERVERS} orphaned stand-ins, found ports {ports}"
        counters = [_drained_counters(port) for port in ports]
        received_first = int(sum(c["num_requests_total"] for c in counters))
        aborted_at_kill = int(sum(c["num_aborted_requests_total"] for c in counters))

        # Run 2: the same flow, same spec, a fresh process and fresh servers; it first stops run 1's orphans.
        second = _run_flow(env, spec_path, tmp_path / "second.json", log)
        try:
            rc = second.wait(timeout=900)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the second run did not finish within 900 s:\n{_tail(log)}")
        assert rc == 0, f"the second run failed (exit {rc}):\n{_tail(log)}"
        assert log.read_text().count("left running by a pipeline that was killed") >= NUM_SERVERS, _tail(log)
        assert not any(_port_answers(port) for port in ports), "run 1's servers outlived run 2"
    outcome: dict[str, Any] = json.loads((tmp_path / "second.json").read_text())

    # Requests the second run sent: only what the ledger did not hold. Sent in run 1 but unrecorded is what
    # was in flight at the kill (the servers' own count of what they received says how much that was).
    sent_second = sum(int(s["sent"]) for s in outcome["shards"])
    in_flight_at_kill = received_first - settled_at_kill
    never_sent_first = N_PROMPTS - received_first
    redone = sent_second - never_sent_first
    assert aborted_at_kill > 0, "nothing was running at the kill: the test did not kill mid-generation"
    assert 0 < sent_second <= N_PROMPTS - settled_at_kill
    assert redone <= in_flight_at_kill
    assert received_first >= settled_at_kill + aborted_at_kill

    # The published dataset: every prompt exactly once across data and rejects.
    store = ObjectStore.from_settings(local_s3.settings(s3_prefix=env["DATAGEN_S3_PREFIX"]))
    local = tmp_path / "download"
    for obj in store.list(f"{NAMESPACE}/"):
        target = local / obj.key
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(store.get_bytes(obj.key))
    data_files = sorted(str(p) for p in (local / NAMESPACE / "data").glob("*.parquet"))
    reject_files = sorted(str(p) for p in (local / NAMESPACE / "rejects").glob("*.parquet"))
    shipped = list(load_dataset("parquet", data_files=data_files)["train"]["prompt_id"])
    rejected = list(load_dataset("parquet", data_files=reject_files)["train"]["prompt_id"]) if reject_files else []
    identity = PromptIdentity.for_spec(spec)  # ids follow the rendered tokens
    expected = {
        identity.prompt_id(prompts.stem, [Message.from_dict(m) for m in _messages(i)]) for i in range(N_PROMPTS)
    }
    everything = shipped + rejected
    assert len(everything) == len(set(everything)) == N_PROMPTS, "a prompt is duplicated or missing"
    assert set(everything) == expected
    assert outcome["report"]["prompts"] == N_PROMPTS
    assert outcome["report"]["rows"] == len(shipped) > 0
