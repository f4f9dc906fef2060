"""The fixed prompt set every run compares: deterministic, from one word to many KV blocks.

Each prompt is meant to be as many tokens long as it has words (its id says how many: ``p17-w240``). The trained
model's tokenizer makes them that (the tiny models' make the longer ones longer); for another model's tokenizer,
``token_exact`` makes each prompt exactly that many of its tokens, as token ids.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

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
    text: str  # with ``ids``: the text they are the first tokens of
    words: int  # its words, and the length in tokens it is meant to have
    ids: tuple[int, ...] | None = None  # the model's own tokens, sent instead of the text (exactly ``words`` of them)

    @property
    def payload(self) -> str | list[int]:
        """What a completion request sends as its prompt: the token ids where there are, else the text."""
        return list(self.ids) if self.ids is not None else self.text


def prompt_set(seed: int = 0, word_counts: tuple[int, ...] = WORD_COUNTS) -> list[Prompt]:
    rng = random.Random(seed)
    out = []
    for i, n in enumerate(word_counts):
        # Distinct first words, so no two prompts share a leading block.
        first = VOCAB[i % len(VOCAB)]
        words = [first] + [rng.choice(VOCAB) for _ in range(n - 1)]
        out.append(Prompt(id=f"p{i:02d}-w{n}", text=" ".join(words), words=n))
    return out


def token_exact(prompts: Sequence[Prompt], encode: Callable[[str], list[int]], seed: int = 0) -> list[Prompt]:
    """Each prompt as exactly ``words`` token ids of ``encode`` (a model's tokenizer, special tokens included as it
    adds them, as a server would for the text): the first ``words`` tokens of its own text, which grows by more words
    of the same kind (seeded by the prompt's id) where it is shorter than that in these tokens. The id, the intended
    length and the first words stay, so the prompts keep their distinct starts."""
    out = []
    for p in prompts:
        rng = random.Random(f"{seed}:{p.id}")
        text = p.text
        ids = encode(text)
        for _ in range(8):  # each word is a token or more in any usual tokenizer: once is almost always enough
            if len(ids) >= p.words:
                break
            text += " " + " ".join(rng.choice(VOCAB) for _ in range(max(8, p.words)))
            ids = encode(text)
        if len(ids) < p.words:
            raise ValueError(f"{p.id}: {len(text.split())} words are only {len(ids)} tokens here, {p.words} needed")
        out.append(replace(p, text=text, ids=tuple(ids[: p.words])))
    return out
