"""Prompt sources streamed as prompts: local JSONL/JSON/parquet files, directories of them, Hugging Face datasets.

Every row read becomes exactly one `Prompt` or one load `Reject` whose detail says where and what is wrong
(`file:line` for JSON lines and JSON lists, `file:row N` for parquet and `datasets` rows). Problems that are
not about a row (missing file, unsupported file type, a dataset that cannot be opened) raise
`PromptSourceError` before anything is read, so a bad config fails fast.

Formats, detected per row unless the source names one:
- ShareGPT: `{"conversations": [{"from": "human"|"gpt"|"system", "value": str}, ...]}`
- OpenAI: `{"messages": [{"role": "user"|"assistant"|"system", "content": str | [{"type": "text", "text": str}]}]}`
- Alpaca: `{"instruction": str, "input": str?, "output": ignored, "system": str?}`

Tool turns, assistant tool calls and a row's `tools` list (OpenAI and ShareGPT forms): datagen.sources.tool_turns.
A trailing assistant turn is dropped (it is what we regenerate; with a ShareGPT call turn after it, both);
earlier turns and a leading system prompt are kept; the last kept turn must be a user or tool turn.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
from array import array
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from datagen.identity import (
    LOAD_REJECT_KEY_PREFIX,
    PromptIdentity,
    legacy_load_reject_key,
    load_reject_key,
    prompt_id_from_messages,
)
from datagen.records import Message, Prompt, Reject, Role
from datagen.runspec import PromptSource
from datagen.sources.preparation import Unsendable
from datagen.sources.tool_turns import (
    CALL_SPEAKERS,
    RESULT_SPEAKERS,
    TOOL_REJECT_REASONS,
    close_calls,
    row_tools,
    turn_message,
)

__all__ = [
    "LOAD_REJECT_KEY_PREFIX",
    "LOAD_REJECT_REASONS",
    "LOCAL_SUFFIXES",
    "LoadReject",
    "PromptSourceError",
    "iter_prompts",
]

# A load reject's `request_key` (datagen.identity.load_reject_key): "row:" + a hash of its reason and the row's
# content, so a later expansion over the same source (grown, renamed, split, reordered) knows this row was rejected
# and published before.

log = logging.getLogger(__name__)

LOCAL_SUFFIXES = (".jsonl", ".json", ".parquet")

# Every reason a row can be rejected with at load time (the `reason` of a load `Reject`).
LOAD_REJECT_REASONS = frozenset(
    {
        "invalid_json",
        "unreadable_rest",
        "invalid_utf8",
        "not_an_object",
        "unknown_format",
        "missing_field",
        "wrong_type",
        "empty_conversation",
        "empty_user_content",
        "empty_assistant_content",
        "unknown_role",
        "non_text_content",
        "system_not_first",
        "multiple_system",
        "no_user_turn",
        "last_turn_not_user",
        "duplicate_prompt",
        "template_error",
        "prompt_too_long",
        "bad_category",
        "invalid_unicode",
        "prompt_decode_mismatch",
        *TOOL_REJECT_REASONS,
    }
)
# A category value is copied into the dataset, its card and the UI: a short plain label, never markup or control text.
_CATEGORY_RE = re.compile(r"^\w[\w .:/+&()-]{0,63}$")

_USER_ROLES = frozenset({"human", "user"})
_ASSISTANT_ROLES = frozenset({"gpt", "assistant", "chatgpt", "model"})
# OpenAI's "developer" role is its newer name for the system prompt.
_SYSTEM_ROLES = frozenset({"system", "developer"})
# Hub ids are "name" or "owner/name"; anything else that does not exist locally is a missing local path.
_HUB_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*(/[A-Za-z0-9][A-Za-z0-9_.-]*)?$")
_WS_RE = re.compile(r"[ \t\r\n]*")

_JSON_CHUNK_CHARS = 1 << 20
# A single row of a JSON list larger than this is taken as a broken file rather than read on into memory.
_JSON_MAX_ROW_CHARS = 64 << 20
_PARQUET_BATCH_ROWS = 1024


class PromptSourceError(ValueError):
    """A prompt source cannot be read at all (missing path, unsupported file type, dataset not loadable)."""


class _RowError(Unsendable):
    """One row is not a usable prompt; becomes a load `Reject` with this reason (like an unsendable one)."""


@dataclass(frozen=True, slots=True)
class _Unreadable:
    """A row whose bytes could not be parsed (it still counts as a row and gets a reject)."""

    reason: str
    message: str
    # The row's own text, for its reject key (where it sits is no part of it); None: the message stands for it.
    content: str | None = None


class LoadReject(Reject):
    """A load `Reject` with what planning matches against the rows published before (held in memory only).

    `legacy_content`: what the key the code before issue 47 gave the row hashed besides its label and index
    (datagen.identity.legacy_load_reject_key, KnownRejects.holds); for a `duplicate_prompt`, `alias` and
    `rendered`: the prompt's other id and its whole rendered ids (datagen.identity.KnownPrompts.holds), so a
    duplicate of a published prompt is skipped as published.
    """

    __slots__ = ("alias", "legacy_content", "rendered")

    def __init__(self, *args: Any, legacy_content: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.legacy_content = legacy_content
        self.alias: str | None = None
        self.rendered: array[int] | None = None

    @property
    def legacy_key(self) -> str:
        """The key the code before issue 47 gave this row."""
        return legacy_load_reject_key(self.source, self.row or 0, self.legacy_content)


@dataclass(frozen=True, slots=True)
class _LostRest:
    """The rest of a file cannot be split into rows: at least `n_lost` rows are lost after `n_before` read."""

    n_lost: int
    n_before: int
    message: str
    digest: str = ""  # of the unreadable text (what its rows' reject keys hash, not where it starts)


@dataclass(frozen=True, slots=True)
class _Unit:
    """One stream of rows: a file, a saved dataset or a hub dataset, with the source label its rows get."""

    label: str
    rows: Callable[[], Iterator[tuple[str, Any]]]  # yields (where, row or _Unreadable)


def iter_prompts(
    sources: list[PromptSource], base_dir: Path | None = None, identity: PromptIdentity | None = None
) -> Iterator[Prompt | Reject]:
    """Stream every row of `sources`, in order, as a Prompt or a load Reject (config errors raise first).

    With `identity` (every run: datagen.identity), prompt ids (and so duplicates) follow the rendered token ids
    and each Prompt carries its ids; without, the messages (code with no model at hand, e.g. loader tests).
    """
    # Resolve every source before reading any row: a typo in the third source should fail before
    # the first two have been streamed into shards.
    resolved = [(source, _resolve(source, base_dir)) for source in sources]
    return _stream(resolved, identity)


def _stream(
    resolved: list[tuple[PromptSource, list[_Unit]]], identity: PromptIdentity | None
) -> Iterator[Prompt | Reject]:
    seen = _Seen()
    for source, units in resolved:
        n_read = 0
        next_row: dict[str, int] = {}
        for unit in units:
            if source.max_rows is not None and n_read >= source.max_rows:
                break
            for where, raw in unit.rows():
                if isinstance(raw, _LostRest):
                    if not source.allow_partial_read:
                        raise PromptSourceError(
                            f"prompt source {source.path!r}: {where}: {raw.message}; at least {raw.n_lost} "
                            f"row(s) after it cannot be read ({raw.n_before} row(s) read before it). Fix the "
                            "file, or set allow_partial_read on this source to keep the rows before the break "
                            "and record the rest as rejects"
                        )
                    for k in range(raw.n_lost):
                        row = next_row.get(unit.label, 0)
                        next_row[unit.label] = row + 1
                        n_read += 1
                        lost = _Unreadable(
                            "unreadable_rest",
                            f"{raw.message}; lost row {k + 1} of {raw.n_lost}",
                            f"{raw.digest}\0{k}",
                        )
                        yield _to_prompt(source, unit.label, row, where, lost, seen, identity)
                    break
                row = next_row.get(unit.label, 0)
                next_row[unit.label] = row + 1
                n_read += 1
                yield _to_prompt(source, unit.label, row, where, raw, seen, identity)
                if source.max_rows is not None and n_read >= source.max_rows:
                    break


def _to_prompt(
    source: PromptSource,
    label: str,
    row: int,
    where: str,
    raw: Any,
    seen: _Seen,
    identity: PromptIdentity | None,
) -> Prompt | Reject:
    source_id = _source_id(raw)
    alias: str | None = None
    try:
        if isinstance(raw, _Unreadable):
            raise _RowError(raw.reason, raw.message)
        if not isinstance(raw, dict):
            raise _RowError("not_an_object", f"row is a JSON {type(raw).__name__}, expected an object")
        messages = _messages(raw, source.format, identity is not None and identity.discards_recorded_replies)
        tools = row_tools(raw, source.tools)
        category = _category(raw, source.category_field)
        input_ids, normalized = None, None
        if identity is not None:
            # The messages as the model sees them (normalized like the tokenizer normalizes) are what ships.
            found = identity.identify(label, messages, tools)
            prompt_id, alias, duplicate_key = found.prompt_id, found.alias, found.duplicate_key
            view = found.view
            messages, normalized, input_ids = view.messages, view.normalized, array("i", view.ids)
        else:
            prompt_id = prompt_id_from_messages(label, messages, tools)
            duplicate_key = prompt_id_from_messages("", messages, tools).encode("ascii")
    except Unsendable as err:  # _RowError included
        return _load_reject(label, row, where, raw, err.reason, err.detail, source_id)
    first = seen.first(label, duplicate_key)
    if first is not None:
        same = (
            f"same prompt as an earlier row of source {label!r} (prompt id {prompt_id})"
            if first == label
            else f"same prompt as a row of source {first!r}, planned once under that source (prompt id {prompt_id})"
        )
        duplicate = _load_reject(label, row, where, raw, "duplicate_prompt", same, source_id, prompt_id)
        duplicate.alias, duplicate.rendered = alias, input_ids
        return duplicate
    prompt = Prompt(
        prompt_id=prompt_id,
        source=label,
        row=row,
        messages=messages,
        category=category,
        location=where,
        normalized=normalized,
        tools=tools,
        source_id=source_id,
    )
    prompt.input_ids = input_ids  # the render its id came from: planning keeps it for generation
    prompt.alias = alias
    return prompt


def _load_reject(
    label: str,
    row: int,
    where: str,
    raw: Any,
    reason: str,
    detail: str,
    source_id: str | None,
    prompt_id: str | None = None,
) -> LoadReject:
    content = _row_content(raw)
    legacy = f"{raw.reason}\0{raw.message}" if isinstance(raw, _Unreadable) else content
    return LoadReject(
        stage="load",
        reason=reason,
        detail=f"{where}: {detail}",
        source=label,
        row=row,
        prompt_id=prompt_id,
        location=where,
        request_key=load_reject_key(reason, content),
        source_id=source_id,
        legacy_content=legacy,
    )


def _row_content(raw: Any) -> str:
    """The row as its reject key hashes it: its JSON (keys sorted), or the text of a row that does not parse."""
    if isinstance(raw, _Unreadable):
        return f"{raw.reason}\0{raw.content if raw.content is not None else raw.message}"
    return json.dumps(raw, sort_keys=True, ensure_ascii=False, default=str)


def _source_id(raw: Any) -> str | None:
    """The row's own `id` (a string or an integer, as text), to trace what is published back to it."""
    if not isinstance(raw, dict):
        return None
    value = raw.get("id")
    if isinstance(value, bool) or not isinstance(value, str | int):
        return None
    return str(value)


