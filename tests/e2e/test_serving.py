"""The serving context against real stand-in processes: a crashed server is restarted and used again; a frozen one
is found hung, its requests finish elsewhere, and nothing is lost or settled twice when it thaws."""

from __future__ import annotations

import concurrent.futures
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from datagen.chat import ChatTokenizer
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.launcher import ServerFleet
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.settings import Settings
from tasks.generation import generate_shard
from tasks.serving import serving
from tests.e2e.test_generation import FAST, SPEC, check_ledger, write_shard

pytestmark = pytest.mark.slow

KEY = SecretStr("test-key-serving")


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return ensure_model_dir()


@pytest.fixture(scope="module")
def chat(model_dir: Path) -> ChatTokenizer:
    return ChatTokenizer.from_model_dir(model_dir)


@pytest.fixture
def standin_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**FAST, "DATAGEN_STANDIN_STEP_BASE_MS": "10"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.delenv("DATAGEN_STANDIN_GPU_ARCH", raising=False)


def settings_for(tmp_path: Path, **fields: object) -> Settings:
    base: dict[str, object] = {
        "engine": "standin",
        "num_servers": 2,
        "base_port": 0,
        "server_start_timeout_s": 120,
        "work_dir": tmp_path / "work",
        "sglang_api_key": KEY,
    }
    return Settings(**(base | fields))  # type: ignore[arg-type]


def server_state(d: Dispatcher, name: str) -> str:
    return {s.name: s.state for s in d.stats().servers}[name]


def wait_until(predicate: Callable[[], bool], timeout_s: float = 300.0) -> None:
    """Poll until true; the limit only ends a test that is broken (never a timing assertion)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition never came true")
        time.sleep(0.05)


@pytest.mark.usefixtures("standin_env")
def test_a_crashed_server_is_restarted_by_the_fleet_and_used_again(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer
) -> None:
    settings = settings_for(tmp_path)
    spec = SPEC.model_copy(update={"model_path": str(model_dir)})
    layout = RunLayout.for_run(settings.work_dir, "serving")
    first, second = write_shard(layout, 1, 150), write_shard(layout, 2, 150)
    with serving(settings, spec, layout) as served, concurrent.futures.ThreadPoolExecutor(1) as pool:
        d, fleet = served.dispatcher, served.fleet
        old_pid = fleet.pids()["gpu1"]
        running = pool.submit(generate_shard, 1, layout, d, chat, spec, 0.2)
        wait_until(lambda: d.stats().completed >= 10)
        os.killpg(old_pid, signal.SIGKILL)  # the crash
        result = running.result(timeout=600)
        # Marked down -> on_server_down=fleet.restart -> a new process -> the dispatcher's probe finds it up.
        wait_until(lambda: fleet.pids().get("gpu1") not in (None, old_pid) and server_state(d, "gpu1") == "up")
        new_pid = fleet.pids()["gpu1"]
        served_before = {s.name: s.completed for s in d.stats().servers}
        again = generate_shard(2, layout, d, chat, spec, flush_interval_s=0.2)
        served_after = {s.name: s.completed for s in d.stats().servers}
    check_ledger(result, first, chat)
    later = check_ledger(again, second, chat)
    assert result.n_completed == 150 and again.n_completed == 150
    assert new_pid != old_pid
    assert "restarting gpu1" in (layout.logs_dir / "server-1.log").read_text()
    assert served_after["gpu1"] > served_before["gpu1"]  # the restarted server takes work again
    assert any(c.server == "gpu1" for c in later)
    assert fleet.pids() == {}  # the block ended: every server stopped


@pytest.fixture
def elsewhere(tmp_path: Path, model_dir: Path, standin_env: None) -> Iterator[ServerFleet]:
    """Two stand-ins managed outside the pipeline (attach mode attaches to them; they are never restarted)."""
    settings = settings_for(tmp_path / "elsewhere")
    spec = SPEC.model_copy(update={"model_path": str(model_dir)})
    with ServerFleet(settings, spec, RunLayout.for_run(settings.work_dir, "servers"), KEY) as fleet:
        yield fleet


def test_a_frozen_server_is_found_hung_its_requests_finish_elsewhere_and_none_is_settled_twice(
    tmp_path: Path, model_dir: Path, chat: ChatTokenizer, elsewhere: ServerFleet
) -> None:
    settings = settings_for(tmp_path, server_urls=[e.url for e in elsewhere])  # default hang timeout (30 s)
    spec = SPEC.model_copy(update={"model_path": str(model_dir)})
    layout = RunLayout.for_run(settings.work_dir, "frozen")
    prompts = write_shard(layout, 1, 300)
    frozen_pid = elsewhere.pids()["gpu0"]
    thawed = False
    with serving(settings, spec, layout) as served, concurrent.futures.ThreadPoolExecutor(1) as pool:
        d = served.dispatcher
        running = pool.submit(generate_shard, 1, layout, d, chat, spec, 0.2)
        wait_until(lambda: d.stats().completed >= 20 and len(d.stats().servers) == 2)
        try:
            os.killpg(frozen_pid, signal.SIGSTOP)
            frozen_at = time.monotonic()
            at_freeze = {s.name: s for s in d.stats().servers}["server-0"]
            wait_until(lambda: server_state(d, "server-0") == "down")
            detected_s = time.monotonic() - frozen_at
            result = running.result(timeout=600)  # finished while server-0 is still frozen
            done_s = time.monotonic() - frozen_at
            # An answer server-0 had sent before the stop landed is still read and counts as done there, not held
            # (a loaded machine's dispatcher thread may not have read it yet when in_flight was counted).
            answered_late = {s.name: s.completed for s in d.stats().servers}["server-0"] - at_freeze.completed
            held = at_freeze.in_flight - answered_late
            assert server_state(d, "server-0") == "down" and server_state(d, "server-1") == "up"
        finally:
            os.killpg(frozen_pid, signal.SIGCONT)
            thawed = True
        wait_until(lambda: server_state(d, "server-0") == "up")  # back, and what it held was settled elsewhere
        wait_until(lambda: d.stats().in_flight == 0)
        stats = d.stats()
    assert thawed
    timing = f"marked down after {detected_s:.1f} s, shard done {done_s:.1f} s after"
    print(f"server frozen holding {held} requests ({answered_late} more answered before the stop): {timing}")
    completions = check_ledger(result, prompts, chat)  # every request exactly once in the checkpoint
    assert result.n_completed == 300 and stats.completed == 300 and stats.failed == 0
    assert held > 0 and stats.requeued >= held
    assert sum(c.server == "server-1" for c in completions) > sum(c.server == "server-0" for c in completions)
