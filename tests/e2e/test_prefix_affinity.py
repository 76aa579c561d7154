"""Prefix affinity over HTTP: with the radix cache kept, every step of a conversation after its first goes to the
server that holds its prefix; with it off, the steps spread over the servers as any requests do.

Two real stand-in servers (each reports `meta_info.cached_tokens` as a per-server radix cache would), one
dispatcher, the every-turn shard driver; where each step ran is read from its checkpoint line (`server`).
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

import tasks.generation as generation
from datagen.chat import ChatTokenizer
from datagen.checkpoint import read_rows
from datagen.engine.dispatcher import Dispatcher
from datagen.engine.stats import DispatcherStats
from datagen.identity import prompt_id_from_messages
from datagen.layout import RunLayout
from datagen.local.model_fixture import ensure_model_dir
from datagen.records import Prompt
from datagen.runspec import PromptSource, QualityGate, RunSpec, SamplingSpec
from datagen.standin.testing import run_standin
from flows.pilot import pilot_flow
from tasks.pilot import PILOT_MARKDOWN, PilotSpec
from tasks.pilot_turns import conversation_key

KNOBS = {
    "DATAGEN_STANDIN_LOAD_S": "0.1",
    "DATAGEN_STANDIN_WARMUP_S": "0.1",
    "DATAGEN_STANDIN_LENGTH_MEAN": "60",
    "DATAGEN_STANDIN_LENGTH_MAX": "120",
}
CONVERSATIONS, TURNS = 12, 3


def _messages(i: int) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for t in range(TURNS):
        if t:
            messages.append({"role": "assistant", "content": f"Answer {t} to {i}."})
        messages.append({"role": "user", "content": f"question {i}, turn {t}: what is {i + t} squared, and why?"})
    return messages


def _prompt(i: int) -> Prompt:
    messages = _messages(i)
    return Prompt(prompt_id_from_messages("t", messages), "t", i, messages)


def _run(tmp_path: Path, server_args: tuple[str, ...]) -> tuple[dict[str, list[str]], DispatcherStats]:
    """Each conversation's servers, step by step, and the dispatcher's stats, from one every-turn shard."""
    model_dir = ensure_model_dir()
    chat = ChatTokenizer.from_model_dir(model_dir)
    layout = RunLayout(tmp_path / "run")
    path = layout.shard_prompts(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(_prompt(i).to_json() + "\n" for i in range(CONVERSATIONS)))
    spec = RunSpec(
        model_path=str(model_dir), sampling=SamplingSpec(max_new_tokens=200), context_length=8192, turns="every"
    )
    with ExitStack() as stack:
        endpoints = [stack.enter_context(run_standin(model_dir, args=server_args, env=KNOBS)) for _ in range(2)]
        dispatcher = stack.enter_context(Dispatcher(endpoints, stall_timeout_s=120))
        assert dispatcher.wait_ready(60)
        result = generation.generate_shard(0, layout, dispatcher, chat, spec, 2.0)
        stats = dispatcher.stats()
    assert result.n_prompts == CONVERSATIONS and result.n_rejected == 0
    steps: dict[str, list[tuple[int, str]]] = defaultdict(list)
    for row in read_rows(layout.shard_completions(0)):
        steps[conversation_key(row["request_key"])].append((int(row["step"]), str(row["server"])))
    assert len(steps) == CONVERSATIONS
    return {key: [server for _, server in sorted(s)] for key, s in steps.items()}, stats


def test_with_the_radix_cache_kept_each_conversation_stays_on_the_server_that_holds_its_prefix(
    tmp_path: Path,
) -> None:
    served, stats = _run(tmp_path, ())
    later = sum(len(servers) - 1 for servers in served.values())  # (a step's validation may end one early)
    assert later >= CONVERSATIONS, served
    assert all(len(set(servers)) == 1 for servers in served.values()), served  # every step on its first's server
    assert len({servers[0] for servers in served.values()}) == 2  # the conversations themselves spread
    assert stats.affine == later and stats.affinity_missed == 0
    # Each later step found its history in its server's cache: up to where the template re-renders the turn before
    # (Qwen's drops an earlier turn's reasoning), a few hundred tokens a step; the first steps found nothing.
    assert stats.cache_hit_rate is not None and stats.cache_hit_rate > 0.3, stats.line()


def test_with_the_radix_cache_off_the_steps_spread(tmp_path: Path) -> None:
    served, stats = _run(tmp_path, ("--disable-radix-cache",))
    assert any(len(set(servers)) > 1 for servers in served.values()), served  # no affinity: wherever there is room
    assert stats.affine == 0 and stats.cached_tokens == 0


@pytest.mark.slow
def test_an_every_turn_pilot_weighs_the_radix_cache_on_the_steps_it_measured(
    prefect_api: None, pipeline_env: dict[str, str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("DATAGEN_STANDIN_GPU_MEMORY_BYTES", str(97_887 * 2**20))  # an RTX PRO 6000: a plan is made
    for key, value in KNOBS.items():
        monkeypatch.setenv(key, value)
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps({"messages": _messages(i)}) + "\n" for i in range(20)))
    spec = RunSpec(
        sources=[PromptSource(path=str(path))],
        model_path=str(ensure_model_dir()),
        namespace="radix_main_v1",
        turns="every",
        shard_size=10,
        context_length=8192,
        sampling=SamplingSpec(max_new_tokens=200),
        quality_gate=QualityGate(max_reject_rate=1.0, min_median_completion_tokens=1),
    )
    result = pilot_flow(spec, PilotSpec(name="radix", sample_size=10, seed=3, plan_trial="off"))
    radix = result["engine"]["main_plan"]["radix_cache"]
    # The recording says 3 (1 + two assistant turns); the pilot measured the steps each conversation took.
    population, steps = result["pilot"]["population"], result["projection"]["steps"]
    assert radix["turns_per_conversation"] == round(steps / population, 3)
    assert radix["turns_source"].startswith("measured by pilot radix: 10 conversations")
    assert radix["turns_source"].endswith("projected over 20; the recording said 3")
    assert radix["why"] and str(radix["turns_per_conversation"]) in radix["why"]
    report = (RunLayout.for_run(tmp_path / "work", "radix").root / PILOT_MARKDOWN).read_text()
    assert (
        f"| radix cache for the main run (prefix reuse vs state slots) | {'kept' if radix['kept'] else 'off'}: "
        in report
    )
