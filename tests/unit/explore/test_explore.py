"""explore with a fake oracle instead of vLLM: the sampler (deterministic, covering, within vLLM's block rule,
favouring TP boundaries), the signature dedupe, the skip logic, resume, and a planted failure that one axis value
triggers found, deduplicated across samples and narrowed to that value."""

from __future__ import annotations

import io
from collections import Counter
from typing import Any

import pytest

from harness.core.errors import ConfigError
from harness.explore.cli import Explore, Ran, explore
from harness.explore.results import Results, findings, render
from harness.explore.sample import Sampler
from harness.explore.space import Space, load_space
from harness.matrix.config import EDGE_YAML, load_matrix

SPACE: dict[str, Any] = {
    "models": [{"id": "tiny-llama", "kv_heads": [1, 2]}],
    "axes": {
        "tp_p": {"values": [1, 2]},
        "tp_d": {"values": [1, 2, 4]},
        "block_size_p": {"values": [16, 32]},
        "block_size_d": {"values": [16, 32, 64]},
        "max_num_batched_tokens_p": {"values": [None, 64]},
        "prefix_caching_d": {"values": [False, True]},
    },
}


def space(**over) -> Space:
    return Space.model_validate({**SPACE, **over})


def test_the_shipped_space_is_valid():
    assert load_space().models


def test_a_seed_draws_the_same_samples_and_another_seed_others():
    ids = [[Sampler(space(), seed).draw().id for _ in range(10)] for seed in (1, 1, 2)]
    assert ids[0] == ids[1] and ids[0] != ids[2]


def test_draws_cover_every_value_keep_p_blocks_dividing_d_blocks_and_favour_tp_boundaries():
    sampler = Sampler(space(), 3)
    draws = [sampler.draw() for _ in range(300)]
    for axis, choice in SPACE["axes"].items():
        assert {s.values[axis] for s in draws} == set(choice["values"]), axis
    assert all(s.values["block_size_d"] % s.values["block_size_p"] == 0 for s in draws)
    tp_d = Counter(s.values["tp_d"] for s in draws)
    assert tp_d[4] < tp_d[1] and tp_d[4] < tp_d[2]  # 1 and 2 are K or 2K of K in {1, 2}; 4 is neither


def test_a_space_with_an_unknown_axis_is_refused():
    with pytest.raises(ValueError, match="unknown axis"):
        space(axes={"tp_q": {"values": [1]}})


class PlantedFault:
    """The fake oracle: every sample with P's chunked prefill (max_num_batched_tokens_p 64) fails the KV digest."""

    def __init__(self):
        self.ran: list[str] = []

    def __call__(self, p, version):
        self.ran.append(p.id)
        if p.settings.get("max_num_batched_tokens_p") == 64:
            checks = [{"name": "kv_digest_match", "passed": False}, {"name": "outputs_match_baseline", "passed": True}]
            return Ran("kv-digest-mismatch", {"verdict": "fail", "checks": checks}, f"/runs/{p.id}")
        return Ran("ok", {"verdict": "pass", "checks": []}, f"/runs/{p.id}")


def new_explore(tmp_path, oracle, sp: Space | None = None, seed: int = 5, resume: bool = False) -> Explore:
    edge, models = load_matrix(EDGE_YAML)
    results = Results.open(tmp_path / "explore.json", seed, "0.32.0", resume)
    return Explore(sp or space(), edge, models, "0.32.0", results, oracle, out=io.StringIO())


def test_a_planted_failure_is_found_once_counted_and_narrowed_to_its_axis_value(tmp_path):
    oracle = PlantedFault()
    ex = new_explore(tmp_path, oracle)
    assert explore(ex, Sampler(ex.space, 5), runs=24, hours=None) == 24
    rows = findings(ex.results)
    assert len(rows) == 1  # one signature, however many samples hit it
    f = rows[0]
    hit = [r for r in ex.results.samples if r.status == "ran" and r.sample["values"]["max_num_batched_tokens_p"] == 64]
    assert f["verdict"] == "new" and f["count"] == len(hit) >= 2
    assert f["signature"] == "kv-digest-mismatch (kv_digest_match)"
    assert f["matters"] == {"max_num_batched_tokens_p": "64"}
    page = render(ex.results, ex.space)
    assert "**new** `kv-digest-mismatch (kv_digest_match)`" in page and "max_num_batched_tokens_p=64" in page
    assert (tmp_path / "explore.json").exists()


def test_what_vllm_refuses_is_skipped_with_its_reason_and_never_run(tmp_path):
    oracle = PlantedFault()
    sp = space(axes={**SPACE["axes"], "tp_d": {"values": [8]}})  # 8 ranks over 4 attention heads: not a model
    ex = new_explore(tmp_path, oracle, sp)
    assert explore(ex, Sampler(sp, 1), runs=3, hours=None) == 0  # the space holds nothing vLLM runs: it ends
    assert oracle.ran == []
    assert ex.results.samples and all(r.status == "skipped" and r.why for r in ex.results.samples)


