"""Per-shard generation checkpoints: the completions and rejects JSON-lines files, one reader and one writer.

    <work_dir>/runs/<namespace>/shards/shard-NNNNN.completions.jsonl   one `Completion` per line
    <work_dir>/runs/<namespace>/shards/shard-NNNNN.rejects.jsonl       one generation `Reject` per line

Each row carries its `request_key` (datagen.identity): together the two files are an exactly-once ledger of
the shard's requests. The writer (`CheckpointAppender`) hands every record to the OS as one write of the line
and its newline, and fsyncs at least every couple of seconds.

Torn-line policy, implemented here alone and used by every reader (generation's ledger, the pilot's import
and projection, the multi-box exchange and its parts, validation, tokenization's reject reader, the run report)
and every tail-follower (`CheckpointTail`: the live step counts, the multi-box upload of new rows):
    A record is committed by its newline, b"\n" only (a record's text may hold U+2028 and other characters
    `str.splitlines` splits at). Bytes after the last newline are a write a crash cut short (to a
    tail-follower, one still in progress): they are not a record. Readers skip them (with a warning); the
    writer cuts them off (`repair`) before it appends, so the request they belonged to is simply sent again.
    A line that has its newline but is not UTF-8 or not a JSON object is corruption, not a crash:
    `CheckpointError` names the file and line (validation, whose job is to judge lines, turns it into a
    `malformed_record` reject instead, as it does a JSON line that is not a completion).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from datagen.operations.diskspace import full_disk_message

__all__ = [
    "CheckpointAppender",
    "CheckpointError",
    "CheckpointLine",
    "CheckpointTail",
    "append_lines",
    "json_row",
    "lines_of",
    "read_lines",
    "read_rows",
    "repair",
    "settled_keys",
    "summarize",
    "write_lines",
]

logger = logging.getLogger("datagen.checkpoint")


class CheckpointError(RuntimeError):
    """A checkpoint does not belong to this shard, spec or model, or is corrupt."""


def json_row(text: str, where: str) -> dict[str, Any]:
    """A committed line's text as a JSON object; CheckpointError naming `where` (file:line) when it is not one."""
    try:
        row = json.loads(text)
    except ValueError as exc:
        raise CheckpointError(f"{where}: not a JSON object: {exc}") from exc
    if not isinstance(row, dict):
        raise CheckpointError(f"{where}: not a JSON object but a {type(row).__name__}")
    return row


@dataclass(frozen=True, slots=True)
class CheckpointLine:
    """One committed line: where it is (1-based line number, byte offset and length with its newline) and its text."""

    lineno: int
    offset: int
    length: int
    text: str  # without the newline

    def row(self, path: Path | str) -> dict[str, Any]:
        """The line as a JSON object; CheckpointError (file:line) when it is not one."""
        return json_row(self.text, f"{path}:{self.lineno}")


def _committed(raws: Iterable[bytes], where: Path | str, before: int = 0, offset: int = 0) -> Iterator[CheckpointLine]:
    """The torn-line rule over raw lines split at b"\n" (each with its newline), numbered on after line `before` at byte
    `offset`: the committed, non-blank ones; a torn tail (bytes without their newline) ends them, with a warning."""
    for lineno, raw in enumerate(raws, before + 1):
        if not raw.endswith(b"\n"):
            logger.warning("%s: skipping a torn last line (%d bytes) left by a crash", where, len(raw))
            return
        if raw.strip():
            try:
                text = raw[:-1].decode("utf-8")
            except UnicodeDecodeError as exc:
                raise CheckpointError(f"{where}:{lineno}: not UTF-8: {exc}") from exc
            yield CheckpointLine(lineno, offset, len(raw), text)
        offset += len(raw)


def read_lines(path: Path) -> Iterator[CheckpointLine]:
    """Every committed, non-blank line of a checkpoint file (none when it does not exist); a torn tail is skipped."""
    if not path.exists():
        return
    with open(path, "rb") as f:  # a binary file's lines end at b"\n" only
        yield from _committed(f, path)


def lines_of(data: bytes, where: str) -> list[CheckpointLine]:
    """Every committed, non-blank line of checkpoint rows held in memory (an object's bytes), by the same rule."""
    return list(_committed(io.BytesIO(data), where))


