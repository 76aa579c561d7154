"""Fault injection for tests: `DATAGEN_FAULT_KILL_AT=<point>` makes the process SIGKILL itself at that point.

Inert unless the variable is set (it is read at each point, never cached). Only tests set it, to stop a real
pipeline process at an exact step of a publish; production settings never carry it. The points:

    publish.after-claim        publish-claim.json is written, no data file yet
    publish.after-first-file   one staged file is uploaded (others may be in flight: they die with the process)
    publish.after-manifest     manifest.json is written; the catalog part is not
    catalog.before-part        the catalog part is built and about to be written
    generate.mid-conversation  (turns: every) a step line is written, its conversation's next step not yet sent

`DATAGEN_FAULT_KILL_AFTER=N` (default 1) kills at the N-th time the process reaches the point, so a test can let
some work happen first.
"""

from __future__ import annotations

import collections
import os
import signal

__all__ = ["KILL_AFTER_ENV", "KILL_AT_ENV", "POINTS", "kill_point"]

KILL_AT_ENV = "DATAGEN_FAULT_KILL_AT"
KILL_AFTER_ENV = "DATAGEN_FAULT_KILL_AFTER"
POINTS = frozenset(
    {
        "publish.after-claim",
        "publish.after-first-file",
        "publish.after-manifest",
        "catalog.before-part",
        "generate.mid-conversation",
    }
)
_reached: collections.Counter[str] = collections.Counter()


def kill_point(point: str) -> None:
    """SIGKILL this process if DATAGEN_FAULT_KILL_AT names `point`; otherwise do nothing."""
    if point not in POINTS:
        raise ValueError(f"unknown fault point {point!r}")
    if os.environ.get(KILL_AT_ENV) == point:
        _reached[point] += 1
        if _reached[point] >= int(os.environ.get(KILL_AFTER_ENV) or 1):
            os.kill(os.getpid(), signal.SIGKILL)
