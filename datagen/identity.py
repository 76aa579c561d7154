"""The keys that name work across runs: prompt ids, load reject keys, request keys and a shard's generation cache key.

Catalogs in S3 and every checkpoint hold these keys, so they never change for the same input
(tests/unit/test_identity.py pins each one with values computed before this module existed).

    prompt id      what the target is asked to continue, and nothing else (issue 47; docs/data-quality.md, "A
                   prompt's identity"): sha256 of `TurnMode.identity_messages` as the model's template renders them
                   (tools, thinking; the text after the tokenizer's normalization, which the prompt's token ids
                   decode back to): in `last` mode the recorded conversation, replies included; in
                   `every` mode its system prompt, user turns and recorded tool rounds (the functions called, their
                   results), not the recorded assistant text it discards. No file, label or row: a renamed, split,
                   merged, reordered or moved file, or one that gained rows, holds the same prompts. Scheme
                   CONTENT_SCHEME. `PromptIdentity.for_spec` refuses (IdentityError) when the model directory has no
                   tokenizer rather than falling back to another scheme.
    legacy id      the id the code before issue 47 gave (LEGACY_SCHEME): sha256 over the source label and the whole
                   recorded conversation's render, in both modes. Namespaces published then list these ids; every
                   prompt is given this id too (`Identified.alias`) so an expansion over them matches it
                   (`KnownPrompts`), under any label those namespaces published (a file renamed since). A run
                   whose work dir holds a plan made under it keeps it (tasks/planning.py), so an interrupted run
                   resumes on its checkpoints. `prompt_id_from_messages` is the label scheme for code with no model
                   at hand (loader tests, benchmarks, `iter_prompts` without an identity); a run never uses it.
    load reject    "row:" + sha256 over the reason and the row's content (`load_reject_key`); before issue 47 over
                   the label, the row's index and its content (`legacy_load_reject_key`, still matched).
    request key    sha256(prompt id, sampling, model fingerprint, chat-template hash): one generation request.
    cache key      a shard's generation task in Prefect: namespace, plan, sampling, model, shard.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from datagen.chat import ChatTokenizer, TemplateError, Tools
from datagen.conversation.regeneration import Script
from datagen.conversation.turn_mode import TurnMode, turn_mode
from datagen.records import Message, Prompt
from datagen.runspec import RunSpec, SamplingSpec
from datagen.sources.preparation import Preparer, Unsendable
from datagen.sources.prompt_view import PromptView

__all__ = [
    "CONTENT_SCHEME",
    "LEGACY_SCHEME",
    "LOAD_REJECT_KEY_PREFIX",
    "Identified",
    "IdentityError",
    "KnownPrompts",
    "KnownRejects",
    "PromptIdentity",
    "RequestKeys",
    "content_prompt_id",
    "generation_cache_key",
    "known_before",
    "legacy_load_reject_key",
    "load_reject_key",
    "prompt_id_from_ids",
    "prompt_id_from_messages",
    "request_key",
]

CONTENT_SCHEME = "continued_content"  # the prompt ids of this module's docstring (issue 47)
LEGACY_SCHEME = "rendered_token_ids"  # the ids before it: source label + the whole recorded conversation's render
# A load reject's `request_key`: "row:" + a hash, so a later expansion knows the row was published as a reject.
LOAD_REJECT_KEY_PREFIX = "row:"


class IdentityError(RuntimeError):
    """A run's prompt ids cannot be computed (no tokenizer): the run stops rather than switch id scheme."""


def prompt_id_from_messages(source: str, messages: Sequence[Message | Mapping[str, Any]], tools: Tools = None) -> str:
    """Id of a prompt without a model: sha256 over its source label and its messages' role and content.

    Takes messages or their dict form (tests and benchmarks build prompts from literals). A message's other
    fields (reasoning, tool calls, tool-call id, name) and the prompt's tools join the hash only when set,
    so every id of a prompt made of plain turns stays what it was.
    """
    pairs = [_id_part(m.to_dict() if isinstance(m, Message) else m) for m in messages]
    body: list[Any] = [source, pairs]
    if tools:
        body.append(list(tools))
    payload = json.dumps(body, ensure_ascii=False)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:24]


