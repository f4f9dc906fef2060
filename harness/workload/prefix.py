"""Decode-side prefix-cache scenarios (pure): which prompts, in which order, and how D must source each one's
prompt tokens between its own cache and the transfer from P.

With D's prefix cache on, D takes from its cache the longest block-aligned prefix it holds, never the whole
prompt (vLLM keeps at least the last token to compute, so a hit is at most floor((N-1)/B) blocks), and pulls
the rest from P over NIXL. So each request's split is exact and known before it is sent:
``local_cache_hit`` = the hit, ``external_kv_transfer`` = N - hit, ``local_compute`` = 0.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

SOURCES = ("local_compute", "local_cache_hit", "external_kv_transfer")
BLOCKS = 3  # k of the k*bs-sized prompts: small enough for bs 64 within 512 tokens, large enough for a partial hit
TAIL = 10  # new tokens after the shared prefix of a partial hit
SHORT = 5  # a prompt shorter than a block: never a hit


@dataclass(frozen=True)
class PrefixCase:
    id: str
    scenario: str  # cold | full-hit | partial-hit | short
    shape: str  # k*bs, k*bs+1, k*bs-1, 2*bs+tail, short
    base: str  # the unique token sequence it is cut from
    length: int
    shared: int = 0  # partial hit: tokens taken from the start of ``base``; the rest comes from ``tail_of``
    tail_of: str | None = None

    def to_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class Expected:
    local_cache_hit: int
    external_kv_transfer: int
    local_compute: int = 0

    def as_dict(self) -> dict[str, int]:
        return {s: getattr(self, s) for s in SOURCES}


def plan_prefix(block_size: int) -> list[PrefixCase]:
    """Cold then again (a full hit) at k*bs, k*bs+1 and k*bs-1 tokens; a partial hit (2 blocks of the k*bs prompt
    and a new tail); a prompt shorter than a block, twice."""
    b = block_size
    cases: list[PrefixCase] = []
    for shape, length in (("k*bs", BLOCKS * b), ("k*bs+1", BLOCKS * b + 1), ("k*bs-1", BLOCKS * b - 1)):
        base = f"pfx-{shape.replace('k*bs', f'{BLOCKS}bs')}"
        cases += [
            PrefixCase(f"{base}-cold", "cold", shape, base, length),
            PrefixCase(f"{base}-again", "full-hit", shape, base, length),
        ]
    cases.append(
        PrefixCase(
            "pfx-partial", "partial-hit", "2*bs+tail", f"pfx-{BLOCKS}bs", 2 * b + TAIL, shared=2 * b, tail_of="pfx-tail"
        )
    )
    cases += [
        PrefixCase("pfx-short-cold", "cold", "short", "pfx-short", SHORT),
        PrefixCase("pfx-short-again", "full-hit", "short", "pfx-short", SHORT),
    ]
    return cases


def base_lengths(cases: list[PrefixCase]) -> dict[str, int]:
    """The unique token sequences the cases are cut from, and how long each must be."""
    out: dict[str, int] = {}
    for c in cases:
        out[c.base] = max(out.get(c.base, 0), c.shared or c.length)
        if c.tail_of:
            out[c.tail_of] = max(out.get(c.tail_of, 0), c.length - c.shared)
    return out


def case_prompts(cases: list[PrefixCase], bases: dict[str, list[int]]) -> dict[str, list[int]]:
    """Each case's prompt token ids, cut from ``bases`` (unique sequences of at least ``base_lengths``)."""
    out = {}
    for c in cases:
        if c.tail_of:
            out[c.id] = bases[c.base][: c.shared] + bases[c.tail_of][: c.length - c.shared]
        else:
            out[c.id] = bases[c.base][: c.length]
    return out


def expected_sources(prompts: list[list[int]], block_size: int) -> list[Expected]:
    """D's split of each prompt, sent one after another into a prefix cache that held none of them and evicts none."""
    cached: set[tuple[int, ...]] = set()
    out = []
    for ids in prompts:
        n = len(ids)
        hit = 0
        for blocks in range(
            (n - 1) // block_size, 0, -1
        ):  # the longest cached block-aligned prefix, at most N-1 tokens
            if tuple(ids[: blocks * block_size]) in cached:
                hit = blocks * block_size
                break
        out.append(Expected(hit, n - hit))
        cached.update(tuple(ids[: j * block_size]) for j in range(1, n // block_size + 1))
    return out
