"""The load phase's plan: lengths at block edges, unique prompts of exact length, aborts spread over both hops."""

import pytest

from harness.workload.load import LoadSettings, lengths, plan_load, token_prompts


def test_lengths_cover_every_block_edge_that_fits_then_others():
    got = lengths(60, 32, 200, seed=1)
    edges = {(k * 32 + off) for k in range(1, 7) for off in (-1, 0, 1) if k * 32 + off <= 200}
    assert edges <= {n for n, _ in got}
    assert all(1 <= n <= 200 for n, _ in got)
    for n, shape in got:
        expected = {0: "k*bs", 1: "k*bs+1", 31: "k*bs-1"}.get(n % 32, "other")
        assert shape == expected, (n, shape)


def test_the_plan_spreads_aborts_over_both_hops_and_fits_the_context():
    s = LoadSettings(requests=96, abort_every=8, abort_max_tokens=160)
    plan = plan_load(s, 32, 512, 16)
    assert len(plan) == 96 and len({r.id for r in plan}) == 96
    aborts = [r for r in plan if r.abort]
    assert len(aborts) == 12
    assert sum(r.abort == "prefill" for r in aborts) == sum(r.abort == "decode" for r in aborts) == 6
    for r in plan:
        assert r.length + r.max_tokens <= 512, r
        assert (r.abort == "decode") == (r.abort_after_tokens > 0)
    assert plan != sorted(plan, key=lambda r: r.id), "lengths are mixed in flight, not sent in plan order"
    assert plan == plan_load(s, 32, 512, 16), "the plan is deterministic"


def test_no_aborts_when_abort_every_is_zero():
    assert not any(r.abort for r in plan_load(LoadSettings(requests=20, abort_every=0), 32, 512, 16))


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        plan_load(LoadSettings(requests=4, concurrency=0), 32, 512, 16)
    with pytest.raises(ValueError):
        lengths(3, 32, 1)


def test_token_prompts_have_exact_lengths_and_unique_heads():
    plan = plan_load(LoadSettings(requests=30), 32, 512, 16)
    vocab: dict[str, int] = {}

    def tokenize(text: str) -> list[int]:  # one id per word, like a word-level tokenizer, with a BOS
        return [0] + [vocab.setdefault(w, len(vocab) + 1) for w in text.split()]

    prompts = token_prompts(plan, tokenize)
    assert {r.id: len(prompts[r.id]) for r in plan} == {r.id: r.length for r in plan}
    heads = [tuple(prompts[r.id][:16]) for r in plan if r.length >= 16]
    assert len(heads) == len(set(heads))


def test_a_tokenizer_that_cannot_give_enough_tokens_is_an_error():
    plan = plan_load(LoadSettings(requests=3), 32, 512, 16)
    with pytest.raises(ValueError, match="tokens"):
        token_prompts(plan, lambda text: [1, 2, 3])