class _Seen:
    """The prompts read so far, by content without the source label: one prompt in two sources is one prompt."""

    def __init__(self) -> None:
        self._labels: list[str] = []
        self._label_no: dict[str, int] = {}
        self._first: dict[bytes, int] = {}  # content digest -> the first source's label number

    def first(self, label: str, content: bytes) -> str | None:
        """The label of the source that holds this prompt already (None: it is new, and now recorded as `label`'s)."""
        digest = hashlib.blake2b(content, digest_size=16).digest()
        if (no := self._first.get(digest)) is not None:
            return self._labels[no]
        if label not in self._label_no:
            self._label_no[label] = len(self._labels)
            self._labels.append(label)
        self._first[digest] = self._label_no[label]
        return None


# ---------------------------------------------------------------------------------------------------------------
# Resolving sources to row streams


def _resolve(source: PromptSource, base_dir: Path | None) -> list[_Unit]:
    path = Path(source.path).expanduser()
    if not path.is_absolute() and base_dir is not None:
        path = base_dir / path
    if path.is_file():
        return [_file_unit(path, source.name or path.stem)]
    if path.is_dir():
        if _is_saved_dataset(path):
            return [_saved_dataset_unit(path, source)]
        return _dir_units(path, source)
    if path.suffix.lower() in LOCAL_SUFFIXES or not _HUB_ID_RE.match(source.path):
        raise PromptSourceError(f"prompt source {source.path!r}: no such file or directory ({path})")
    return [_hub_unit(source, path)]


