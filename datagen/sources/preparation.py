"""Request preparation: a prompt's messages -> the token ids a server is sent, or why it cannot be sent.

One function (`Preparer`, over datagen.sources.prompt_view's model view: normalized text, round trip, tokenizing bounded
by the limit) serves the loader, where a prompt's id is the hash of these ids (datagen.identity),
and generation. The render happens once, at planning: the loader's ids travel with each `Prompt` in memory
and planning writes them beside the shard's prompts file (`shard-NNNNN.input-ids.arrow`), so generation reads
them instead of rendering and tokenizing every prompt a second time. The file is a cache, not part of the plan:
it names the prompts file (sha256) and the render (model fingerprint, thinking) it was made for, and
generation renders itself whenever it is missing or made for something else. A multi-box run's parent uploads
it beside each shard's prompts file and the boxes fetch both (tasks/shard_exchange.py), so a box renders only
when its model or template differ from the parent's.
"""

from __future__ import annotations

import logging
import os
import tempfile
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc

from datagen.chat import ChatTokenizer, Tools
from datagen.publishing.storage import sha256_file
from datagen.records import Message
from datagen.runspec import RunSpec
from datagen.sources.prompt_view import PromptView, PromptViewError, model_view

__all__ = [
    "Preparer",
    "RenderedIds",
    "Unsendable",
    "install_rendered",
    "preparer_for",
    "read_rendered",
    "rendered_path",
    "write_rendered",
]

log = logging.getLogger(__name__)

_IDS_SCHEMA = pa.schema([pa.field("input_ids", pa.list_(pa.int32()), nullable=False)])


class Unsendable(ValueError):
    """A prompt that can never be sent; `reason` is its reject reason (template_error, prompt_too_long, ...)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


@dataclass(frozen=True, slots=True)
class Preparer:
    """Renders messages with the model's own chat template and checks the result fits the prompt budget."""

    chat: ChatTokenizer
    enable_thinking: bool
    token_limit: int
    limit_note: str = ""  # where the limit comes from, for the reject's detail

    @property
    def render_key(self) -> str:
        """What the ids depend on besides the messages: the model (tokenizer, template) and thinking."""
        return f"{self.chat.fingerprint}:thinking={self.enable_thinking}"

    def __call__(self, messages: list[Message], tools: Tools = None) -> list[int]:
        """The prompt's token ids (generation prompt included, `tools` rendered when given); raises Unsendable."""
        return self.view(messages, tools).ids

    def view(self, messages: list[Message], tools: Tools = None) -> PromptView:
        """The prompt as the model sees it (ids, normalized messages; datagen.sources.prompt_view); raises Unsendable.

        The one check of what can be sent, at load and in generation alike: `template_error`,
        `prompt_too_long` (work bounded by the limit, not the row's size), `invalid_unicode`,
        `prompt_decode_mismatch`.
        """
        try:
            return model_view(self.chat, messages, self.enable_thinking, self.token_limit, self.limit_note, tools)
        except PromptViewError as err:
            raise Unsendable(err.reason, err.message) from err

    def fitting(self, ids: list[int]) -> list[int]:
        """`ids` when they fit the prompt budget; raises Unsendable (prompt_too_long) when they do not."""
        if len(ids) > self.token_limit:
            note = f" {self.limit_note}" if self.limit_note else ""
            raise Unsendable("prompt_too_long", f"prompt has {len(ids)} tokens, limit is {self.token_limit}{note}")
        return ids


def preparer_for(spec: RunSpec, chat: ChatTokenizer) -> Preparer:
    """The run's request preparation: its thinking setting and prompt budget."""
    note = (
        f"(context_length {spec.context_length}, max_new_tokens {spec.sampling.max_new_tokens}, "
        f"max_prompt_tokens {spec.max_prompt_tokens})"
    )
    return Preparer(chat, spec.sampling.enable_thinking, spec.prompt_token_limit, note)


def rendered_path(prompts_path: Path) -> Path:
    """The render cache beside a shard's prompts file: `shard-NNNNN.input-ids.arrow`."""
    return prompts_path.with_name(prompts_path.name.removesuffix(".prompts.jsonl") + ".input-ids.arrow")


def write_rendered(prompts_path: Path, prompts_sha256: str, render_key: str, ids: Sequence[array[int] | None]) -> None:
    """Write the shard's rendered ids (one row per prompt line); without ids for every line, remove a stale file."""
    target = rendered_path(prompts_path)
    if any(row is None for row in ids):
        target.unlink(missing_ok=True)
        return
    metadata = {b"prompts_sha256": prompts_sha256.encode(), b"render_key": render_key.encode()}
    if _metadata(target) == metadata:
        return  # a re-plan of the same prompts: the file is already this one
    offsets = array("i", [0])
    values = array("i")
    for row in ids:
        assert row is not None
        values.extend(row)
        offsets.append(len(values))
    column = pa.ListArray.from_arrays(pa.array(offsets, pa.int32()), pa.array(values, pa.int32()))
    table = pa.Table.from_arrays([column], schema=_IDS_SCHEMA.with_metadata(metadata))

    def write(tmp: str) -> None:
        with pa.OSFile(tmp, "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)

    _replace(target, write)


def install_rendered(prompts_path: Path, data: bytes) -> None:
    """Put a render cache made on another machine (the planning box's) beside the prompts file.

    Nothing is trusted from it but its bytes: `read_rendered` uses it only when it names this prompts file's
    sha256 and the reader's render (model fingerprint, thinking); otherwise generation renders itself.
    """
    _replace(rendered_path(prompts_path), lambda tmp: Path(tmp).write_bytes(data))


def _replace(target: Path, write: Callable[[str], object]) -> None:
    """Write `target` through a temp file in its folder and a rename: a reader never sees half of it."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        os.chmod(tmp, 0o644)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


class RenderedIds:
    """A shard's rendered ids, one row per prompt line, kept in Arrow (4 bytes a token) until a row is asked for."""

    def __init__(self, column: pa.ChunkedArray) -> None:
        self._column = column.combine_chunks()

    def __len__(self) -> int:
        return len(self._column)

    def __getitem__(self, row: int) -> list[int]:
        ids: list[int] = self._column[row].values.to_pylist()
        return ids

    def lengths(self) -> pa.Array:
        """Tokens of every row, from the offsets alone (no ids are copied)."""
        return pc.list_value_length(self._column)


def read_rendered(prompts_path: Path, render_key: str) -> RenderedIds | None:
    """The shard's rendered ids, one row per prompt line; None when there is no cache made for these prompts."""
    path = rendered_path(prompts_path)
    if not path.is_file():
        return None
    try:
        with pa.memory_map(str(path)) as source:
            table = pa.ipc.open_file(source).read_all()
    except (pa.ArrowException, OSError) as exc:
        log.warning("%s: unreadable render cache, rendering instead: %s", path, exc)
        return None
    meta = table.schema.metadata or {}
    if (
        meta.get(b"render_key") != render_key.encode()
        or meta.get(b"prompts_sha256") != sha256_file(prompts_path).encode()
    ):
        log.info("%s: made for other prompts or another model; rendering instead", path)
        return None
    return RenderedIds(table.column("input_ids"))


def _metadata(path: Path) -> dict[bytes, bytes] | None:
    """The schema metadata of a render cache file; None when there is none or it cannot be read."""
    if not path.is_file():
        return None
    try:
        with pa.memory_map(str(path)) as source:
            meta: dict[bytes, bytes] | None = pa.ipc.open_file(source).schema.metadata
            return meta
    except (pa.ArrowException, OSError):
        return None
