"""A SIGKILLed pipeline's embedded Prefect server (and its generation servers) are stopped by the next run.

The pipeline is a real `expand-dataset` run in its own process on embedded Prefect (no PREFECT_API_URL), with
stand-in servers slow enough that it is still generating when it is killed.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from datagen.engine.launcher import _start_ticks
from datagen.local.localstack import LocalS3
from datagen.local.model_fixture import ensure_model_dir
from datagen.operations.prefect_reaper import RECORDS_DIR, reap_orphaned_prefect_servers
from datagen.settings import Settings
from tasks.provisioning import stop_leftover_servers

pytestmark = pytest.mark.slow

REPO_ROOT = Path(__file__).resolve().parents[2]

PIPELINE = """
import sys
from datagen.runspec import PromptSource, RunSpec, SamplingSpec
from flows.expand_dataset import expand_dataset
expand_dataset(RunSpec(sources=[PromptSource(path=sys.argv[1])], model_path=sys.argv[2], namespace="reaper_v1",
               shard_size=20, context_length=8192, sampling=SamplingSpec(max_new_tokens=1024)))
"""


def _alive(pid: int) -> bool:
    return _start_ticks(pid) is not None


def _wait_for(
    predicate: Callable[[], object], timeout: float, what: str, proc: subprocess.Popen[bytes], log: Path
) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            pytest.fail(f"pipeline exited with {proc.returncode} before {what}:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {what} after {timeout:.0f} s:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)


def test_embedded_prefect_server_of_a_sigkilled_pipeline_is_stopped_by_the_next_run(
    local_s3: LocalS3, tmp_path: Path
) -> None:
    work = tmp_path / "work"
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(
        "".join(json.dumps({"messages": [{"role": "user", "content": f"Question {i}?"}]}) + "\n" for i in range(400))
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "DATAGEN_"))}
    env.update(local_s3.env())
    env.update(
        {
            "DATAGEN_S3_PREFIX": f"reaper-{tmp_path.name}/",
            "DATAGEN_ENGINE": "standin",
            "DATAGEN_NUM_SERVERS": "1",
            "DATAGEN_BASE_PORT": "0",
            "DATAGEN_SKIP_GPU_CHECKS": "true",
            "DATAGEN_REQUIRE_TMPFS_MODEL": "false",
            "DATAGEN_WORK_DIR": str(work),
            # Prompts and models in temporary directories: the roots tests/conftest.py names.
            "DATAGEN_DATA_ROOTS": os.environ["DATAGEN_DATA_ROOTS"],
            "DATAGEN_MODEL_ROOTS": os.environ["DATAGEN_MODEL_ROOTS"],
            "DATAGEN_SERVER_START_TIMEOUT_S": "180",
            "DATAGEN_STANDIN_STEP_BASE_MS": "50",  # slow: the run is still generating when it is killed
            "PREFECT_HOME": str(tmp_path / "prefect-home"),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "180",
        }
    )
    log = tmp_path / "pipeline.log"
    records: list[Path] = []
    server_pids: list[int] = []
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", PIPELINE, str(prompts), str(ensure_model_dir())],
            cwd=REPO_ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:
        _wait_for(lambda: list((work / "fleets").glob("*.json")), 300, "generation servers", proc, log)
        records = list((work / RECORDS_DIR).glob("*.json"))
        assert len(records) == 1, "the pipeline recorded its embedded Prefect server before starting servers"
        record = json.loads(records[0].read_text())
        assert record["owner"]["pid"] == proc.pid
        (server,) = record["servers"].values()
        server_pids.append(server["pid"])
        fleet = json.loads(next((work / "fleets").glob("*.json")).read_text())
        server_pids.extend(int(s["pid"]) for s in fleet["servers"].values())

        proc.send_signal(signal.SIGKILL)  # no teardown runs: atexit handlers and finally blocks are skipped
        proc.wait(timeout=30)
        time.sleep(1.0)
        assert all(_alive(pid) for pid in server_pids), "the servers outlive a SIGKILLed pipeline"
        assert httpx.get(f"{server['url']}/api/health", timeout=10).json() is True

        # The next run on the box (same work dir): its first step stops both kinds of leftovers.
        settings = Settings(work_dir=work, server_urls=[])
        stopped = stop_leftover_servers(settings)
        assert any(line.startswith("prefect-") and str(server["pid"]) in line for line in stopped), stopped
        assert any(line.startswith("gpu0") for line in stopped), stopped
        assert not any(_alive(pid) for pid in server_pids)
        with pytest.raises(httpx.HTTPError):
            httpx.get(f"{server['url']}/api/health", timeout=5)
        assert list((work / RECORDS_DIR).glob("*.json")) == []
        assert stop_leftover_servers(settings) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in server_pids:  # only processes this test's pipeline started, named by its own records
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)


def test_records_of_live_pipelines_and_reused_pids_are_left_alone(tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "300"])
    try:
        records = tmp_path / RECORDS_DIR
        records.mkdir()
        me = {"pid": os.getpid(), "start": _start_ticks(os.getpid())}
        dead_owner = {"pid": sleeper.pid, "start": -1}  # a pid whose start time differs: not the recorded process
        server = {"pid": sleeper.pid, "start": _start_ticks(sleeper.pid), "url": "http://127.0.0.1:1"}
        reused = {"pid": sleeper.pid, "start": -1, "url": "http://127.0.0.1:2"}
        (records / "live.json").write_text(json.dumps({"owner": me, "servers": {"prefect-1": server}}))
        (records / "reused.json").write_text(json.dumps({"owner": dead_owner, "servers": {"prefect-2": reused}}))
        (records / "torn.json").write_text('{"owner": ')

        assert reap_orphaned_prefect_servers(tmp_path) == []
        assert sleeper.poll() is None, "a live pipeline's server and a reused pid are never signalled"
        assert (records / "live.json").exists() and (records / "torn.json").exists()
        assert not (records / "reused.json").exists()  # its server is gone (pid reused): the record is dropped
    finally:
        sleeper.kill()
        sleeper.wait()
