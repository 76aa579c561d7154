"""A generated corpus of repetitive completions: legitimate structured answers and real (degenerate) loops.

Seeded and varied: every sample draws its family, sizes, words, numbers and placement from its own RNG, so
the corpus is many different texts, not copies of one. Used by tests/unit/test_repetition.py and the figures in
docs/data-quality.md.

Legitimate (the repetition is the answer): zero/identity/constant matrices (LaTeX, plain, Python), markdown
tables, CSV rows, code with repeated rows, separators between sections, songs with a chorus (2-4 times), grids.
Loops (degenerate): a sentence or paragraph repeated back to back, a sentence the model keeps coming back to
between fresh text (interleaved), a cycle of 2-3 sentences with a changing counter; covering 15-50% of the
completion; and loops that run until the token limit.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

WORDS = [
    "the",
    "model",
    "checks",
    "each",
    "value",
    "against",
    "the",
    "bound",
    "and",
    "then",
    "moves",
    "on",
    "to",
    "the",
    "next",
    "case",
    "because",
    "the",
    "sum",
    "depends",
    "on",
    "how",
    "many",
    "terms",
    "remain",
    "after",
    "we",
    "remove",
    "duplicates",
    "from",
    "the",
    "list",
    "so",
    "we",
    "need",
    "a",
    "careful",
    "count",
    "of",
    "every",
    "element",
    "in",
    "the",
    "set",
    "while",
    "keeping",
    "track",
    "of",
    "signs",
    "angles",
    "lengths",
    "weights",
    "and",
    "the",
    "total",
    "cost",
    "which",
    "should",
    "match",
    "the",
    "expected",
    "result",
    "if",
    "the",
    "derivation",
    "is",
    "right",
    "otherwise",
    "we",
    "revisit",
    "the",
    "step",
    "where",
    "the",
    "factor",
    "appeared",
    "and",
    "recompute",
    "it",
    "with",
    "the",
    "corrected",
    "coefficient",
    "using",
    "the",
    "identity",
    "from",
    "earlier",
    "note",
    "that",
    "the",
    "matrix",
    "is",
    "symmetric",
    "hence",
    "its",
    "eigenvalues",
    "are",
    "real",
    "and",
    "the",
    "trace",
    "equals",
    "their",
    "sum",
]
LYRIC = [
    "love",
    "night",
    "fire",
    "heart",
    "rain",
    "road",
    "light",
    "home",
    "dream",
    "sky",
    "sing",
    "dance",
    "river",
    "golden",
    "slow",
    "gone",
]


def _sentence(rng: random.Random, lo: int = 8, hi: int = 18) -> str:
    words = [rng.choice(WORDS) for _ in range(rng.randint(lo, hi))]
    if rng.random() < 0.4:
        words.insert(rng.randrange(len(words)), str(rng.randint(2, 999)))
    return " ".join(words).capitalize() + rng.choice([".", ".", ".", "?", ":"])


def prose(rng: random.Random, n_sentences: int) -> str:
    """Fresh reasoning-like text: random sentences, no loop (hardly an 8-gram repeats)."""
    return " ".join(_sentence(rng) for _ in range(n_sentences))


@dataclass(frozen=True)
class Sample:
    """One completion text: its family, whether it is a loop, and how it finished."""

    family: str
    text: str
    loop: bool
    finish: str = "stop"


def _wrap(rng: random.Random, answer: str, reasoning_sentences: tuple[int, int] = (2, 30)) -> str:
    # Short reasoning is common for a direct request ("write the 12x12 zero matrix"), and the structure is often
    # the last thing in the completion: both are what the old rules mistook for a loop.
    reasoning = prose(rng, rng.randint(*reasoning_sentences))
    intro = rng.choice(["Here is the result:", "The answer:", "Result", "Sure, here it is.", ""])
    outro = rng.choice(["", "", "Let me know if you need more.", prose(rng, 1)])
    return f"{reasoning}\n</think>\n\n{intro}\n\n{answer}\n\n{outro}".rstrip()


# --------------------------------------------------------------------------------------------- legitimate


def zero_matrix(rng: random.Random) -> str:
    n, m = rng.randint(6, 16), rng.randint(6, 16)
    value = rng.choice(["0", "0", "1", "0.0", "x"])
    style = rng.choice(["latex", "plain", "python"])
    if style == "latex":
        rows = " \\\\\n".join(" & ".join([value] * m) for _ in range(n))
        return f"$$\n\\begin{{bmatrix}}\n{rows}\n\\end{{bmatrix}}\n$$"
    if style == "plain":
        return "\n".join(" ".join([value] * m) for _ in range(n))
    return "M = [\n" + "\n".join("    [" + ", ".join([value] * m) + "]," for _ in range(n)) + "\n]"


def identity_matrix(rng: random.Random) -> str:
    n = rng.randint(6, 14)
    rows = [" & ".join("1" if i == j else "0" for j in range(n)) for i in range(n)]
    return "$$\nI = \\begin{pmatrix}\n" + " \\\\\n".join(rows) + "\n\\end{pmatrix}\n$$"


def markdown_table(rng: random.Random) -> str:
    cols = rng.sample(["id", "name", "score", "status", "count", "price", "region", "total"], rng.randint(3, 5))
    rows = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    status = rng.choice(["ok", "pending", "N/A", "0"])
    for i in range(rng.randint(12, 40)):
        cells = [str(i + 1) if c == "id" else (status if rng.random() < 0.7 else str(rng.randint(0, 99))) for c in cols]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def csv_rows(rng: random.Random) -> str:
    n_cols = rng.randint(3, 7)
    header = ",".join(f"c{j}" for j in range(n_cols))
    fill = rng.choice(["0", "0.00", "NULL", "-1"])
    return header + "\n" + "\n".join(",".join([fill] * n_cols) for _ in range(rng.randint(15, 50)))


def code_rows(rng: random.Random) -> str:
    kind = rng.choice(["layers", "zeros", "registers", "asserts", "bytes"])
    n = rng.randint(8, 30)
    if kind == "layers":
        width = rng.choice([32, 64, 128])
        body = "\n".join(f"model.add(Dense({width}, activation='relu'))" for _ in range(n))
        return f"```python\nmodel = Sequential()\n{body}\nmodel.add(Dense(1))\n```"
    if kind == "zeros":
        return "```c\n" + "\n".join("    buf[i++] = 0;" for _ in range(n)) + "\n```"
    if kind == "registers":
        return "```asm\n" + "\n".join("    nop" for _ in range(n)) + "\n    ret\n```"
    if kind == "asserts":
        return "```python\n" + "\n".join("assert f(0) == 0" for _ in range(n)) + "\n```"
    return "```python\ndata = bytes([\n" + "\n".join("    0x00, 0x00, 0x00, 0x00," for _ in range(n)) + "\n])\n```"


def separators(rng: random.Random) -> str:
    line = rng.choice(["-" * 40, "=" * 30, "* * *", "---", "~" * 20, "#" * 50])
    parts = [prose(rng, rng.randint(1, 3)) for _ in range(rng.randint(6, 14))]
    return f"\n{line}\n".join(parts) + f"\n{line}\n{line}\n{line}"


def song(rng: random.Random) -> str:
    def line() -> str:
        return " ".join(rng.choice(LYRIC) for _ in range(rng.randint(4, 8))).capitalize()

    chorus = "\n".join(line() for _ in range(rng.randint(2, 4)))
    verses = ["\n".join(line() for _ in range(4)) for _ in range(rng.randint(2, 4))]
    parts: list[str] = []
    for k, verse in enumerate(verses):
        parts += [f"[Verse {k + 1}]\n{verse}", f"[Chorus]\n{chorus}"]
    return "\n\n".join(parts[: 2 * min(len(verses), 4)])


def grid(rng: random.Random) -> str:
    n = rng.randint(8, 16)
    cell = rng.choice([".", "#", "0", "_"])
    return "```\n" + "\n".join(" ".join([cell] * n) for _ in range(n)) + "\n```"


LEGIT: dict[str, Callable[[random.Random], str]] = {
    "zero_matrix": zero_matrix,
    "identity_matrix": identity_matrix,
    "markdown_table": markdown_table,
    "csv_rows": csv_rows,
    "code_rows": code_rows,
    "separators": separators,
    "song": song,
    "grid": grid,
}


# --------------------------------------------------------------------------------------------- loops


def _share_target(rng: random.Random) -> float:
    return rng.uniform(0.15, 0.5)


def _loop_completion(rng: random.Random, unit: Callable[[int], str], interleave: bool) -> str:
    """Fresh reasoning around copies of `unit(k)` that make up a 15-50% share of the characters."""
    share = _share_target(rng)
    head = prose(rng, rng.randint(15, 40))
    tail = prose(rng, rng.randint(3, 12))
    fresh = len(head) + len(tail)
    copies: list[str] = []
    k = 0
    while sum(map(len, copies)) < share / (1 - share) * fresh or len(copies) < 3:
        copies.append(unit(k))
        k += 1
    # Interleaved: fresh text between the copies, as long as a copy or longer, so the loop is never back to back.
    loop = " ".join(f"{c} {_sentence(rng, 8, 20)}" for c in copies) if interleave else " ".join(copies)
    return f"{head} {loop} {tail}\n</think>\n\n{prose(rng, rng.randint(1, 3))}"


def sentence_loop(rng: random.Random) -> str:
    s = _sentence(rng, 6, 16)
    return _loop_completion(rng, lambda k: s, interleave=False)


def paragraph_loop(rng: random.Random) -> str:
    p = prose(rng, rng.randint(2, 4))
    return _loop_completion(rng, lambda k: p, interleave=False)


def interleaved_loop(rng: random.Random) -> str:
    s = rng.choice(["Wait, ", "Hmm, ", "No, ", ""]) + _sentence(rng, 8, 16)
    return _loop_completion(rng, lambda k: s, interleave=True)


def counter_cycle(rng: random.Random) -> str:
    cycle = [_sentence(rng, 6, 12) for _ in range(rng.randint(2, 3))]
    label = rng.choice(["Step", "Case", "Attempt", "Check"])
    return _loop_completion(rng, lambda k: f"{label} {k + 1}: " + " ".join(cycle), interleave=rng.random() < 0.5)


def loop_until_limit(rng: random.Random) -> str:
    s = _sentence(rng, 5, 14)
    return prose(rng, rng.randint(10, 30)) + " " + " ".join([s] * rng.randint(20, 60))


LOOPS: dict[str, Callable[[random.Random], str]] = {
    "sentence_loop": sentence_loop,
    "paragraph_loop": paragraph_loop,
    "interleaved_loop": interleaved_loop,
    "counter_cycle": counter_cycle,
    "loop_until_limit": loop_until_limit,
}


def corpus(n_legit: int = 80, n_loops: int = 60, seed: int = 23) -> list[Sample]:
    """`n_legit` legitimate repetitive answers and `n_loops` loops, families in turn, each with its own RNG."""
    out: list[Sample] = []
    legit, loops = list(LEGIT.items()), list(LOOPS.items())
    for i in range(n_legit):
        name, make = legit[i % len(legit)]
        out.append(Sample(name, _wrap(random.Random(seed * 100_003 + i), make(random.Random(seed + i))), False))
    for i in range(n_loops):
        name, make = loops[i % len(loops)]
        text = make(random.Random(seed * 7919 + i))
        out.append(Sample(name, text, True, "length" if name == "loop_until_limit" else "stop"))
    return out