def _file_unit(path: Path, label: str) -> _Unit:
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _Unit(label, lambda: _read_jsonl(path))
    if suffix == ".json":
        return _Unit(label, lambda: _read_json(path))
    if suffix == ".parquet":
        return _Unit(label, lambda: _read_parquet(path))
    raise PromptSourceError(
        f"prompt source {str(path)!r}: unsupported file type {path.suffix!r} "
        f"(expected one of {', '.join(LOCAL_SUFFIXES)})"
    )


def _dir_units(path: Path, source: PromptSource) -> list[_Unit]:
    files = sorted(
        (
            p
            for p in path.rglob("*")
            if p.is_file()
            and p.suffix.lower() in LOCAL_SUFFIXES
            and not any(part.startswith(".") for part in p.relative_to(path).parts)
        ),
        key=lambda p: p.relative_to(path).as_posix(),
    )
    if not files:
        raise PromptSourceError(
            f"prompt source {source.path!r}: directory {path} holds no {', '.join(LOCAL_SUFFIXES)} files"
        )
    # Without a name each file is its own source (label = path inside the directory without its suffix),
    # so a directory of mixed sets still reports its mix per set.
    return [_file_unit(p, source.name or p.relative_to(path).with_suffix("").as_posix()) for p in files]


def _is_saved_dataset(path: Path) -> bool:
    """A directory written by `datasets` save_to_disk (a Dataset or a DatasetDict)."""
    return (path / "dataset_dict.json").is_file() or (
        (path / "state.json").is_file() and (path / "dataset_info.json").is_file()
    )


