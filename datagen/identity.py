"""The keys that name work across runs: prompt ids, request keys and a shard's generation cache key.

Catalogs in S3 and every checkpoint hold these keys, so they never change for the same input
(tests/unit/test_identity.py pins each one with values computed before this module existed).

    prompt id      sha256(source, rendered token ids)[:24]: the prompt as the model sees it. A run always uses
                   this scheme; `PromptIdentity.for_spec` refuses (IdentityError) when the model directory has
                   no tokenizer rather than falling back to another scheme, which would give the same prompts
                   other ids and defeat the catalog's skip of published prompts and the checkpoints' ledger.
                   `prompt_id_from_messages` is the scheme for code with no model at hand (loader tests,
                   benchmarks, `iter_prompts` without an identity); a run never mixes the two.
    request key    sha256(prompt id, sampling, model fingerprint, chat-template hash): one generation request.
    cache key      a shard's generation task in Prefect: namespace, plan, sampling, model, shard.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from datagen.chat import ChatTokenizer, Tools
from datagen.conversation.regeneration import Script
from datagen.conversation.turn_mode import TurnMode, turn_mode
from datagen.records import Message, Prompt
from datagen.runspec import RunSpec, SamplingSpec
from datagen.sources.preparation import Preparer, Unsendable
from datagen.sources.prompt_view import PromptView

__all__ = [
    "IdentityError",
    "PromptIdentity",
    "RequestKeys",
    "generation_cache_key",
    "prompt_id_from_ids",
    "prompt_id_from_messages",
    "request_key",
]


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


def prompt_id_from_ids(source: str, token_ids: list[int]) -> str:
    """Id of a prompt as the model sees it: sha256 over its source label and its rendered token ids."""
    payload = json.dumps([source, token_ids], separators=(",", ":"))
    return hashlib.sha256(payload.encode("ascii")).hexdigest()[:24]


class PromptIdentity:
    """A run's prompt ids: rendered by the checkpoint's template (`Preparer`), hashed with the source label.

    Two rows whose messages differ only in what the template normalizes (e.g. whitespace it trims) render
    to the same ids, so they are one prompt; so do rows that differ only in what the tokenizer normalizes (NFC),
    whose messages are kept normalized. Rendering for the id also finds what could never be sent (`Unsendable`:
    template_error, prompt_too_long, invalid_unicode, prompt_decode_mismatch), and the ids it made are reused.

    Every turn (`first_request` set): the id is still the hash of the whole recorded prompt's render (one
    conversation, one id, the same in both modes), but what must fit the prompt budget is the first request (the
    system messages and the first user turn, as generation sends it): later requests hold the regenerated answers,
    not the recorded ones, and one that outgrows the budget ends its conversation in generation
    (`context_exceeded`) after the earlier turns made rows. The whole render is then bounded by the model's context
    length instead (`preparer`'s limit), which keeps the work per row bounded.
    """

    scheme = "rendered_token_ids"

    def __init__(self, preparer: Preparer, first_request: Preparer | None = None) -> None:
        self.preparer = preparer
        self.first_request = first_request

    @classmethod
    def for_spec(cls, spec: RunSpec) -> PromptIdentity:
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
        return cls(*turn_mode(spec).identity_preparers(spec, chat))

    def __call__(self, source: str, messages: list[Message], tools: Tools = None) -> tuple[str, array[int]]:
        """(prompt id, rendered token ids) of `messages` (and `tools`) from `source`; raises Unsendable."""
        prompt_id, view = self.identify(source, messages, tools)
        return prompt_id, array("i", view.ids)

    def identify(self, source: str, messages: list[Message], tools: Tools = None) -> tuple[str, PromptView]:
        """(prompt id, the prompt as the model sees it: ids, normalized messages); raises Unsendable."""
        if self.first_request is not None:
            first = _first_request(messages)
            if len(first) == len(messages):  # one user turn: the first request is the prompt, rendered once
                view = self.first_request.view(messages, tools)
                return prompt_id_from_ids(source, view.ids), view
            try:
                self.first_request.view(first, tools)
            except Unsendable as err:
                raise Unsendable(
                    err.reason, f"first request (messages through the first user turn): {err.detail}"
                ) from err
        view = self.preparer.view(messages, tools)
        return prompt_id_from_ids(source, view.ids), view

    def prompt_id(self, source: str, messages: list[Message], tools: Tools = None) -> str:
        """The prompt id alone; raises Unsendable."""
        return self(source, messages, tools)[0]


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
