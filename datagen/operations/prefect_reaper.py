"""Embedded Prefect servers that outlive a killed pipeline: recorded by the pipeline, stopped by the next run.

Without PREFECT_API_URL a flow run starts a temporary Prefect server (uvicorn, `SubprocessASGIServer`) and stops
it at interpreter exit. A SIGKILLed pipeline runs no exit handler, so its server keeps running (and holding
its SQLite database). The pipeline writes `<work_dir>/prefect-servers/<pid>-<start>.json` with its own pid and
start time and its server's; the next run stops a recorded server whose pipeline is gone, and only if the pid
still has the recorded start time. Nothing is ever found by scanning process names: other users' and other
pipelines' Prefect servers on the same box are never touched.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from datagen.engine.launcher import STOP_GRACE_S, _start_ticks, reap_recorded

__all__ = ["RECORDS_DIR", "reap_orphaned_prefect_servers", "record_embedded_prefect_server"]

logger = logging.getLogger(__name__)

RECORDS_DIR = "prefect-servers"  # under Settings.work_dir


def record_embedded_prefect_server(work_dir: Path) -> Path | None:
    """Record this process's embedded Prefect server (if it runs one) under `work_dir`; the record's path."""
    try:
        from prefect.server.api.server import SubprocessASGIServer
    except ImportError:  # pragma: no cover - prefect is a core dependency
        return None
    servers = [
        s
        for s in list(SubprocessASGIServer._instances.values())
        if s.server_process is not None and s.server_process.poll() is None
    ]
    if not servers:
        return None  # PREFECT_API_URL points at a server managed elsewhere (or a test harness in another process)
    me, my_start = os.getpid(), _start_ticks(os.getpid())
    record = {
        "owner": {"pid": me, "start": my_start},
        "servers": {
            f"prefect-{s.port}": {
                "pid": s.server_process.pid,
                "start": _start_ticks(s.server_process.pid),
                "url": f"http://127.0.0.1:{s.port}",
            }
            for s in servers
            if s.server_process is not None
        },
    }
    path = work_dir / RECORDS_DIR / f"{me}-{my_start}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(record, indent=1))
    tmp.replace(path)
    return path


def reap_orphaned_prefect_servers(work_dir: Path, grace_s: float = STOP_GRACE_S) -> list[str]:
    """Stop recorded embedded Prefect servers whose pipeline process has died; one line per server stopped.

    Records of pipelines still alive are left alone; records whose servers are already gone are removed.
    """
    # Only the pid: the embedded server shares the dead pipeline's process group.
    return reap_recorded(work_dir / RECORDS_DIR, "Prefect server record", os.kill, grace_s)
