"""Launcher building blocks: command lines, key masking, environment, log tails and process-group teardown."""

from __future__ import annotations

import itertools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

from pydantic import SecretStr

from datagen.engine.launcher import (
    arch_args,
    engine_command,
    ephemeral_low,
    free_ports_below_ephemeral,
    launch_flags,
    log_tail,
    mask_command,
    server_command,
    server_env,
    stop_process_group,
)
from datagen.runspec import RunSpec
from datagen.settings import Settings

KEY = SecretStr("k3y-never-shown")
KEY_FILE = Path("/run/datagen/key.yaml")  # command lines only name it


def pid_gone(pid: int) -> bool:
    """True when `pid` no longer runs (absent, or a zombie nobody has reaped yet)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_sglang_command_has_the_recommended_flags_and_flashinfer_on_sm120() -> None:
    settings = Settings(engine="sglang", engine_python="/opt/sglang/bin/python", base_port=30000)
    spec = RunSpec(context_length=65536, server_args=["--disable-radix-cache"])
    argv = server_command(settings, spec, 3, KEY_FILE, nccl_port=41000)
    assert argv[:3] == ["/opt/sglang/bin/python", "-m", "sglang.launch_server"]
    flags = argv[3:]
    pairs = dict(itertools.pairwise(flags))
    assert pairs["--model-path"] == "/dev/shm/Qwen3.6-27B"
    assert pairs["--served-model-name"] == "qwen3.6-27b"
    assert pairs["--host"] == "127.0.0.1"
    assert pairs["--port"] == "30003"
    assert pairs["--config"] == str(KEY_FILE)  # the key is read from this file, never on the command line
    assert not any(f.startswith("--api-key") for f in flags)
    assert pairs["--tp-size"] == "1"
    assert pairs["--reasoning-parser"] == "qwen3"
    assert pairs["--context-length"] == "65536"
    assert pairs["--attention-backend"] == "flashinfer"
    assert pairs["--nccl-port"] == "41000"
    # 0.5.23 rejects it for Qwen3.6 while resolving settings (tests/conformance/test_launch_conformance.py).
    assert "--language-model-only" not in flags
    assert flags[-1] == "--disable-radix-cache"  # the run spec's extra flags come last


def test_standin_gets_the_same_flags_through_this_interpreter() -> None:
    spec = RunSpec()
    sg = Settings(engine="sglang", engine_python="/opt/sglang/bin/python")
    st = Settings(engine="standin", engine_python="/opt/sglang/bin/python")
    assert engine_command(st) == [sys.executable, "-m", "datagen.standin"]
    assert server_command(st, spec, 0, KEY_FILE)[3:] == server_command(sg, spec, 0, KEY_FILE)[3:]


def test_attention_backend_by_architecture() -> None:
    assert arch_args(["12.0"]) == ["--attention-backend", "flashinfer"]
    assert arch_args(["9.0"]) == []  # SGLang's own default elsewhere
    assert arch_args(["10.0"]) == []
    assert arch_args(["12.0"], ["--attention-backend", "triton"]) == []  # the spec's choice wins
    settings = Settings(allowed_compute_capabilities=["9.0"])
    assert "--attention-backend" not in launch_flags(settings, RunSpec(), 30000, KEY_FILE)


def test_nccl_ports_are_free_distinct_and_below_the_ephemeral_range(tmp_path: Path) -> None:
    """Like SGLang's own choice: the kernel never hands such a port to a connection before NCCL binds it."""
    serving = range(30000, 30008)
    ports = free_ports_below_ephemeral(8, exclude=serving)
    assert len(set(ports)) == 8
    assert all(20000 <= p < min(32768, ephemeral_low()) and p not in serving for p in ports)
    for port in ports:
        with socket.socket() as s:
            s.bind(("0.0.0.0", port))  # free on every interface, as NCCL's TCPStore binds it
    custom = tmp_path / "ip_local_port_range"
    custom.write_text("25000\t60999\n")
    assert ephemeral_low(custom) == 25000
    assert ephemeral_low(tmp_path / "absent") == 32768


def test_mask_command_hides_every_form_of_the_key() -> None:
    argv = ["python", "-m", "x", "--api-key", "s1", "--admin-api-key=s2", "--api-k", "s3", "--port", "1"]
    shown = mask_command(argv)
    for secret in ("s1", "s2", "s3"):
        assert secret not in shown.split()
        assert f"={secret}" not in shown
    assert shown == "python -m x --api-key '***' '--admin-api-key=***' --api-k '***' --port 1"


def test_server_env_pins_one_gpu_in_pci_order() -> None:
    env = server_env(5, {"PATH": "/bin", "CUDA_VISIBLE_DEVICES": "0,1,2"})
    assert env["CUDA_VISIBLE_DEVICES"] == "5"
    assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    assert env["PATH"] == "/bin"


def test_log_tail_returns_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 3) == ["line 97", "line 98", "line 99"]
    assert log_tail(tmp_path / "absent.log") == []


def test_stop_process_group_reaches_children_and_sigterm_ignorers() -> None:
    # A leader that ignores SIGTERM and a grandchild in the same group: both must end.
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen(['sleep', '300'])\n"
        "print(child.pid, flush=True)\n"
        "time.sleep(300)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, start_new_session=True)
    try:
        assert proc.stdout is not None
        child_pid = int(proc.stdout.readline())
        assert not pid_gone(child_pid)
        stop_process_group(proc, grace_s=0.5)
        assert proc.returncode == -signal.SIGKILL
        deadline = time.monotonic() + 10
        while not pid_gone(child_pid) and time.monotonic() < deadline:
            time.sleep(0.05)  # the orphaned grandchild is reaped by init, not by us
        assert pid_gone(child_pid)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
