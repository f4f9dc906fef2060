"""The fixed prompt set: the word texts stay byte for byte (baseline-cache keys and recorded prompts depend on them),
and ``token_exact`` makes each prompt exactly its intended length in another tokenizer's ids."""

from __future__ import annotations

import hashlib
import json

import pytest

from harness.workload.prompts import WORD_COUNTS, Prompt, prompt_set, token_exact

BOS = 1

# sha256 of [[id, text], ...] as the baseline-cache key holds it (canonical JSON), per seed: a change to a word text
# would key every cached baseline of the harness's own models anew.
PINNED = {
    0: "4a5782f49259881201dfd0ad1020066849ee706aa3a4186389248f271887c1ea",
    1: "9ba301296c812a281dc457e0bee0c3e28cb62ebf4a3c84df55e713657cd98869",
    7: "54dbb0789f6fbb6e3fc740358e726aa8e3fb7c1a2ac9fc8c431ad59d6a3a6a69",
}


def digest(prompts: list[Prompt]) -> str:
    rows = json.dumps([[p.id, p.payload] for p in prompts], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(rows.encode()).hexdigest()


@pytest.mark.parametrize("seed", sorted(PINNED))
def test_the_word_texts_are_pinned(seed):
    prompts = prompt_set(seed)
    assert digest(prompts) == PINNED[seed]
    assert all(p.ids is None and p.payload == p.text for p in prompts)


def char_bos(text: str) -> list[int]:
    """A tokenizer of one token a character, with a BOS first (as many models' post-processors add one)."""
    return [BOS] + [ord(c) for c in text]


def two_words_a_token(text: str) -> list[int]:
    """A coarse tokenizer: two words make one token, so a prompt's own words are too few tokens."""
    words = text.split()
    return [sum(map(ord, " ".join(words[i : i + 2]))) % 1000 + 10 for i in range(0, len(words), 2)]


def test_each_prompt_becomes_exactly_its_intended_length_in_the_models_tokens():
    words = prompt_set(0)
    exact = token_exact(words, char_bos)
    assert [len(p.ids or ()) for p in exact] == list(WORD_COUNTS)
    assert [(p.id, p.words) for p in exact] == [(p.id, p.words) for p in words]  # id and intent kept
    for w, e in zip(words, exact, strict=True):
        assert e.text == w.text and list(e.ids or ()) == char_bos(w.text)[: w.words]  # its own text's first tokens
        assert e.payload == list(e.ids or ())
    assert exact[0].ids == (BOS,)  # the 1-token prompt: the BOS the tokenizer starts every text with


def test_a_text_too_short_in_the_models_tokens_grows_by_seeded_words():
    exact = token_exact(prompt_set(0), two_words_a_token, seed=3)
    assert [len(p.ids or ()) for p in exact] == list(WORD_COUNTS)
    long = next(p for p in exact if p.id == "p17-w240")
    assert long.text.startswith(prompt_set(0)[17].text + " ") and len(two_words_a_token(long.text)) >= 240
    assert token_exact(prompt_set(0), two_words_a_token, seed=3) == exact  # deterministic


def test_a_tokenizer_that_cannot_make_a_prompt_that_long_is_named():
    with pytest.raises(ValueError, match="p17-w240: .* 240 needed"):
        token_exact(prompt_set(0)[-1:], lambda text: [5, 6])
