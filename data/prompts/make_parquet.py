# ruff: noqa: E501 (prompt texts are data: one string per prompt reads better than wrapped pieces)
"""Writes mixed_topics.parquet: OpenAI-style "messages" rows with a category (run from any directory).

The rows live here because a parquet file cannot be reviewed in a diff; the parquet file is checked in too.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq

ROWS: list[dict[str, Any]] = [
    {
        "category": "writing",
        "messages": [{"role": "user", "content": "Write a short poem about the first snowfall in a city."}],
    },
    {
        "category": "advice",
        "messages": [
            {
                "role": "system",
                "content": "You are a patient tutor. Explain things step by step and check for understanding.",
            },
            {
                "role": "user",
                "content": "How do I tell my roommate that their late-night guests are keeping me awake, without starting a fight?",
            },
        ],
    },
    {
        "category": "cooking",
        "messages": [
            {"role": "user", "content": "What can I cook for dinner with chickpeas, spinach, canned tomatoes and rice?"}
        ],
    },
    {
        "category": "arts",
        "messages": [
            {"role": "user", "content": "Explain the difference between Impressionism and Expressionism in painting."}
        ],
    },
    {
        "category": "health",
        "messages": [
            {"role": "user", "content": "What is the difference between a cold and the flu?"},
            {"role": "assistant", "content": "OK."},
        ],
    },
    {
        "category": "math",
        "messages": [
            {"role": "user", "content": "Explain what an eigenvector is, with a 2x2 example I can check by hand."}
        ],
    },
    {
        "category": "reasoning",
        "messages": [
            {
                "role": "system",
                "content": "You are a patient tutor. Explain things step by step and check for understanding.",
            },
            {
                "role": "user",
                "content": "You have two ropes that each take exactly one hour to burn, but burn unevenly. How can you measure 45 minutes?",
            },
        ],
    },
    {
        "category": "writing",
        "messages": [
            {"role": "user", "content": "Give me five title ideas for a blog post about learning to run after 40."}
        ],
    },
    {
        "category": "advice",
        "messages": [{"role": "user", "content": "My houseplants keep dying. What are the most common mistakes?"}],
    },
    {
        "category": "cooking",
        "messages": [{"role": "user", "content": "How do I cook perfect fluffy rice on the stove?"}],
    },
    {
        "category": "arts",
        "messages": [
            {"role": "user", "content": "Explain the basic chords of the blues and the 12-bar structure."},
            {"role": "assistant", "content": "Great question! Let me explain."},
        ],
    },
    {
        "category": "health",
        "messages": [
            {
                "role": "system",
                "content": "You are a patient tutor. Explain things step by step and check for understanding.",
            },
            {"role": "user", "content": "What are some evidence-based ways to reduce stress?"},
        ],
    },
    {
        "category": "math",
        "messages": [{"role": "user", "content": "How many different ways can 8 people sit around a round table?"}],
    },
    {
        "category": "reasoning",
        "messages": [
            {
                "role": "user",
                "content": "You are in a room with three light switches, each controlling one of three bulbs in another room. You can enter that room only once. How do you find which switch controls which bulb?",
            }
        ],
    },
    {
        "category": "writing",
        "messages": [{"role": "user", "content": "Write a short children's story about a turtle who wants to fly."}],
    },
    {
        "category": "advice",
        "messages": [
            {
                "role": "user",
                "content": "I have a job interview tomorrow for a customer service role. What questions should I expect?",
            }
        ],
    },
    {
        "category": "cooking",
        "messages": [
            {
                "role": "system",
                "content": "You are a patient tutor. Explain things step by step and check for understanding.",
            },
            {"role": "user", "content": "What spices go well with roasted cauliflower?"},
            {"role": "assistant", "content": "OK."},
        ],
    },
    {
        "category": "arts",
        "messages": [{"role": "user", "content": "What is the difference between a sonnet and a villanelle?"}],
    },
    {
        "category": "health",
        "messages": [{"role": "user", "content": "What happens to the body during a panic attack?"}],
    },
    {
        "category": "math",
        "messages": [
            {
                "role": "user",
                "content": "Explain the difference between a permutation and a combination with a concrete example.",
            }
        ],
    },
    {
        "category": "reasoning",
        "messages": [
            {
                "role": "user",
                "content": "There are 100 doors, all closed. On pass k you toggle every k-th door, for k from 1 to 100. Which doors are open at the end?",
            }
        ],
    },
    {
        "category": "writing",
        "messages": [
            {
                "role": "system",
                "content": "You are a patient tutor. Explain things step by step and check for understanding.",
            },
            {
                "role": "user",
                "content": "Write a dialogue between a barista and a customer who cannot decide what to order.",
            },
        ],
    },
    {
        "category": "advice",
        "messages": [
            {"role": "user", "content": "What should I do in the first hour after my phone is stolen?"},
            {"role": "assistant", "content": "Great question! Let me explain."},
        ],
    },
    {
        "category": "cooking",
        "messages": [{"role": "user", "content": "How do I sharpen a kitchen knife with a whetstone?"}],
    },
    {
        "category": "arts",
        "messages": [{"role": "user", "content": "How do I start learning to draw people if I have no experience?"}],
    },
    {
        "category": "health",
        "messages": [{"role": "user", "content": "What are the recommended vaccines for adults over 50?"}],
    },
    {
        "category": "math",
        "messages": [
            {
                "role": "system",
                "content": "You are a patient tutor. Explain things step by step and check for understanding.",
            },
            {
                "role": "user",
                "content": "What is Bayes' theorem? Walk through the classic medical test example with a 1% base rate.",
            },
        ],
    },
    {
        "category": "reasoning",
        "messages": [
            {"role": "user", "content": "A clock shows 3:15. What is the angle between the hour and minute hands?"}
        ],
    },
    {
        "category": "writing",
        "messages": [
            {"role": "user", "content": "Write a flash fiction piece of about 200 words that ends with a twist."},
            {"role": "assistant", "content": "OK."},
        ],
    },
    {
        "category": "advice",
        "messages": [{"role": "user", "content": "What questions should I ask when adopting a rescue dog?"}],
    },
    {"category": "cooking", "messages": [{"role": "user", "content": "What are good substitutes for eggs in baking?"}]},
    {
        "category": "arts",
        "messages": [
            {
                "role": "system",
                "content": "You are a patient tutor. Explain things step by step and check for understanding.",
            },
            {"role": "user", "content": "What should I listen to if I want to get into jazz?"},
        ],
    },
]

SCHEMA = pa.schema(
    [
        pa.field("category", pa.string()),
        pa.field("messages", pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))),
    ]
)


def main() -> None:
    """Write the parquet file next to this script."""
    table = pa.Table.from_pylist(ROWS, schema=SCHEMA)
    pq.write_table(table, Path(__file__).with_name("mixed_topics.parquet"), compression="zstd")


if __name__ == "__main__":
    main()
