"""Processes by identity: a pid with its start time, so a reused pid is never taken for the process it was."""

from __future__ import annotations

from pathlib import Path

__all__ = ["is_process", "machine_id", "start_ticks"]


def start_ticks(pid: int) -> int | None:
    """The process's start time (clock ticks since boot), None when it is gone or a zombie."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return None if fields[0] == "Z" else int(fields[19])


def is_process(pid: int, start: int | None) -> bool:
    """True while `pid` is the same live process it was (a reused pid has another start time)."""
    return start is not None and start_ticks(pid) == start


def machine_id(hostname: str) -> str:
    """This machine as its processes see it: the host name and the kernel's boot id (a reboot is another)."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = "?"
    return f"{hostname}/{boot}"
