"""The fixed prompt set every run compares: deterministic, from one word to many KV blocks."""

from __future__ import annotations

import random
from dataclasses import dataclass

# Word counts chosen to cover: a single token, short prompts inside one block,
# lengths around a 32-token block edge, and prompts spanning many blocks while
# prompt + completion stays well inside a 512-token context.
WORD_COUNTS = (1, 2, 3, 5, 8, 13, 21, 30, 31, 32, 33, 47, 64, 96, 128, 160, 200, 240)

VOCAB = [
    "the",
    "river",
    "runs",
    "past",
    "an",
    "old",
    "stone",
    "house",
    "where",
    "a",
    "red",
    "cat",
    "sleeps",
    "near",
    "seven",
    "green",
    "trees",
    "while",
    "north",
    "wind",
    "brings",
    "rain",
    "over",
    "the",
    "city",
    "and",
    "people",
    "count",
    "numbers",
    "like",
    "twelve",
    "forty",
    "nine",
    "or",
    "one",
    "hundred",
    "then",
    "ask",
    "what",
    "the",
    "answer",
    "is",
    "before",
    "the",
    "sun",
    "sets",
    "behind",
    "silver",
    "hills",
    "far",
    "to",
    "the",
    "west",
]


@dataclass(frozen=True)
class Prompt:
    id: str
    text: str
    words: int


def prompt_set(seed: int = 0, word_counts: tuple[int, ...] = WORD_COUNTS) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(word_counts):
        # Distinct first words, so no two prompts share a leading block.
        first = VOCAB[i % len(VOCAB)]
        words = [first] + [rng.choice(VOCAB) for _ in range(n - 1)]
        out.append(Prompt(id=f"p{i:02d}-w{n}", text=" ".join(words), words=n))
    return out
