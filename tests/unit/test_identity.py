"""Prompt ids, request keys and the shard cache key never change: golden values computed on the code before
datagen.identity existed (commit 4400d5e), so catalogs in S3 and checkpoints written then still match.

Issue 47 gave prompts a second scheme, the content's (CONTENT_SCHEME: no source label, not the recorded replies
every turn discards). The ids users rely on did not move: the legacy scheme gives exactly the old values (a run whose
work dir was planned by the old code keeps it), and every content-scheme prompt carries its legacy id as its
`alias`, which is what an expansion matches against catalog parts written before (the documented translation,
docs/data-quality.md "A prompt's identity")."""

from __future__ import annotations

from pathlib import Path

import pytest

from datagen.conversation.turn_mode import EveryTurn, LastTurn
from datagen.identity import (
    CONTENT_SCHEME,
    LEGACY_SCHEME,
    IdentityError,
    KnownPrompts,
    PromptIdentity,
    RequestKeys,
    content_prompt_id,
    generation_cache_key,
    legacy_load_reject_key,
    load_reject_key,
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


def test_a_legacy_run_renders_prompt_ids_as_the_old_code_did_and_request_keys_follow() -> None:
    spec = RunSpec(model_path=str(ensure_model_dir()))
    identity = PromptIdentity.for_spec(spec, LEGACY_SCHEME)
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


def test_content_ids_are_pinned_and_carry_the_legacy_id_as_their_alias() -> None:
    assert content_prompt_id("<|im_start|>user\nhi<|im_end|>\n") == "1c1516b9bd7e68fe4bec353a"
    for turns in ("last", "every"):
        spec = RunSpec(model_path=str(ensure_model_dir()), turns=turns)
        identity = PromptIdentity.for_spec(spec)
        assert identity.scheme == CONTENT_SCHEME
        found = identity.identify("src/a", MESSAGES)
        # One user turn: what the model continues is the whole prompt in both modes, so one id for both.
        assert found.prompt_id == "7a3c3c757e295282afc0446a" == content_prompt_id(found.view.text)
        assert found.view.ids == identity.preparer.chat.encode(found.view.text)  # the text the ids encode
        assert found.alias == "710efd17f474af9da7168ba2"  # the legacy id above: old catalogs match it
        assert identity.identify("another/label", MESSAGES).prompt_id == found.prompt_id  # no label in it
        assert identity.identify("another/label", MESSAGES).alias == prompt_id_from_ids("another/label", found.view.ids)


def test_every_turn_ids_leave_out_the_recorded_replies_last_keeps_them() -> None:
    def conv(reply: str) -> list[Message]:
        return [
            Message(role="user", content="Plan a trip."),
            Message(role="assistant", content=reply),
            Message(role="user", content="Cheaper?"),
        ]

    every = PromptIdentity.for_spec(RunSpec(model_path=str(ensure_model_dir()), turns="every"))
    last = PromptIdentity.for_spec(RunSpec(model_path=str(ensure_model_dir()), turns="last"))
    assert (
        every.prompt_id("s", conv("Lisbon."))
        == every.prompt_id("s", conv("Porto, then Lisbon."))
        == (every.prompt_id("s", conv("")))
    )
    assert last.prompt_id("s", conv("Lisbon.")) != last.prompt_id("s", conv("Porto, then Lisbon."))
    # The user turns still tell conversations apart, and the legacy id (whole recording) keeps the replies.
    assert every.prompt_id("s", conv("Lisbon.")) != every.prompt_id("s", [*conv("Lisbon.")[:2], conv("")[0]])
    assert every.identify("s", conv("Lisbon.")).alias != every.identify("s", conv("Porto.")).alias


def test_known_prompts_match_legacy_ids_under_any_label_their_parts_name() -> None:
    rendered = [1, 2, 3, 248045, 99999]
    old = prompt_id_from_ids("chat", rendered)  # published before issue 47 from chat.jsonl
    known = KnownPrompts({old, "c" * 24}, legacy_labels=["chat", "code"])
    assert known == {old, "c" * 24} and old in known  # still the set of ids
    assert known.holds("c" * 24) and known.holds("x", alias=old)
    assert known.holds("x", alias=prompt_id_from_ids("chat-renamed", rendered), rendered=rendered)
    assert not known.holds("x", alias=prompt_id_from_ids("chat-renamed", rendered))  # no render: no label search
    assert not KnownPrompts({old}).holds("x", rendered=rendered)  # no legacy labels: nothing to search


def test_load_reject_keys_are_the_old_ones_or_the_content_ones() -> None:
    content = '{"id": 7, "messages": []}'
    # The old code's key (sources/prompts.py `_row_key` at a0af713), for matching load-rejects parts written then.
    assert legacy_load_reject_key("src", 3, content) == "row:d455e55c60a7dd88e1f76a7ada1ee4b2"
    assert load_reject_key("empty_conversation", content) == "row:131a02fe2297941305254e712940a746"
    assert load_reject_key("empty_conversation", content) != load_reject_key("invalid_json", content)


def test_a_run_without_a_tokenizer_is_refused_not_given_other_ids(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(IdentityError, match=r"no tokenizer\.json.*cannot be computed"):
        PromptIdentity.for_spec(RunSpec(model_path=str(tmp_path)))
