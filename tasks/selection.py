"""Which prompts a run takes: skip ids already published, cap per source/category, draw a pilot's stratified sample.

Every choice is a seeded hash of the prompt id (`sample_hash`), so the same sources, catalog and seed always give
the same prompts, however the files are split or ordered. Prompts that are not taken are not rejects (they stay
available to a later run); `SelectionReport` counts them and says why.
"""

from __future__ import annotations

import hashlib
import heapq
from collections import Counter
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from dataclasses import dataclass, field

from pydantic import BaseModel, Field

from datagen.identity import known_before
from datagen.records import Prompt, Reject

__all__ = [
    "PromptFilter",
    "Selection",
    "SelectionReport",
    "choose",
    "filtered",
    "sample_hash",
    "stratified_sample",
]

Items = Iterator[Prompt | Reject]
PromptFilter = Callable[[Items], Items]  # planning's `select` hook: iterator in, iterator out


def sample_hash(seed: int, prompt_id: str) -> int:
    """A uniform 64-bit value per (seed, prompt id): the random order every sample here follows."""
    return int.from_bytes(hashlib.blake2b(f"{seed}:{prompt_id}".encode(), digest_size=8).digest(), "big")


class SelectionReport(BaseModel):
    """What the sources held and what a run took from them."""

    available_by_source: dict[str, int] = Field(default_factory=dict, description="Prompts read, per source.")
    skipped_published: int = Field(0, description="Prompts skipped because an earlier namespace published them.")
    over_target_by_source: dict[str, int] = Field(
        default_factory=dict, description="New prompts left for later by a source or category target, per source."
    )
    selected_by_source: dict[str, int] = Field(default_factory=dict, description="Prompts taken, per source.")
    selected_by_category: dict[str, int] = Field(default_factory=dict, description="Prompts taken, per category.")

    @property
    def n_selected(self) -> int:
        return sum(self.selected_by_source.values())


@dataclass(frozen=True, slots=True)
class Selection:
    """A membership test for prompts: not published before, and within the targets."""

    skip: Collection[str] = frozenset()
    source_targets: Mapping[str, int] = field(default_factory=dict)
    category_targets: Mapping[str, int] = field(default_factory=dict)
    capped_taken: frozenset[str] = frozenset()  # ids taken inside capped groups

    def capped(self, p: Prompt) -> bool:
        return p.source in self.source_targets or (p.category is not None and p.category in self.category_targets)

    def keeps(self, p: Prompt) -> bool:
        """Whether the run takes this prompt."""
        if known_before(p, self.skip):
            return False
        # By either id: a plan under a work dir's legacy ids takes what a pass under the content ids chose.
        taken = self.capped_taken
        return not self.capped(p) or p.prompt_id in taken or (p.alias is not None and p.alias in taken)


def choose(
    items: Iterable[Prompt | Reject],
    skip: Collection[str] = frozenset(),
    source_targets: Mapping[str, int] | None = None,
    category_targets: Mapping[str, int] | None = None,
    seed: int = 0,
) -> tuple[Selection, SelectionReport]:
    """One pass over the prompts: skip published ids, and inside capped groups take a seeded sample up to the caps.

    A prompt in a capped source and a capped category counts against both; prompts are considered in seeded
    random order, so each cap takes a uniform sample of what the other cap leaves.
    """
    sources, categories = dict(source_targets or {}), dict(category_targets or {})
    base = Selection(skip=skip, source_targets=sources, category_targets=categories)
    report = SelectionReport()
    available: Counter[str] = Counter()
    selected: Counter[str] = Counter()
    selected_cat: Counter[str] = Counter()
    candidates: list[tuple[int, str, str, str | None]] = []
    for item in items:
        if isinstance(item, Reject):
            continue
        available[item.source] += 1
        if known_before(item, skip):
            report.skipped_published += 1
        elif base.capped(item):
            candidates.append((sample_hash(seed, item.prompt_id), item.prompt_id, item.source, item.category))
        else:
            selected[item.source] += 1
            if item.category is not None:
                selected_cat[item.category] += 1
    candidates.sort()
    taken: set[str] = set()
    per_source: Counter[str] = Counter()
    per_category: Counter[str] = Counter()
    over: Counter[str] = Counter()
    for _, pid, source, category in candidates:
        if pid in taken:
            continue  # the same prompt twice in the sources: planning keeps the first copy only
        fits_source = source not in sources or per_source[source] < sources[source]
        fits_category = category is None or category not in categories or per_category[category] < categories[category]
        if fits_source and fits_category:
            taken.add(pid)
            per_source[source] += 1
            selected[source] += 1
            if category is not None:
                per_category[category] += 1
                selected_cat[category] += 1
        else:
            over[source] += 1
    report.available_by_source = dict(sorted(available.items()))
    report.selected_by_source = dict(sorted(selected.items()))
    report.selected_by_category = dict(sorted(selected_cat.items()))
    report.over_target_by_source = dict(sorted(over.items()))
    selection = Selection(skip=skip, source_targets=sources, category_targets=categories, capped_taken=frozenset(taken))
    return selection, report


def stratified_sample(
    items: Iterable[Prompt | Reject],
    keep: Callable[[Prompt], bool],
    size: int,
    seed: int,
    min_per_source: int = 1,
) -> tuple[frozenset[str], dict[str, int], dict[str, int]]:
    """A seeded sample of about `size` prompts, allocated to sources in proportion to their size.

    Every source gets at least `min_per_source` (or all it has), so small sources still get an estimate.
    Returns the sampled ids, the population per source and the sample size per source. Memory: at most
    `size` hashes per source.
    """
    population: Counter[str] = Counter()
    # Per source, a max-heap (negated) of the `size` smallest hashes seen.
    heaps: dict[str, list[tuple[int, str]]] = {}
    for item in items:
        if isinstance(item, Reject) or not keep(item):
            continue
        population[item.source] += 1
        heap = heaps.setdefault(item.source, [])
        entry = (-sample_hash(seed, item.prompt_id), item.prompt_id)
        if len(heap) < size:
            heapq.heappush(heap, entry)
        elif entry > heap[0]:
            heapq.heapreplace(heap, entry)
    total = sum(population.values())
    chosen: set[str] = set()
    allocated: dict[str, int] = {}
    for source in sorted(population):
        n = population[source]
        want = min(n, max(min_per_source, round(size * n / total)))
        smallest = sorted((-h, pid) for h, pid in heaps[source])[:want]
        chosen.update(pid for _, pid in smallest)
        allocated[source] = len(smallest)
    return frozenset(chosen), dict(sorted(population.items())), allocated


def filtered(keep: Callable[[Prompt], bool]) -> PromptFilter:
    """A planning hook that passes load rejects through and keeps the prompts `keep` accepts."""

    def select(items: Items) -> Items:
        for item in items:
            if isinstance(item, Reject) or keep(item):
                yield item

    return select
