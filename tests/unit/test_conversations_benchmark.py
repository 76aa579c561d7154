"""The every-turn benchmark's workload labels (benchmarks/conversations.py): bands of a conversation's mean step."""

from __future__ import annotations

from benchmarks.conversations import band_labels, workload


def test_band_labels_follow_the_mean_step_and_change_nothing_sent() -> None:
    prompts = workload("plain", 4, seed=3)
    # Mean steps 100 (short: < 160 of a mean 300), 300 (medium), 600 (long: >= 500); no step: no category.
    labelled = band_labels(prompts, [[50, 150], [300], [200, 1000], []], length_mean=300)
    assert [p.category for p in labelled] == ["short", "medium", "long", None]
    for before, after in zip(prompts, labelled, strict=True):
        assert (after.prompt_id, after.messages, after.tools) == (before.prompt_id, before.messages, before.tools)
