"""Provisioning against real stand-in servers, started through the same launcher code path as SGLang.

Every test checks that nothing it started is left running, and a fixture kills leftovers if a test fails.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from datagen.engine.launcher import PortInUseError, ServerFleet, ServerStartError
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.runspec import RunSpec
from datagen.settings import Settings
from tasks.provisioning import api_key_for, new_api_key, provision, stop_leftover_servers

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
KEY = SecretStr("test-key-7f3a")


def pid_gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def free_base_port(n: int) -> int:
    """A port p such that p .. p+n-1 are all free right now."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + n > 65535:
            continue
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                socks.append(s)
                s.bind(("127.0.0.1", p))
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError("no run of free ports found")


@pytest.fixture
def leftovers() -> Iterator[list[int]]:
    """Process-group ids a test started; any still alive at teardown are killed (and fail no other test)."""
    pgids: list[int] = []
    yield pgids
    for pgid in pgids:
        # Only groups still led by what we started (pids are reused; other engineers share this machine).
        try:
            cmdline = Path(f"/proc/{pgid}/cmdline").read_bytes()
        except FileNotFoundError:
            continue
        if not pid_gone(pgid) and (b"datagen.standin" in cmdline or b"flow_like.py" in cmdline):
            os.killpg(pgid, signal.SIGKILL)