def test_a_resumed_explore_runs_none_of_the_samples_it_has(tmp_path):
    first = PlantedFault()
    explore(new_explore(tmp_path, first), Sampler(space(), 5), runs=4, hours=None)
    again = PlantedFault()
    ex = new_explore(tmp_path, again, resume=True)
    explore(ex, Sampler(space(), 5, covered=ex.results.covered()), runs=4, hours=None)
    assert not set(first.ran) & set(again.ran) and len(again.ran) == 4
    assert len({r.sample["id"] for r in ex.results.samples}) == len(ex.results.samples) >= 8
    with pytest.raises(ConfigError, match="seed"):
        Results.open(tmp_path / "explore.json", 6, "0.32.0", resume=True)


def test_a_sample_the_harness_refuses_before_launch_is_skipped_not_a_finding(tmp_path):
    def refuse(p, version):
        failure = {"class": "config-error", "source": "preflight", "reason": "block size 16 on this CPU"}
        return Ran("config-error", {"verdict": "fail", "failure": failure, "checks": []}, f"/runs/{p.id}")

    ex = new_explore(tmp_path, refuse)
    assert explore(ex, Sampler(ex.space, 2), runs=2, hours=None) == 0  # nothing ran: the space is exhausted
    assert findings(ex.results) == []
    assert all(r.status == "skipped" and "refused before launch" in r.why for r in ex.results.samples)


def test_a_failure_an_edge_entry_records_for_that_model_family_is_known_not_new():
    from harness.explore.signature import KNOWN, NEW, Signature, classify
    from harness.upstream.known import load_known

    edge, _ = load_matrix(EDGE_YAML)
    sig = Signature("logprob-mismatch", ("logprobs_match_baseline",))
    settings = {"prefix_caching_d": True, "block_size_p": 32, "block_size_d": 32}
    known = classify("logprob-mismatch", "ok", sig, settings, load_known(), edge, model="tiny-mistral", kv_heads=None)
    assert known[0] == KNOWN and "edge-mistral" in known[1]  # the sliding-window finding's entries
    other = classify("logprob-mismatch", "ok", sig, settings, load_known(), edge, model="tiny-qwen2", kv_heads=None)
    assert other[0] == NEW
    bs = classify(
        "output-mismatch",
        "ok",
        Signature("output-mismatch", ()),
        {"block_size_p": 32, "block_size_d": 64},
        load_known(),
        edge,
        model="tiny-qwen3",
    )
    assert bs[0] == KNOWN  # the block-size finding's entries name the settings, whatever the model
    # the MoE's crash at D data parallel 2 is its own: a dense model dying at DP 2 would be new
    dp = {"data_parallel_size_d": 2, "block_size_p": 32, "block_size_d": 32}
    died = Signature("decode-died", ())
    moe = classify("decode-died", "ok", died, dp, load_known(), edge, model="tiny-qwen3-moe", kv_heads=None)
    assert moe[0] == KNOWN and "edge-dp2-qwen3moe" in moe[1]
    assert classify("decode-died", "ok", died, dp, load_known(), edge, model="tiny-llama", kv_heads=1)[0] == NEW


def test_an_hours_budget_is_parsed_as_a_number_and_bounds_the_loop(tmp_path, monkeypatch):
    import argparse

    from harness.explore import cli

    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    assert parser.parse_args(["explore", "--hours", "0.5"]).hours == 0.5
    with pytest.raises(SystemExit):  # refused by argparse with its message, not a traceback later
        parser.parse_args(["explore", "--hours", "0"])
    clock = iter(range(0, 10**9, 600))  # each reading of the clock ten minutes later
    monkeypatch.setattr(cli.time, "monotonic", lambda: next(clock))
    oracle = PlantedFault()
    ran = explore(new_explore(tmp_path, oracle), Sampler(space(), 5), runs=None, hours=1.0)
    assert 1 <= ran == len(oracle.ran) < 6  # the hour ran out: no sample started after it


def test_a_signature_is_the_failed_checks_every_run_makes_and_an_axis_check_only_when_alone():
    from harness.explore.signature import signature_of

    def report(*failed: str) -> dict:
        return {"checks": [{"name": n, "passed": False} for n in failed] + [{"name": "no_kv_leak", "passed": True}]}

    digest = ("kv_digest_match", "outputs_match_baseline")
    plain = signature_of("output-mismatch", report(*digest))
    # the same wrong blocks with D's prefix cache on also fail the prefix-cache scenarios: still one finding
    cached = signature_of(
        "output-mismatch", report(*digest, "prefix_cache_outputs_match", "prefix_cache_sources_exact")
    )
    assert plain == cached and plain is not None and plain.checks == digest
    alone = signature_of("checks-failed", report("spec_decode_acceptance_matches_baseline"))
    assert alone is not None and alone.checks == ("spec_decode_acceptance_matches_baseline",)
    assert signature_of("ok", report()) is None