def _id_part(message: Mapping[str, Any]) -> list[Any]:
    extra = {k: v for k, v in message.items() if k not in ("role", "content") and v is not None}
    return [message["role"], message["content"], extra] if extra else [message["role"], message["content"]]


def prompt_id_from_ids(source: str, token_ids: Sequence[int]) -> str:
    """The legacy id of a prompt (LEGACY_SCHEME): sha256 over its source label and its rendered token ids."""
    payload = json.dumps([source, list(token_ids)], separators=(",", ":"))
    return hashlib.sha256(payload.encode("ascii")).hexdigest()[:24]


def content_prompt_id(rendered: str) -> str:
    """The id of a prompt (CONTENT_SCHEME): sha256 of the chat template's rendering of what the model is asked to
    continue (its text after the tokenizer's normalization, which its token ids decode back to), nothing else."""
    return hashlib.sha256(b"datagen-prompt/2\0" + rendered.encode("utf-8", "surrogatepass")).hexdigest()[:24]


def load_reject_key(reason: str, content: str) -> str:
    """The key of a load reject: its reason and the row's content (LOAD_REJECT_KEY_PREFIX), not where the row is.

    A row moved to another line or file, or left where it was while rows were added around it, keeps its key; a
    rewritten row, or one rejected for another reason, is new.
    """
    digest = hashlib.sha256(f"load-reject/2\0{reason}\0{content}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"{LOAD_REJECT_KEY_PREFIX}{digest[:32]}"


def legacy_load_reject_key(label: str, row: int, content: str) -> str:
    """The key the code before issue 47 gave a load reject: its source label, its row in that source, its content."""
    digest = hashlib.sha256(f"{label}\0{row}\0{content}".encode("utf-8", "surrogatepass")).hexdigest()
    return f"{LOAD_REJECT_KEY_PREFIX}{digest[:32]}"


@dataclass(frozen=True, slots=True)
class Identified:
    """A prompt identified: its id, its id in the other scheme, and what the model sees of it."""

    prompt_id: str  # in the run's scheme
    alias: str  # in the other scheme: the legacy id of a run under CONTENT_SCHEME, and the reverse
    view: PromptView  # the recorded conversation as the model sees it (ids, normalized messages)
    duplicate_key: bytes  # equal for two rows that are the same prompt under the run's scheme


class PromptIdentity:
    """A run's prompt ids (module docstring), rendered by the checkpoint's template (`Preparer`).

    Two rows whose messages differ only in what the template normalizes (e.g. whitespace it trims) render
    to the same ids, so they are one prompt; so do rows that differ only in what the tokenizer normalizes (NFC),
    whose messages are kept normalized. Rendering also finds what could never be sent (`Unsendable`:
    template_error, prompt_too_long, invalid_unicode, prompt_decode_mismatch), and the ids it made are reused.

    Every turn (`first_request` set): what must fit the prompt budget is the first request (the system messages and
    the first user turn, as generation sends it): later requests hold the regenerated answers, not the recorded
    ones, and one that outgrows the budget ends its conversation in generation (`context_exceeded`) after the
    earlier turns made rows. The whole recorded conversation's render is bounded by the model's context length
    instead (`preparer`'s limit), which keeps the work per row bounded; its ids are planning's render (the memory
    plan's lengths) and what the legacy id hashes. The id hashes the render of `mode.identity_messages`.
    """

    def __init__(
        self,
        preparer: Preparer,
        first_request: Preparer | None = None,
        mode: TurnMode | None = None,
        scheme: str = CONTENT_SCHEME,
    ) -> None:
        if scheme not in (CONTENT_SCHEME, LEGACY_SCHEME):
            raise ValueError(f"unknown prompt id scheme {scheme!r}")
        self.preparer = preparer
        self.first_request = first_request
        self.mode = mode
        self.scheme = scheme

    @classmethod
    def for_spec(cls, spec: RunSpec, scheme: str = CONTENT_SCHEME) -> PromptIdentity:
        """The identity a run's prompts get; raises IdentityError when the model directory has no tokenizer."""
        path = Path(spec.model_path)
        if not (path / "tokenizer.json").is_file():
            raise IdentityError(
                f"{path}: no tokenizer.json, so this run's prompt ids (sha256 of the rendered token ids) cannot be "
                "computed; stage the model there (or point model_path at it) before planning. Ids are never taken "
                "from another scheme: published catalogs and checkpoints hold these ids"
            )
        # The flow's own instance (ChatTokenizer.shared): one tokenizer load per process.
        chat = ChatTokenizer.shared(path)
        mode = turn_mode(spec)
        return cls(*mode.identity_preparers(spec, chat), mode=mode, scheme=scheme)

    @property
    def discards_recorded_replies(self) -> bool:
        """The run's mode never sends the recorded assistant replies (an empty one rejects nothing)."""
        return self.mode is not None and self.mode.discards_recorded_replies

    def __call__(self, source: str, messages: list[Message], tools: Tools = None) -> tuple[str, array[int]]:
        """(prompt id, rendered token ids) of `messages` (and `tools`) from `source`; raises Unsendable."""
        found = self.identify(source, messages, tools)
        return found.prompt_id, array("i", found.view.ids)

    def identify(self, source: str, messages: list[Message], tools: Tools = None) -> Identified:
        """The prompt's ids and what the model sees of it; raises Unsendable."""
        view = self._view(messages, tools)
        legacy = prompt_id_from_ids(source, view.ids)
        content = content_prompt_id(self._continued(view, tools))
        if self.scheme == LEGACY_SCHEME:
            return Identified(legacy, content, view, array("i", view.ids).tobytes())
        return Identified(content, legacy, view, content.encode("ascii"))

    def _view(self, messages: list[Message], tools: Tools) -> PromptView:
        if self.first_request is not None:
            first = _first_request(messages)
            if len(first) == len(messages):  # one user turn: the first request is the prompt, rendered once
                return self.first_request.view(messages, tools)
            try:
                self.first_request.view(first, tools)
            except Unsendable as err:
                raise Unsendable(
                    err.reason, f"first request (messages through the first user turn): {err.detail}"
                ) from err
        return self.preparer.view(messages, tools)

    def _continued(self, view: PromptView, tools: Tools) -> str:
        """The rendering of what the target is asked to continue (`TurnMode.identity_messages`), as the model sees
        it: the view's own when that is all of it (no second render, no second tokenization)."""
        continued = view.messages if self.mode is None else self.mode.identity_messages(view.messages, tools)
        if continued == view.messages:
            return view.text
        try:
            return self.preparer.chat.render(continued, self.preparer.enable_thinking, tools)
        except TemplateError as exc:
            raise Unsendable(
                "template_error", f"the chat template refused the conversation as the model is sent it: {exc}"
            ) from exc

    def prompt_id(self, source: str, messages: list[Message], tools: Tools = None) -> str:
        """The prompt id alone; raises Unsendable."""
        return self.identify(source, messages, tools).prompt_id


class KnownPrompts(frozenset[str]):
    """The prompt ids published before (both schemes: catalog parts of namespaces published before issue 47 list
    legacy ids), and the source labels those legacy parts name.

    A prompt is known when its id or its alias is listed, or, when legacy parts exist, when its legacy id under one
    of their labels is (`holds`): a file such a namespace published, renamed or moved since, or whose prompts a
    new file now holds first, is still matched. As a set it is the ids (`in` tests an id alone).
    """

    legacy_labels: tuple[str, ...]

    def __new__(cls, ids: Iterable[str] = (), legacy_labels: Iterable[str] = ()) -> KnownPrompts:
        known = super().__new__(cls, ids)
        known.legacy_labels = tuple(sorted(set(legacy_labels)))
        return known

    def holds(self, prompt_id: str | None, alias: str | None = None, rendered: Sequence[int] | None = None) -> bool:
        """Whether a prompt (its id, alias and whole rendered ids: the legacy id's input) was published before."""
        if (prompt_id is not None and prompt_id in self) or (alias is not None and alias in self):
            return True
        if not self.legacy_labels or rendered is None:
            return False
        # prompt_id_from_ids for each label, the ids' JSON made once: '["<label>",[1,2,...]]'.
        tail = "," + json.dumps(list(rendered), separators=(",", ":")) + "]"
        return any(
            hashlib.sha256(("[" + json.dumps(label) + tail).encode("ascii")).hexdigest()[:24] in self
            for label in self.legacy_labels
        )


class KnownRejects(frozenset[str]):
    """The keys of the input rows published before as load rejects (both key schemes), and the source labels of the
    load-rejects parts written before issue 47, whose keys hold the label and the row's index (`holds`: a row of a
    renamed or moved file is still matched while it keeps its index)."""

    legacy_labels: tuple[str, ...]

    def __new__(cls, keys: Iterable[str] = (), legacy_labels: Iterable[str] = ()) -> KnownRejects:
        known = super().__new__(cls, keys)
        known.legacy_labels = tuple(sorted(set(legacy_labels)))
        return known

    def holds(self, key: str | None, row: int | None = None, legacy_content: str | None = None) -> bool:
        """Whether a load reject (its key; its row and the content the legacy key hashes) was published before."""
        if key is not None and key in self:
            return True
        if row is None or legacy_content is None:
            return False
        return any(legacy_load_reject_key(label, row, legacy_content) in self for label in self.legacy_labels)


def known_before(prompt: Prompt, published: Collection[str]) -> bool:
    """Whether `published` (a `KnownPrompts`, or plain ids) holds this prompt under either of its ids."""
    if isinstance(published, KnownPrompts):
        return published.holds(prompt.prompt_id, prompt.alias, prompt.input_ids)
    return prompt.prompt_id in published or (prompt.alias is not None and prompt.alias in published)


def _first_request(messages: list[Message]) -> list[Message]:
    """Every turn's first request (`datagen.conversation.regeneration.Regenerator.first`): the conversation's
    head and its first user turn; raises Unsendable when it has no user query."""
    script = Script.of(Prompt(prompt_id="", source="", row=0, messages=messages))
    return [*script.head, *script.turns[0].opening]


def request_key(prompt_id: str, sampling: SamplingSpec, model_fingerprint: str, template_hash: str) -> str:
    """Content key of one request: sha256 over prompt id, sampling, model fingerprint and chat template."""
    payload = {
        "prompt_id": prompt_id,
        "sampling": sampling.model_dump(mode="json"),
        "model": model_fingerprint,
        "template": template_hash,
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode("utf-8")).hexdigest()


class RequestKeys:
    """The request key of each prompt id under one run's sampling and model."""

    def __init__(self, sampling: SamplingSpec, chat: ChatTokenizer) -> None:
        self._sampling, self._fingerprint, self._template = sampling, chat.fingerprint, chat.template_hash

    def __call__(self, prompt_id: str) -> str:
        return request_key(prompt_id, self._sampling, self._fingerprint, self._template)


def generation_cache_key(
    namespace: str,
    plan_sha256: str,
    sampling: SamplingSpec,
    model_fingerprint: str,
    shard_id: int,
    mode: TurnMode,
) -> str:
    """Prefect cache key of a shard's generation task: survives new flow runs (unlike Prefect's default policy).

    The run's turn mode tags it (`TurnMode.cache_tag`): `turns: every` shards hold other lines (steps) than `last`
    ones of the same plan, and a `last` key is what it always was.
    """
    request_params = json.dumps({"sampling": sampling.model_dump(), "fingerprint": model_fingerprint}, sort_keys=True)
    digest = hashlib.sha256(request_params.encode()).hexdigest()[:16]
    return f"generate-{namespace}-{plan_sha256[:16]}-{digest}{mode.cache_tag}-shard-{shard_id:05d}"
