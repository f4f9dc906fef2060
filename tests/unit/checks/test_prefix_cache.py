"""The prefix-cache check: exact per-request sources, and a scenario set with no hit proves nothing."""

from harness.checks.prefix_cache import Sourced, check_sources
from harness.workload.prefix import Expected, PrefixCase

COLD = PrefixCase("a-cold", "cold", "k*bs", "a", 96)
AGAIN = PrefixCase("a-again", "full-hit", "k*bs", "a", 96)


def row(case, exp, local, ext, compute=0):
    return Sourced(
        case,
        exp,
        {"local_cache_hit": float(local), "external_kv_transfer": float(ext), "local_compute": float(compute)},
    )


def test_exact_split_passes():
    c = check_sources([row(COLD, Expected(0, 96), 0, 96), row(AGAIN, Expected(64, 32), 64, 32)])
    assert c.passed and "2 requests split exactly" in c.detail


def test_a_recomputed_block_fails_naming_the_request():
    # D computed a block itself instead of taking it from its cache or from P.
    c = check_sources([row(COLD, Expected(0, 96), 0, 96), row(AGAIN, Expected(64, 32), 32, 32, 32)])
    assert not c.passed and "a-again" in c.detail and "full-hit" in c.detail


def test_no_local_hit_at_all_fails():
    # A D whose prefix cache never hit (e.g. not really on) must not pass by matching cold predictions only.
    c = check_sources([row(COLD, Expected(0, 96), 0, 96)])
    assert not c.passed and "nothing was tested" in c.detail


def test_counters_missing_fail():
    c = check_sources([Sourced(COLD, Expected(0, 96), None), row(AGAIN, Expected(64, 32), 64, 32)])
    assert not c.passed and "no prompt_tokens_by_source" in c.detail
