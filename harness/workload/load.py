"""The load phase's requests (pure): unique prompts of mixed lengths, exact multiples of the block size and ±1
among them, and which of them the client cancels (while P prefills, or after a few streamed tokens from D).

Prompts are token ids, so their lengths are exact: the ids come from tokenizing generated text on a server
of the run (``/tokenize``), cut to length. Every prompt is unique from its first token block on.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import asdict, dataclass

from harness.workload.prompts import VOCAB

ABORT_HOPS = ("prefill", "decode")


@dataclass(frozen=True)
class LoadSettings:
    requests: int = 96
    concurrency: int = 8
    abort_every: int = 8  # every n-th request is cancelled by the client (0: none); prefill and decode alternate
    abort_after_tokens: int = 3  # a decode abort closes the stream after this many tokens
    abort_max_tokens: int = 160  # decode aborts ask for a long completion, so the cancel lands mid-decode
    leak_deadline_s: float = 30.0  # after the run, P and D must be idle within this (see checks/leak.py)

    def validate(self) -> None:
        if self.requests < 0 or self.concurrency < 1 or self.abort_every < 0 or self.abort_after_tokens < 1:
            raise ValueError(
                "load settings: requests >= 0, concurrency >= 1, abort_every >= 0, abort_after_tokens >= 1"
            )

    @property
    def enabled(self) -> bool:
        return self.requests > 0

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class LoadRequest:
    id: str
    length: int  # prompt tokens
    shape: str  # how the length relates to the block size: "k*bs", "k*bs-1", "k*bs+1" or "other"
    max_tokens: int
    abort: str | None = None  # None, "prefill" or "decode"
    abort_after_tokens: int = 0  # decode aborts: close the stream after this many tokens

    def to_dict(self) -> dict:
        return asdict(self)


def lengths(n: int, block_size: int, max_len: int, seed: int = 0) -> list[tuple[int, str]]:
    """``n`` prompt lengths: k*bs, k*bs-1 and k*bs+1 for k = 1, 2, ... while they fit, then others in [1, max_len]."""
    if max_len < 2:
        raise ValueError(f"max prompt length {max_len} leaves no room for a load prompt")
    edge: list[tuple[int, str]] = []
    k = 1
    while k * block_size - 1 <= max_len:
        for off, shape in ((0, "k*bs"), (-1, "k*bs-1"), (1, "k*bs+1")):
            length = k * block_size + off
            if 1 <= length <= max_len:
                edge.append((length, shape))
        k += 1
    rng = random.Random(seed)
    out: list[tuple[int, str]] = []
    while len(out) < n:
        if edge and len(out) % 4 != 3:  # three edge lengths for every other one, edges first to last
            out.append(edge[(len(out) - len(out) // 4) % len(edge)])
        else:
            length = rng.randint(1, max_len)
            out.append(
                (length, "other" if length % block_size not in (0, 1, block_size - 1) else _shape(length, block_size))
            )
    return out


def _shape(length: int, bs: int) -> str:
    r = length % bs
    return "k*bs" if r == 0 else "k*bs+1" if r == 1 else "k*bs-1"


def plan_load(
    s: LoadSettings, block_size: int, max_model_len: int, max_tokens: int, seed: int = 0
) -> list[LoadRequest]:
    """The load phase's requests in the order they are sent (lengths interleaved, aborts spread out)."""
    s.validate()
    plain = lengths(s.requests, block_size, max_model_len - max_tokens, seed)
    abort_room = max(2, max_model_len - s.abort_max_tokens)
    out = []
    hop = 0
    for i, (length, shape) in enumerate(plain):
        abort = None
        if s.abort_every and (i + 1) % s.abort_every == 0:
            abort = ABORT_HOPS[hop % 2]
            hop += 1
        if abort == "decode":
            length = min(length, abort_room)
            shape = _shape(length, block_size) if length % block_size in (0, 1, block_size - 1) else "other"
        mt = s.abort_max_tokens if abort == "decode" else max_tokens
        out.append(
            LoadRequest(
                f"load{i:03d}-t{length}", length, shape, mt, abort, s.abort_after_tokens if abort == "decode" else 0
            )
        )
    random.Random(seed + 1).shuffle(out)  # mixed lengths in flight at once
    return out


def token_prompts(
    requests: list[LoadRequest], tokenize: Callable[[str], list[int]], seed: int = 0
) -> dict[str, list[int]]:
    """Token ids of each request's prompt, exactly ``length`` long and unique from the first block on."""
    return unique_token_prompts({r.id: r.length for r in requests}, tokenize, seed)


def unique_token_prompts(
    lengths: dict[str, int], tokenize: Callable[[str], list[int]], seed: int = 0
) -> dict[str, list[int]]:
    """Token ids for each id, exactly its length long, no two sharing their first 16 tokens.

    ``tokenize`` is a server's /tokenize (text -> ids, BOS included where the model adds one)."""
    out: dict[str, list[int]] = {}
    seen: set[tuple[int, ...]] = set()
    for rid, length in lengths.items():
        rng = random.Random(f"{seed}:{rid}")
        words = max(8, length + 8)
        for _ in range(8):
            # The id first: unique per prompt, so no two prompts share a leading block.
            text = f"{rid} " + " ".join(rng.choice(VOCAB) for _ in range(words))
            ids = tokenize(text)
            if len(ids) >= length:
                break
            words *= 2
        else:
            raise ValueError(f"{rid}: tokenizing {words} words gave only {len(ids)} tokens, {length} needed")
        ids = ids[:length]
        key = tuple(ids[:16])
        if len(ids) >= 16 and key in seen:
            raise ValueError(f"{rid}: its first 16 tokens repeat another prompt's")
        seen.add(key)
        out[rid] = ids
    return out
