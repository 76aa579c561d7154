"""Prompt ids, request keys and the shard cache key never change: golden values computed on the code before
datagen.identity existed (commit 4400d5e), so catalogs in S3 and checkpoints written then still match."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.conversation.turn_mode import EveryTurn, LastTurn
from datagen.identity import (
    IdentityError,
    PromptIdentity,
    RequestKeys,
    generation_cache_key,
    prompt_id_from_ids,
    prompt_id_from_messages,
    request_key,
)
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Message
from datagen.runspec import RunSpec, SamplingSpec

MESSAGES = [Message(role="system", content="Be brief."), Message(role="user", content="Héllo, wörld: 2+2?")]
PROMPT_ID = "0123456789abcdef01234567"
FINGERPRINT, TEMPLATE = "fp0123456789abcd", "th0123456789abcd"
OTHER_SAMPLING = SamplingSpec(max_new_tokens=4096, temperature=0.7, top_p=0.9, top_k=50, enable_thinking=False)


def test_prompt_ids_are_the_ones_the_old_code_gave() -> None:
    assert prompt_id_from_messages("src/a", MESSAGES) == "1e1e32cf6cfc5baa39b99304"
    assert prompt_id_from_messages("src/a", [m.to_dict() for m in MESSAGES]) == "1e1e32cf6cfc5baa39b99304"
    assert prompt_id_from_ids("src/a", [1, 2, 3, 248045, 99999]) == "c7a0b9f59a12cd09a9cab695"


def test_request_keys_are_the_ones_the_old_code_gave() -> None:
    default = "2687cb40e73783e5ffb4a23907b777a6ae22ca3fb48016b97709b5936defda07"
    assert request_key(PROMPT_ID, SamplingSpec(), FINGERPRINT, TEMPLATE) == default
    other = "99ef3c8c611a40b153ea489aa42ab4db060a1239fcc93e113fe3d5e59ee517f5"
    assert request_key(PROMPT_ID, OTHER_SAMPLING, FINGERPRINT, TEMPLATE) == other


def test_generation_cache_key_is_the_one_the_old_flow_gave() -> None:
    from flows.skeleton import _generation_cache_key

    golden = "generate-golden_ns-abababababababab-6239cac4ec44fb4f-shard-00007"
    assert generation_cache_key("golden_ns", "ab" * 32, OTHER_SAMPLING, FINGERPRINT, 7, LastTurn()) == golden
    tagged = golden.replace("-shard-", "-turns-every-shard-")
    assert generation_cache_key("golden_ns", "ab" * 32, OTHER_SAMPLING, FINGERPRINT, 7, EveryTurn()) == tagged
    spec = RunSpec(namespace="golden_ns", sampling=OTHER_SAMPLING, turns="last")
    parameters = {"spec": spec, "model_fingerprint": FINGERPRINT, "plan_sha256": "ab" * 32, "shard_id": 7}
    assert _generation_cache_key(None, parameters) == golden  # type: ignore[arg-type]
    # Every turn: the same plan's shards hold steps, not single completions; a result cached for the other mode
    # must not be taken for them.
    every = {**parameters, "spec": spec.model_copy(update={"turns": "every"})}
    assert _generation_cache_key(None, every) == tagged  # type: ignore[arg-type]


def test_a_run_renders_prompt_ids_as_the_old_code_did_and_request_keys_follow() -> None:
    spec = RunSpec(model_path=str(ensure_model_dir()))
    identity = PromptIdentity.for_spec(spec)
    prompt_id, ids = identity("src/a", MESSAGES)
    # The fixture model's template and tokenizer as at that commit; the fingerprint also covers config.json,
    # which FIXTURE_VERSION 4 (issue 22: Qwen3.6-27B's layer and head numbers) changed ("bf0fe9f17be426b9" before)
    # and FIXTURE_VERSION 5 (issue 37: rope_parameters and the bfloat16 dtype a real SGLang 0.5.17 needs) changed
    # again ("7e32886ddcb3c8eb" before). Template and tokenizer are untouched: the prompt id below did not move.
    assert identity.preparer.chat.fingerprint == "b5dd158ba83f127b"
    assert prompt_id == "710efd17f474af9da7168ba2"
    assert list(ids) == identity.preparer.chat.prompt_ids(MESSAGES)
    chat = identity.preparer.chat
    assert RequestKeys(spec.sampling, chat)(prompt_id) == request_key(
        prompt_id, spec.sampling, chat.fingerprint, chat.template_hash
    )


def test_a_run_without_a_tokenizer_is_refused_not_given_other_ids(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(IdentityError, match=r"no tokenizer\.json.*cannot be computed"):
        PromptIdentity.for_spec(RunSpec(model_path=str(tmp_path)))
