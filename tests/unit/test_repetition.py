"""Repetition that is the answer versus loops, on a generated corpus with the real Qwen3.6 tokenizer.

The figures in docs/data-quality.md come from `measure` below (seed 23 and the held-out seeds 1, 2, 99).
"""

from __future__ import annotations

import numpy as np
import pytest

from datagen.chat import IM_END_ID, ChatTokenizer
from datagen.checks.quality import check_completion
from datagen.checks.repetition import prose_loops, word_tokens
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Completion
from datagen.runspec import ValidationSpec
from tests.repetition_corpus import LEGIT, LOOPS, Sample, corpus

SPEC = ValidationSpec(reject_truncated=False)  # loops until the limit must be named for the loop anyway
LOOP_REASONS = frozenset({"repeated_tail", "repeated_block", "repetition"})


@pytest.fixture(scope="module")
def chat() -> ChatTokenizer:
    return ChatTokenizer.shared(ensure_model_dir())


@pytest.fixture(scope="module")
def words(chat: ChatTokenizer) -> np.ndarray:
    return word_tokens(chat)


def _completion(chat: ChatTokenizer, text: str, finish: str = "stop") -> Completion:
    ids = chat.encode(text) + ([IM_END_ID] if finish == "stop" else [])
    return Completion("p", "s", 0, [{"role": "user", "content": "q"}], "k", 12, ids, text, finish, len(ids))


def measure(chat: ChatTokenizer, words: np.ndarray | None, samples: list[Sample]) -> tuple[int, int, list[str]]:
    """(legitimate answers rejected as loops, loops accepted, which) under the current rules."""
    false_rejects, missed, which = 0, 0, []
    for s in samples:
        v = check_completion(_completion(chat, s.text, s.finish), SPEC, True, words)
        looped = v.reason in LOOP_REASONS
        if looped and not s.loop:
            false_rejects += 1
            which.append(f"{s.family}: {v.detail}")
        elif s.loop and not looped:
            missed += 1
            which.append(f"{s.family}: missed ({v.reason})")
    return false_rejects, missed, which


def test_the_corpus_is_large_and_varied() -> None:
    samples = corpus()
    legit, loops = [s for s in samples if not s.loop], [s for s in samples if s.loop]
    assert len(legit) >= 50 and len(loops) >= 50
    assert {s.family for s in legit} == set(LEGIT) and {s.family for s in loops} == set(LOOPS)
    assert len({s.text for s in samples}) == len(samples)  # generated, not copies


def test_structure_is_kept_and_loops_are_caught_on_the_corpus(chat: ChatTokenizer, words: np.ndarray) -> None:
    # Issue 23.4. The old rules on this corpus: 48 of 80 answers rejected, 28 of 60 loops accepted.
    false_rejects, missed, which = measure(chat, words, corpus(seed=23))
    assert (false_rejects, missed) == (0, 0), which


def test_held_out_corpora(chat: ChatTokenizer, words: np.ndarray) -> None:
    # Seeds the rule was not tuned on; the misses are cycles of 3-4 long interleaved copies (chorus-like).
    totals = [measure(chat, words, corpus(seed=seed))[:2] for seed in (1, 2, 99)]
    false_rejects, missed = sum(t[0] for t in totals), sum(t[1] for t in totals)
    assert false_rejects == 0
    assert missed <= 4  # of 180 loops


def test_a_12x12_zero_matrix_answer_is_kept(chat: ChatTokenizer, words: np.ndarray) -> None:
    matrix = "\n".join(" ".join(["0"] * 12) for _ in range(12))
    c = _completion(chat, f"The user wants the 12x12 zero matrix.\n</think>\n\n{matrix}")
    assert check_completion(c, SPEC, True).reason is not None  # the rules without the vocabulary reject it
    v = check_completion(c, SPEC, True, words)
    assert v.accepted, v.detail
    # The same rows until the token limit are still a loop.
    cut = _completion(chat, f"The user wants the zero matrix.\n</think>\n\n{matrix}\n{matrix}\n{matrix}", "length")
    assert check_completion(cut, SPEC, True, words).reason == "repeated_tail"


def test_an_interleaved_loop_of_40_percent_is_caught(chat: ChatTokenizer, words: np.ndarray) -> None:
    # The same sentence between fresh ones: never back to back, 8-gram share under the old 50% bar.
    import random

    from tests.repetition_corpus import _sentence, prose

    rng = random.Random(4)
    unit = "Wait, I should double check whether the coefficient of the second term was computed correctly."
    parts = [f"{unit} {_sentence(rng, 4, 8)}" for _ in range(20)]
    text = f"{prose(rng, 5)} {' '.join(parts)}\n</think>\n\nThe answer is 12."
    c = _completion(chat, text)
    from datagen.checks.quality import repeated_ngram_share

    assert 0.3 < repeated_ngram_share(c.output_ids) < SPEC.max_repeated_ngram_share
    assert check_completion(c, SPEC, True).accepted  # passed before
    v = check_completion(c, SPEC, True, words)
    assert v.reason == "repetition", v.detail
    loops = prose_loops(c.output_ids, words, SPEC.min_loop_copies)
    assert loops.copies == 20 and loops.covered > 0.3 * len(c.output_ids)


def test_a_chorus_sung_four_times_is_kept_a_sentence_said_twelve_times_is_not(
    chat: ChatTokenizer, words: np.ndarray
) -> None:
    chorus = "We will walk the golden road tonight\nAnd the river sings us home again\n"
    verses = [f"Verse line {k} about the night and the rain\nAnother line number {k} of the song\n" for k in range(4)]
    song = "".join(v + chorus for v in verses)
    v = check_completion(_completion(chat, f"Writing a song with a chorus.\n</think>\n\n{song}"), SPEC, True, words)
    assert v.accepted, v.detail
    looped = "".join(f"{v_}{chorus}" for v_ in verses * 3)
    v = check_completion(_completion(chat, f"Writing a song.\n</think>\n\n{looped}"), SPEC, True, words)
    assert v.reason in LOOP_REASONS, v.detail