def _saved_dataset_unit(path: Path, source: PromptSource) -> _Unit:
    import datasets

    try:
        loaded = datasets.load_from_disk(str(path))
    except Exception as exc:  # datasets raises several unrelated types for unreadable directories
        raise PromptSourceError(f"prompt source {source.path!r}: cannot load saved dataset {path}: {exc}") from exc
    if isinstance(loaded, datasets.DatasetDict):
        if source.split not in loaded:
            raise PromptSourceError(
                f"prompt source {source.path!r}: saved dataset {path} has no split {source.split!r} "
                f"(splits: {', '.join(sorted(loaded))})"
            )
        loaded = loaded[source.split]
    where = str(path)
    return _Unit(source.name or path.stem, lambda: _read_dataset_rows(loaded, where))


def _hub_unit(source: PromptSource, local: Path) -> _Unit:
    import datasets

    try:
        loaded = datasets.load_dataset(source.path, split=source.split, streaming=True)
    except Exception as exc:  # hub, network, split and builder errors all mean "cannot open this source"
        raise PromptSourceError(
            f"prompt source {source.path!r}: not a local file or directory ({local}) and not loadable as a "
            f"Hugging Face dataset (split {source.split!r}): {type(exc).__name__}: {exc}"
        ) from exc
    where = f"{source.path}[{source.split}]"
    return _Unit(source.name or source.path, lambda: _read_dataset_rows(loaded, where))


# ---------------------------------------------------------------------------------------------------------------
# Readers: each yields (where, row) with `where` exact enough to find the row by hand.