@pytest.fixture
def fast_standin(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DATAGEN_STANDIN_LOAD_S", "0")
    monkeypatch.setenv("DATAGEN_STANDIN_WARMUP_S", "0.3")  # keep a real 503 phase before 200
    monkeypatch.delenv("DATAGEN_STANDIN_GPU_ARCH", raising=False)


def make(tmp_path: Path, n: int, **overrides: Any) -> tuple[Settings, RunSpec, RunLayout]:
    fields: dict[str, Any] = {
        "engine": "standin",
        "num_servers": n,
        "base_port": free_base_port(n),
        "server_start_timeout_s": 120,
        "work_dir": tmp_path,
    }
    settings = Settings(**{**fields, **overrides})
    spec = RunSpec(model_path=str(ensure_model_dir()), context_length=32768)
    return settings, spec, RunLayout.for_run(tmp_path, "test")


def healthy(url: str) -> bool:
    try:
        return httpx.get(f"{url}/health", timeout=10).status_code == 200
    except httpx.HTTPError:
        return False


@pytest.mark.usefixtures("fast_standin")
def test_fleet_starts_servers_restarts_a_dead_one_and_stops_all(tmp_path: Path, leftovers: list[int]) -> None:
    settings, spec, layout = make(tmp_path, 3)
    with provision(settings, spec, layout, KEY) as fleet:
        pids = fleet.pids()
        leftovers.extend(pids.values())
        assert [e.name for e in fleet] == ["gpu0", "gpu1", "gpu2"]
        assert fleet.endpoints == list(fleet)
        for i, endpoint in enumerate(fleet):
            assert endpoint.url == f"http://127.0.0.1:{settings.base_port + i}"
            assert endpoint.max_running_requests == 64  # the stand-in's /server_info default
            assert endpoint.api_key == KEY
            assert healthy(endpoint.url)
        assert fleet.engine_version == "0.5.23"
        # The key protects the servers, and never reaches a line the pipeline writes. (The server's own log holds
        # it, as real SGLang logs its settings, key included: tests/e2e/test_secret_redaction.py guards what is shown.)
        info = httpx.get(f"{fleet[0].url}/server_info", timeout=10)
        assert info.status_code == 401
        log = (layout.logs_dir / "server-1.log").read_text()
        ours = [line for line in log.splitlines() if line.startswith("# ")]
        assert any("CUDA_VISIBLE_DEVICES=1" in line and "--config " in line for line in ours)
        assert not any(KEY.get_secret_value() in line for line in ours)

        os.killpg(pids["gpu1"], signal.SIGKILL)  # a crashed server
        deadline = time.monotonic() + 30
        while healthy(fleet[1].url) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not healthy(fleet[1].url)
        fleet.restart(fleet.endpoint("gpu1"))  # as the dispatcher's on_server_down calls it
        new_pid = fleet.pids()["gpu1"]
        leftovers.append(new_pid)
        assert new_pid != pids["gpu1"]
        assert healthy(fleet.endpoint("gpu1").url)
        assert fleet.endpoint("gpu1").max_running_requests == 64
        assert "restarting gpu1" in (layout.logs_dir / "server-1.log").read_text()
        all_pids = [*pids.values(), new_pid]
    assert all(pid_gone(p) for p in all_pids)
    assert fleet.pids() == {}
    assert not any(healthy(f"http://127.0.0.1:{settings.base_port + i}") for i in range(3))


@pytest.mark.usefixtures("fast_standin")
@pytest.mark.parametrize("raised", [RuntimeError("shard failed"), KeyboardInterrupt()])
def test_servers_stop_when_the_block_raises_or_is_interrupted(
    tmp_path: Path, leftovers: list[int], raised: BaseException
) -> None:
    settings, spec, layout = make(tmp_path, 1)
    pids: list[int] = []
    with pytest.raises(type(raised)), provision(settings, spec, layout, KEY) as fleet:
        pids.extend(fleet.pids().values())
        leftovers.extend(pids)
        assert pids and not any(pid_gone(p) for p in pids)
        raise raised
    assert pids and all(pid_gone(p) for p in pids)


def start_flow_like(
    tmp_path: Path, settings: Settings, leftovers: list[int]
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """A process that provisions `settings.num_servers` stand-ins and then sleeps (as a flow run would generate)."""
    pid_file = tmp_path / "pids.json"
    script = tmp_path / "flow_like.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import json, time
            from pathlib import Path
            from pydantic import SecretStr
            from datagen.layout import RunLayout
            from datagen.local.model_fixture import ensure_model_dir
            from datagen.runspec import RunSpec
            from datagen.settings import Settings
            from tasks.provisioning import provision

            settings = Settings(engine="standin", num_servers={settings.num_servers}, base_port={settings.base_port},
                                server_start_timeout_s=120, work_dir={str(settings.work_dir)!r})
            spec = RunSpec(model_path=str(ensure_model_dir()), context_length=32768)
            with provision(settings, spec, RunLayout.for_run(settings.work_dir, "t"), SecretStr("k")) as fleet:
                Path({str(pid_file)!r}).write_text(json.dumps(list(fleet.pids().values())))
                time.sleep(600)
            """
        )
    )
    parent = subprocess.Popen([sys.executable, str(script)], cwd=REPO, start_new_session=True)
    leftovers.append(parent.pid)
    deadline = time.monotonic() + 120
    while not pid_file.exists() and parent.poll() is None and time.monotonic() < deadline:
        time.sleep(0.2)
    if not pid_file.exists():
        parent.kill()
        parent.wait()
        pytest.fail(f"parent exited with {parent.returncode} before its servers were up")
    pids: list[int] = json.loads(pid_file.read_text())
    leftovers.extend(pids)
    assert len(pids) == settings.num_servers and not any(pid_gone(p) for p in pids)
    return parent, pids


@pytest.mark.usefixtures("fast_standin")
def test_sigterm_to_the_parent_stops_its_servers(tmp_path: Path, leftovers: list[int]) -> None:
    settings, _, _ = make(tmp_path, 2)
    parent, pids = start_flow_like(tmp_path, settings, leftovers)
    try:
        parent.send_signal(signal.SIGTERM)  # what a Prefect worker does to cancel a flow run
        assert parent.wait(timeout=90) == 128 + signal.SIGTERM
        assert all(pid_gone(p) for p in pids)
        assert stop_leftover_servers(settings) == []  # a clean stop leaves no record behind
    finally:
        if parent.poll() is None:
            parent.kill()
            parent.wait()


@pytest.mark.usefixtures("fast_standin")
def test_servers_of_a_killed_pipeline_are_stopped_by_the_next_run_and_live_ones_never(
    tmp_path: Path, leftovers: list[int]
) -> None:
    settings, spec, layout = make(tmp_path, 2)
    parent, pids = start_flow_like(tmp_path, settings, leftovers)
    parent.kill()  # SIGKILL: no teardown runs, the servers survive their pipeline
    parent.wait()
    time.sleep(1.0)
    assert not any(pid_gone(p) for p in pids)
    urls = [f"http://127.0.0.1:{settings.base_port + i}" for i in range(2)]
    assert all(healthy(u) for u in urls)

    # The next run on the box, while another pipeline (this process) has live servers of its own.
    other, _, _ = make(tmp_path, 1)
    with provision(other, spec, layout, KEY) as live:
        leftovers.extend(live.pids().values())
        stopped = stop_leftover_servers(settings)
        assert sorted(line.split(" ")[0] for line in stopped) == ["gpu0", "gpu1"]
        assert all(pid_gone(p) for p in pids)
        assert not any(healthy(u) for u in urls)
        assert healthy(live[0].url)  # a live pipeline's servers are not leftovers
        assert stop_leftover_servers(settings) == []
    assert list((tmp_path / "fleets").glob("*.json")) == []


@pytest.mark.parametrize(
    ("engine", "server_args", "gpu_arch", "expected"),
    [
        ("standin", ["--attention-backend", "fa3"], "12.0", "backends are supported on Blackwell GPUs"),
        ("standin", ["--schedule-policy", "no_buffer"], None, "invalid choice"),  # an allowed flag, a bad value
        ("sglang", [], None, "No module named 'sglang'"),  # the SGLang path, in an env without SGLang
    ],
)
def test_a_server_that_dies_at_startup_raises_with_its_log(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    leftovers: list[int],
    engine: str,
    server_args: list[str],
    gpu_arch: str | None,
    expected: str,
) -> None:
    monkeypatch.setenv("DATAGEN_STANDIN_LOAD_S", "0")
    if gpu_arch:
        monkeypatch.setenv("DATAGEN_STANDIN_GPU_ARCH", gpu_arch)
    settings, spec, layout = make(tmp_path, 2, engine=engine, engine_python=sys.executable)
    spec = spec.model_copy(update={"server_args": server_args})
    fleet = provision(settings, spec, layout, KEY)
    with pytest.raises(ServerStartError) as info, fleet:
        pytest.fail("the fleet must not come up")
    message = str(info.value)
    assert "exited with code" in message
    assert "last" in message and "log lines" in message
    assert expected in message
    assert KEY.get_secret_value() not in message
    assert fleet.pids() == {}


def test_a_server_that_never_gets_healthy_times_out_with_its_log(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, leftovers: list[int]
) -> None:
    monkeypatch.setenv("DATAGEN_STANDIN_LOAD_S", "600")  # the port stays closed all along
    settings, spec, layout = make(tmp_path, 1, server_start_timeout_s=3)
    fleet = provision(settings, spec, layout, KEY)
    with pytest.raises(ServerStartError, match=r"did not become healthy within 3 s \(port closed\)") as info:
        fleet.start()
    assert "datagen: starting gpu0" in str(info.value)  # the log tail is in the message
    assert fleet.pids() == {}


def test_a_port_already_in_use_fails_before_anything_starts(tmp_path: Path) -> None:
    settings, spec, layout = make(tmp_path, 2)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", settings.base_port + 1))
        busy.listen()
        with pytest.raises(PortInUseError, match=f"port {settings.base_port + 1} already answers"):
            provision(settings, spec, layout, KEY).start()
    assert not (layout.logs_dir / "server-0.log").exists()  # nothing was launched


@pytest.mark.usefixtures("fast_standin")
def test_chosen_ports_taken_before_start_are_chosen_again(tmp_path: Path, leftovers: list[int]) -> None:
    settings, spec, layout = make(tmp_path, 2, base_port=0)
    fleet = provision(settings, spec, layout, KEY)
    chosen = fleet.settings.base_port
    assert 20000 <= chosen < chosen + 1 < 32768  # below the kernel's ephemeral range
    with socket.socket() as squatter:  # another process takes a chosen port between planning and start
        squatter.bind(("127.0.0.1", chosen + 1))
        squatter.listen()
        with fleet:
            leftovers.extend(fleet.pids().values())
            assert fleet.settings.base_port != chosen
            assert [e.url for e in fleet] == [f"http://127.0.0.1:{fleet.settings.base_port + i}" for i in range(2)]
            assert all(healthy(e.url) for e in fleet)


def test_a_key_that_starts_with_a_dash_is_refused_before_any_server_starts(tmp_path: Path) -> None:
    # token_urlsafe keys start with "-" one time in 64; "--api-key -x..." made argparse exit 2 (a CI failure).
    # SGLang's --config merge (how servers get the key) always passes it as a separate argument.
    settings, spec, layout = make(tmp_path, 1)
    with pytest.raises(ValueError, match="must not start with '-'"), provision(settings, spec, layout, SecretStr("-x")):
        pytest.fail("no server may start")
    assert not layout.logs_dir.exists() or not list(layout.logs_dir.glob("*.log"))
    with pytest.raises(ValueError, match="DATAGEN_SGLANG_API_KEY must not start with '-'"):
        Settings(sglang_api_key=SecretStr("-dash-first-key"))
    assert all(not new_api_key().get_secret_value().startswith("-") for _ in range(2000))


@pytest.mark.usefixtures("fast_standin")
def test_attach_mode_checks_health_and_never_stops_the_servers(tmp_path: Path, leftovers: list[int]) -> None:
    owner_settings, spec, layout = make(tmp_path, 1)
    with ServerFleet(owner_settings, spec, layout, KEY) as owner:  # "managed elsewhere"
        leftovers.extend(owner.pids().values())
        url = owner[0].url
        attach = Settings(engine="sglang", server_urls=[url + "/"], work_dir=tmp_path)
        with provision(attach, spec, layout, KEY) as fleet:
            assert fleet.pids() == {}
            assert [(e.name, e.url, e.max_running_requests) for e in fleet] == [("server-0", url, 64)]
            fleet.restart("server-0")  # only waits for health
        fleet.stop()
        assert healthy(url)
        assert not any(pid_gone(p) for p in owner.pids().values())


@pytest.mark.usefixtures("fast_standin")
def test_stop_ends_a_restart_still_waiting_for_a_dead_attached_server(tmp_path: Path, leftovers: list[int]) -> None:
    # The dispatcher runs restart() in an executor thread that the interpreter joins at exit: a wait that stop()
    # does not end kept the pipeline alive past its flow's end (32 s measured, issue 24).
    owner_settings, spec, layout = make(tmp_path, 1)
    owner = ServerFleet(owner_settings, spec, layout, KEY)
    owner.start()
    leftovers.extend(owner.pids().values())
    attach = Settings(engine="sglang", server_urls=[owner[0].url], work_dir=tmp_path)
    fleet = ServerFleet(attach, spec, layout, KEY, attach_timeout_s=3600.0)
    fleet.start()
    owner.stop()  # the attached server dies
    waiting = threading.Thread(target=fleet.restart, args=("server-0",), daemon=True)
    waiting.start()
    waiting.join(timeout=1.0)
    assert waiting.is_alive(), "restart() returned although its server is dead"
    fleet.stop()
    waiting.join(timeout=120)  # hang guard: without the fix it waits out attach_timeout_s (an hour)
    assert not waiting.is_alive(), "stop() did not end the restart's wait"


def test_attach_mode_fails_on_a_dead_url(tmp_path: Path) -> None:
    port = free_base_port(1)
    settings = Settings(server_urls=[f"http://127.0.0.1:{port}"], work_dir=tmp_path)
    fleet = ServerFleet(settings, RunSpec(), RunLayout.for_run(tmp_path, "t"), KEY, attach_timeout_s=1.0)
    with pytest.raises(ServerStartError, match=r"server-0 did not become healthy within 1 s \(port closed\)"):
        fleet.start()


def test_api_key_for_prefers_the_configured_key() -> None:
    assert api_key_for(Settings(sglang_api_key=SecretStr("abc"))).get_secret_value() == "abc"
    a, b = api_key_for(Settings()), api_key_for(Settings())
    assert a.get_secret_value() != b.get_secret_value() and len(a.get_secret_value()) >= 24
