"""Say which disk filled up and what to do about it: `OSError: [Errno 28] No space left on device` names no path."""

from __future__ import annotations

import errno
import shutil
from pathlib import Path

__all__ = ["full_disk", "full_disk_message"]


def full_disk(exc: BaseException) -> OSError | None:
    """The ENOSPC / EDQUOT error behind exc (itself, or on its cause/context chain), or None."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        if isinstance(current, OSError) and current.errno in (errno.ENOSPC, errno.EDQUOT):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def _usage(path: Path) -> str:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent  # the file that could not be written may not exist: its filesystem does
    try:
        usage = shutil.disk_usage(probe)
    except OSError:
        return "free space unknown"
    return f"{usage.free / 1e9:.2f} GB free of {usage.total / 1e9:.1f} GB on the filesystem of {probe}"


def full_disk_message(exc: BaseException, work_dir: Path) -> str | None:
    """One line naming the path (or the work dir holding it), the space left and what to do; None if not ENOSPC."""
    error = full_disk(exc)
    if error is None:
        return None
    path = Path(str(error.filename)) if error.filename else Path(work_dir).resolve()
    where = f"writing {path}" if error.filename else f"writing under the work dir {path} (DATAGEN_WORK_DIR)"
    quota = " (disk quota exceeded)" if error.errno == errno.EDQUOT else ""
    return (
        f"no space left on device{quota} {where}: {_usage(path)}. Free space there, or set DATAGEN_WORK_DIR to a "
        "larger disk and move the run's directory there, then run again with the same namespace: finished shards "
        "and checkpoints are kept, torn checkpoint lines are dropped by name"
    )