def _read_jsonl(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open("rb") as f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue  # blank lines are not rows
            where = f"{path}:{lineno}"
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                message = f"line is not UTF-8 ({exc.reason} at byte {exc.start})"
                text = raw.rstrip(b"\r\n").decode("utf-8", "backslashreplace")
                yield where, _Unreadable("invalid_utf8", message, text)
                continue
            if lineno == 1:
                text = text.removeprefix("\ufeff")
            try:
                yield where, json.loads(text)
            except json.JSONDecodeError as exc:
                yield where, _Unreadable("invalid_json", f"invalid JSON: {exc.msg} (column {exc.colno})", text.strip())


def _read_json(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        head = f.read(4096).lstrip(" \t\r\n")
    if head.startswith("["):
        yield from _read_json_array(path)
    else:
        # Not a list: the file holds JSON lines (a common mislabelling of .jsonl files).
        yield from _read_jsonl(path)


def _read_json_array(path: Path) -> Iterator[tuple[str, Any]]:
    with path.open(encoding="utf-8-sig", newline="") as f:
        yield from _JsonArrayReader(f, str(path)).rows()


# Characters that matter to the tolerant scan used to skip a broken row (inside and outside strings).
_SCAN_OUTSIDE_RE = re.compile(r'["{}\[\],\n]')
_SCAN_INSIDE_RE = re.compile(r'["\\\n]')
_CLOSERS = {"}": "{", "]": "["}
_BLANK_RE = re.compile(r"[ \t\r]*")


class _JsonArrayReader:
    """Streams the elements of one top-level JSON list without loading the file, tracking line numbers.

    A syntax error inside one element makes that element one `_Unreadable` row and reading goes on at the
    next element: found by a string- and bracket-aware scan to the element's closing ',' or, when that scan
    cannot be trusted (a string broken by a newline, unbalanced brackets), at the next line that opens a
    row at the broken row's indentation. When neither finds the next row, the rest is a `_LostRest`.
    """

    def __init__(self, f: IO[str], name: str) -> None:
        self._f = f
        self._name = name
        self._decoder = json.JSONDecoder()
        self._buf = ""
        self._pos = 0
        self._line = 1  # line number of self._buf[self._pos]
        self._eof = False
        # Text of the current line that a refill dropped from the buffer: its length, and whether all blank.
        self._dropped_len = 0
        self._dropped_blank = True
        self._n_rows = 0

    def rows(self) -> Iterator[tuple[str, Any]]:
        """Yield (where, element) per list element; see the class docstring for broken rows."""
        if self._peek() != "[":
            yield f"{self._name}:{self._line}", _Unreadable("invalid_json", "expected a JSON list of rows")
            return
        self._pos += 1
        if self._peek() == "]":
            self._pos += 1
        else:
            while True:
                where = f"{self._name}:{self._line}"
                column, at_line_start = self._column()
                start, start_line = self._pos, self._line
                try:
                    value = self._decode()
                except json.JSONDecodeError as exc:
                    line = self._line + self._buf.count("\n", self._pos, exc.pos)
                    message = f"invalid JSON at line {line}: {exc.msg}"
                    begin = self._pos  # the row's start (a refill while decoding moved it to the buffer's start)
                    if not self._skip_broken(column if at_line_start else None):
                        self._pos, self._line = start, start_line
                        yield where, self._lost_rest(message)
                        return
                    self._n_rows += 1
                    text = self._buf[begin : self._pos].strip().rstrip(",").strip()
                    yield where, _Unreadable("invalid_json", f"{message}; row skipped up to line {self._line}", text)
                else:
                    self._n_rows += 1
                    yield where, value
                nxt = self._peek()
                if nxt == ",":
                    self._pos += 1
                    if self._peek() == "]":  # a trailing comma: tolerated, no row is lost to it
                        self._pos += 1
                        break
                    continue
                if nxt == "]":
                    self._pos += 1
                    break
                if nxt in ("{", "[", '"'):
                    continue  # a missing ',' between two rows: both rows are still read
                found = repr(nxt) if nxt else "end of file"
                if not nxt:
                    yield f"{self._name}:{self._line}", _Unreadable("invalid_json", "file ends before the closing ']'")
                    return
                # Stray text between rows: read on from it as if a (broken) row started there.
                log.warning("%s:%d: expected ',' or ']' after a row, found %s", self._name, self._line, found)
        if self._peek():
            yield f"{self._name}:{self._line}", _Unreadable("invalid_json", "unexpected data after the closing ']'")

    def _column(self) -> tuple[int, bool]:
        """Column of the current position and whether only whitespace precedes it on its line."""
        nl = self._buf.rfind("\n", 0, self._pos)
        before = self._buf[nl + 1 : self._pos]
        if nl >= 0:
            return len(before), not before.strip()
        return self._dropped_len + len(before), self._dropped_blank and not before.strip()

    def _skip_broken(self, column: int | None) -> bool:
        """Move past a row that does not parse, to the ',' or ']' after it or to the next row; False if lost."""
        end, clean = self._scan_row()
        if end is not None and (clean or column is None):
            self._advance_to(end)
            return True
        if column is not None and self._next_row_line(column):
            return True
        if end is not None:
            self._advance_to(end)
            return True
        return False

    def _scan_row(self) -> tuple[int | None, bool]:
        """Tolerant scan from a row's start to the ',' or ']' that ends it: (its position or None, trustworthy)."""
        stack: list[str] = []
        clean = True
        pos = self._pos
        in_string = False
        while True:
            pattern = _SCAN_INSIDE_RE if in_string else _SCAN_OUTSIDE_RE
            m = pattern.search(self._buf, pos)
            if m is None:
                if len(self._buf) - self._pos > _JSON_MAX_ROW_CHARS or not self._more():
                    return None, False
                continue
            ch, pos = m.group(), m.end()
            if in_string:
                if ch == '"':
                    in_string = False
                elif ch == "\\":
                    if pos >= len(self._buf) and not self._more():
                        return None, False
                    pos += 1
                else:  # a raw newline cannot be inside a JSON string: the string is broken, go on after it
                    in_string, clean = False, False
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                stack.append(ch)
            elif ch in "}]":
                if ch == "]" and not stack:
                    return pos - 1, clean  # the list's own closing bracket
                if not stack or stack[-1] != _CLOSERS[ch]:
                    clean = False
                if _CLOSERS[ch] in stack:
                    while stack.pop() != _CLOSERS[ch]:
                        pass
            elif ch == "," and not stack:
                return pos - 1, clean

    def _next_row_line(self, column: int) -> bool:
        """Move to the next line that opens a row at `column` (or closes the list further left); False at EOF."""
        pos = self._pos
        while True:
            nl = self._buf.find("\n", pos)
            if nl < 0:
                if len(self._buf) - self._pos > _JSON_MAX_ROW_CHARS or not self._more():
                    return False
                continue
            start = nl + 1
            while True:
                m = _BLANK_RE.match(self._buf, start)
                first = m.end() if m else start
                if first < len(self._buf) or self._eof or not self._more():
                    break
            if first >= len(self._buf):
                return False
            ch, col = self._buf[first], first - start
            if (col == column and ch in "{[") or (col < column and ch == "]"):
                self._advance_to(first)
                return True
            pos = start

    def _more(self) -> bool:
        """Append the next chunk without moving the buffer (scans hold positions into it); False at EOF."""
        if self._eof:
            return False
        chunk = self._f.read(_JSON_CHUNK_CHARS)
        if not chunk:
            self._eof = True
            return False
        self._buf += chunk
        return True

    def _advance_to(self, end: int) -> None:
        self._line += self._buf.count("\n", self._pos, end)
        self._pos = end

    def _lost_rest(self, message: str) -> _LostRest:
        """The rest of the file cannot be split into rows: count at least the row here plus rows ',' closes."""
        n_lost = 1
        depth = 0
        in_string = False
        pos = self._pos
        # A lower bound: top-level ',' outside strings (as far as strings can be told apart) end rows.
        while True:
            m = (_SCAN_INSIDE_RE if in_string else _SCAN_OUTSIDE_RE).search(self._buf, pos)
            if m is None:
                if self._eof or not self._fill_all():
                    break
                continue
            ch, pos = m.group(), m.end()
            if in_string:
                if ch == '"' or ch == "\n":
                    in_string = False
                elif ch == "\\":
                    pos += 1
            elif ch == '"':
                in_string = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth = max(0, depth - 1)
            elif ch == "," and depth == 0:
                n_lost += 1
        lines = self._buf.count("\n", self._pos) + 1
        return _LostRest(
            n_lost,
            self._n_rows,
            f"{message}; the rest of the file ({lines} line(s) from line {self._line}) cannot be read",
            hashlib.sha256(self._buf[self._pos :].encode("utf-8", "surrogatepass")).hexdigest(),
        )

    def _fill_all(self) -> bool:
        # Only for counting lost rows: bounded, a broken file is not read into memory without limit.
        return len(self._buf) - self._pos <= _JSON_MAX_ROW_CHARS and self._more()

    def _fill(self) -> bool:
        """Append the next chunk (at least as large as what is buffered, so big rows take few reads)."""
        chunk = self._f.read(max(_JSON_CHUNK_CHARS, len(self._buf) - self._pos))
        if not chunk:
            self._eof = True
            return False
        dropped = self._buf[: self._pos]
        nl = dropped.rfind("\n")
        if nl >= 0:
            self._dropped_len, self._dropped_blank = len(dropped) - nl - 1, not dropped[nl + 1 :].strip()
        else:
            self._dropped_len += len(dropped)
            self._dropped_blank = self._dropped_blank and not dropped.strip()
        self._buf = self._buf[self._pos :] + chunk
        self._pos = 0
        return True

    def _peek(self) -> str:
        """Skip whitespace; the next character, or "" at end of file."""
        while True:
            match = _WS_RE.match(self._buf, self._pos)
            end = match.end() if match else self._pos
            self._line += self._buf.count("\n", self._pos, end)
            self._pos = end
            if self._pos < len(self._buf):
                return self._buf[self._pos]
            if self._eof or not self._fill():
                return ""

    def _decode(self) -> Any:
        while True:
            try:
                value, end = self._decoder.raw_decode(self._buf, self._pos)
            except json.JSONDecodeError:
                # Maybe only cut off at the buffer's end: read on, unless the row is already absurdly large.
                if self._eof or len(self._buf) - self._pos > _JSON_MAX_ROW_CHARS or not self._fill():
                    raise
                continue
            # A number at the buffer's end may continue in the next chunk: decode again with more text.
            if end < len(self._buf) or self._eof or not self._fill():
                self._line += self._buf.count("\n", self._pos, end)
                self._pos = end
                return value


def _read_parquet(path: Path) -> Iterator[tuple[str, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise PromptSourceError(f"prompt source file {path}: not a readable parquet file: {exc}") from exc
    row = 0
    with parquet:
        for batch in parquet.iter_batches(batch_size=_PARQUET_BATCH_ROWS):
            for value in batch.to_pylist():
                yield f"{path}:row {row}", value
                row += 1


def _read_dataset_rows(rows: Iterable[Any], where: str) -> Iterator[tuple[str, Any]]:
    for i, value in enumerate(rows):
        yield f"{where}:row {i}", value


# ---------------------------------------------------------------------------------------------------------------
# Row -> messages


def _messages(row: dict[str, Any], fmt: str, replies_discarded: bool = False) -> list[Message]:
    if fmt == "auto":
        fmt = _detect(row)
    if fmt == "sharegpt":
        turns = _turns(row, "conversations", ("from", "value"), ("role", "content"))
    elif fmt == "openai":
        turns = _turns(row, "messages", ("role", "content"), None)
    else:
        turns = _alpaca_turns(row)
    return _conversation(turns, replies_discarded)


def _detect(row: dict[str, Any]) -> str:
    for field, fmt in (("conversations", "sharegpt"), ("messages", "openai"), ("instruction", "alpaca")):
        if row.get(field) is not None:
            return fmt
    keys = ", ".join(sorted(map(str, row))[:12]) or "none"
    raise _RowError(
        "unknown_format",
        f"no 'conversations' (ShareGPT), 'messages' (OpenAI) or 'instruction' (Alpaca) field (keys: {keys})",
    )


# A turn before validation: (role, raw content, where in the row, the raw turn for role-specific checks).
_Turn = tuple[Role, Any, str, dict[str, Any]]


def _turns(row: dict[str, Any], field: str, keys: tuple[str, str], alt_keys: tuple[str, str] | None) -> list[_Turn]:
    if field not in row or row[field] is None:
        raise _RowError("missing_field", f"no {field!r} field")
    conv = row[field]
    if not isinstance(conv, list):
        raise _RowError("wrong_type", f"{field!r} must be a list of turns, got {type(conv).__name__}")
    turns: list[_Turn] = []
    for i, turn in enumerate(conv):
        label = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise _RowError("wrong_type", f"{label} must be an object, got {type(turn).__name__}")
        role_key, content_key = keys
        # Some ShareGPT exports use OpenAI's keys inside "conversations"; accept them when "from" is absent.
        if role_key not in turn and alt_keys is not None and alt_keys[0] in turn:
            role_key, content_key = alt_keys
        speaker = turn.get(role_key)
        if speaker is None:
            raise _RowError("missing_field", f"{label} has no {role_key!r}")
        if not isinstance(speaker, str):
            raise _RowError("wrong_type", f"{label}.{role_key} must be a string, got {type(speaker).__name__}")
        role = _role(speaker, f"{label}.{role_key}")
        if content_key not in turn:
            raise _RowError("missing_field", f"{label} has no {content_key!r}")
        turns.append((role, turn[content_key], f"{label}.{content_key}", turn))
    return turns


def _role(speaker: str, label: str) -> Role:
    name = speaker.strip().lower()
    if name in _USER_ROLES:
        return "user"
    if name in _ASSISTANT_ROLES:
        return "assistant"
    if name in _SYSTEM_ROLES:
        return "system"
    if name in CALL_SPEAKERS:
        return "assistant"
    if name in RESULT_SPEAKERS:
        return "tool"
    raise _RowError("unknown_role", f"{label} is {speaker!r}, not a user, assistant, system or tool role")


def _alpaca_turns(row: dict[str, Any]) -> list[_Turn]:
    instruction = row.get("instruction")
    if instruction is None:
        raise _RowError("missing_field", "no 'instruction' field")
    if not isinstance(instruction, str):
        raise _RowError("wrong_type", f"'instruction' must be a string, got {type(instruction).__name__}")
    extra = _optional_str(row, "input")
    system = _optional_str(row, "system")
    has_system = row.get("system") is not None
    if not instruction.strip():
        raise _RowError("empty_user_content", "'instruction' is empty")
    # Alpaca's own prompt puts the input after the instruction, separated by a blank line.
    user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
    turns: list[_Turn] = [("user", user, "instruction", row)]
    if has_system:
        turns.insert(0, ("system", system, "system", row))
    return turns


def _optional_str(row: dict[str, Any], field: str) -> str:
    value = row.get(field)
    if value is None:
        return ""
    if not isinstance(value, str):
        raise _RowError("wrong_type", f"{field!r} must be a string, got {type(value).__name__}")
    return value


def _conversation(turns: list[_Turn], replies_discarded: bool = False) -> list[Message]:
    """The row's turns as messages. `replies_discarded` (every turn: the recorded assistant replies never reach the
    model): an empty or null reply is kept as an empty one instead of rejecting the conversation."""
    if not turns:
        raise _RowError("empty_conversation", "conversation has no turns")
    systems = [label for role, _, label, _ in turns if role == "system"]
    if len(systems) > 1:
        raise _RowError("multiple_system", f"{len(systems)} system messages ({', '.join(systems)}); at most one")
    if systems and turns[0][0] != "system":
        raise _RowError("system_not_first", f"system message at {systems[0]} is not the first turn")
    if turns[-1][0] == "assistant":
        # The reply we regenerate: its content does not matter. A ShareGPT call turn is the reply's call.
        called = _speaker(turns[-1]) in CALL_SPEAKERS
        turns = turns[:-1]
        if called and turns and turns[-1][0] == "assistant" and _speaker(turns[-1]) not in CALL_SPEAKERS:
            turns = turns[:-1]
    messages: list[Message] = []
    for role, content, label, raw in turns:
        text_of = _reply_text if replies_discarded and role == "assistant" else _text
        message = turn_message(role, content, label, raw, _speaker((role, content, label, raw)), text_of)
        empty = not message.text.strip() and not message.tool_calls
        if empty and (role == "user" or (role == "assistant" and not replies_discarded)):
            # An empty system prompt is kept: the template renders its (empty) block, and the prompt must be
            # what apply_chat_template makes of the messages as given. So is an empty tool result.
            reason = "empty_user_content" if role == "user" else "empty_assistant_content"
            raise _RowError(reason, f"{label} is empty")
        messages.append(message)
    messages = close_calls(messages, [label for _, _, label, _ in turns])
    if not any(m.role == "user" for m in messages):
        raise _RowError("no_user_turn", "conversation has no user turn")
    if messages[-1].role not in ("user", "tool"):
        raise _RowError(
            "last_turn_not_user",
            f"after dropping one trailing assistant reply the last turn is {messages[-1].role!r}",
        )
    return messages


def _speaker(turn: _Turn) -> str:
    """The turn's speaker name as the row wrote it (lowercased), e.g. ShareGPT's 'function_call'."""
    raw, label = turn[3], turn[2]
    key = label.rsplit(".", 1)[-1]
    speaker = raw.get("from" if key == "value" else "role")
    return speaker.strip().lower() if isinstance(speaker, str) else ""


def _reply_text(content: Any, label: str) -> str:
    """A recorded reply's text where the replies are discarded: a null one is empty (its calls still count)."""
    return "" if content is None else _text(content, label)


def _text(content: Any, label: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts: list[str] = []
        for j, part in enumerate(content):
            if not isinstance(part, dict):  # a bare string too: the model's template raises on one
                raise _RowError("wrong_type", f"{label}[{j}] must be an object, got {type(part).__name__}")
            kind = part.get("type", "text")
            if kind != "text":
                raise _RowError("non_text_content", f"{label}[{j}] is a {kind!r} part; only text is supported")
            text = part.get("text")
            if not isinstance(text, str):
                raise _RowError("wrong_type", f"{label}[{j}].text must be a string, got {type(text).__name__}")
            parts.append(text)
        # Joined without a separator: that is how the model's chat template renders a list of text parts.
        return "".join(parts)
    if content is None:
        raise _RowError("wrong_type", f"{label} is null")
    raise _RowError("wrong_type", f"{label} must be a string or a list of text parts, got {type(content).__name__}")


def _category(row: dict[str, Any], field: str | None) -> str | None:
    if field is None:
        return None
    value = row.get(field)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, str | int):
        raise _RowError("wrong_type", f"category field {field!r} must be a string, got {type(value).__name__}")
    text = str(value).strip()
    if text and not _CATEGORY_RE.match(text):
        # The value itself is not echoed: the detail lands in published rejects and the UI.
        raise _RowError(
            "bad_category",
            f"category field {field!r} holds {len(text)} characters that are not a plain label (letters, digits, "
            "spaces and _ - . : / + & ( ), at most 64)",
        )
    return text or None