class CheckpointTail:
    """Follows one checkpoint file while it grows: each `read` returns the lines committed since the last one.

    Bytes after the last newline are a write in progress (or a torn tail): they wait for a later `read`. A file
    that does not exist yet holds no lines.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0  # bytes read up to and including the last newline
        self._lineno = 0

    def read(self) -> list[CheckpointLine]:
        """The lines committed since the last call (or the start)."""
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        end = chunk.rfind(b"\n") + 1
        lines = list(_committed(io.BytesIO(chunk[:end]), self.path, self._lineno, self.offset))
        self.offset += end
        self._lineno += chunk.count(b"\n", 0, end)
        return lines


def read_rows(path: Path) -> Iterator[dict[str, Any]]:
    """Every committed line as a JSON object (see read_lines); CheckpointError on a corrupt one."""
    for line in read_lines(path):
        yield line.row(path)


def settled_keys(path: Path, what: str) -> set[str]:
    """Request keys a checkpoint file settles; CheckpointError when a row has none or one appears twice."""
    keys: set[str] = set()
    for line in read_lines(path):
        key = line.row(path).get("request_key")
        if not isinstance(key, str):
            raise CheckpointError(f"{path}:{line.lineno}: a {what} row has no request_key")
        if key in keys:
            raise CheckpointError(f"{path}:{line.lineno}: request {key[:12]}… appears twice")
        keys.add(key)
    return keys


def summarize(path: Path) -> tuple[int, int, str]:
    """Rows, output tokens (`completion_tokens`) and sha256 of the committed lines of a completions file."""
    digest = hashlib.sha256()
    rows = tokens = 0
    for line in read_lines(path):
        digest.update(line.text.encode("utf-8") + b"\n")
        rows += 1
        tokens += int(line.row(path)["completion_tokens"])
    return rows, tokens, digest.hexdigest()


def repair(path: Path) -> int:
    """Cut a torn tail (bytes after the last newline) off a checkpoint file; returns how many bytes went."""
    if not path.exists():
        return 0
    with open(path, "r+b") as f:
        size = f.seek(0, os.SEEK_END)
        if size == 0:
            return 0
        # Look back from the end for the last newline, a block at a time (a torn line is one record at most).
        end, block = size, 1 << 16
        while end > 0:
            start = max(0, end - block)
            f.seek(start)
            nl = f.read(end - start).rfind(b"\n")
            if nl >= 0:
                keep = start + nl + 1
                break
            end = start
        else:
            keep = 0
        if keep == size:
            return 0
        logger.warning("%s: cutting a torn last line (%d bytes) left by a crash", path, size - keep)
        f.truncate(keep)
        os.fsync(f.fileno())
        return size - keep


def _naming(exc: OSError, path: Path) -> OSError:
    """The same error, naming the checkpoint (a write's ENOSPC names no file) and, for a full disk, what to do."""
    named = OSError(exc.errno, exc.strerror, str(path))
    return OSError(exc.errno, full_disk_message(named, path.parent) or f"{exc.strerror}: {path}", str(path))


class CheckpointAppender:
    """Appends records to a checkpoint file (after `repair`); fsyncs when asked and at least every `interval_s`."""

    def __init__(self, path: Path, interval_s: float) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        repair(path)
        self.path = path
        self._f: IO[str] = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed in close())
        self._interval_s = interval_s
        self._last = time.monotonic()
        self._dirty = False

    def write(self, line: str) -> None:
        # Flushed per line: a killed process (SIGKILL, OOM) loses nothing it recorded, only a machine crash
        # can lose the last interval's lines. One write syscall per completion is noise next to the request.
        try:
            self._f.write(line + "\n")
            self._f.flush()
        except OSError as exc:
            raise _naming(exc, self.path) from exc
        self._dirty = True

    def sync_if_due(self) -> None:
        if self._dirty and time.monotonic() - self._last >= self._interval_s:
            self.sync()

    def sync(self) -> None:
        try:
            self._f.flush()
            os.fsync(self._f.fileno())
        except OSError as exc:
            raise _naming(exc, self.path) from exc
        self._dirty = False
        self._last = time.monotonic()

    def close(self) -> None:
        self.sync()
        self._f.close()


def append_lines(target: Path, lines: Iterable[CheckpointLine]) -> int:
    """Append committed lines (of another checkpoint file) to `target`, repaired first; returns how many."""
    todo = list(lines)
    if not todo:
        return 0
    target.parent.mkdir(parents=True, exist_ok=True)
    repair(target)
    with open(target, "ab") as out:
        for line in todo:
            out.write(line.text.encode("utf-8") + b"\n")
        out.flush()
        os.fsync(out.fileno())
    return len(todo)


def write_lines(path: Path, lines: Iterable[str]) -> None:
    """Replace a checkpoint file with these lines at once (temp file + rename): a reader never sees half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            for line in lines:
                f.write(line + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
