"""Proof that the accuracy check can fail: a proxy that hands D wrong remote block ids (real servers, real lm-eval).

The handshake passes and KV moves over NIXL, but D reads the wrong blocks: outputs and the GSM8K
score must drop, and the run must fail with the accuracy checks naming why.
"""

import pytest

from tests.helpers import processes_tagged

# a hang fails this module's test, not all of CI: about 3x its run (390 s, with the tiny model's training when it is
# not cached yet)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def broken(corrupt_blocks_run):
    # one run per session (tests/integration/conftest.py); the report page's browser test reads it too
    return corrupt_blocks_run


def test_the_run_fails(broken):
    proc, _, report = broken
    assert proc.returncode == 1 and report["verdict"] == "fail"


def test_the_accuracy_checks_fail_with_a_reason(broken):
    _, _, report = broken
    a = report["accuracy"]
    assert a["baseline_score"] >= 0.8 and a["pd_score"] < a["baseline_score"] - a["tolerance"]
    checks = {c["name"]: c for c in report["checks"]}
    assert not checks["accuracy_pd_within_tolerance"]["passed"]
    assert (
        "P/D" in checks["accuracy_pd_within_tolerance"]["detail"]
        and "tolerance" in checks["accuracy_pd_within_tolerance"]["detail"]
    )
    assert (
        not checks["accuracy_responses_agree"]["passed"]
        and "responses differ" in checks["accuracy_responses_agree"]["detail"]
    )
    assert a["score_flips"] > 0 and a["differing_responses"] > a["samples"] // 2
    # the requests did take the P/D path: this is corruption, not a bypass
    assert checks["accuracy_through_pd"]["passed"]


def test_the_kv_digest_names_what_d_read_instead(broken):
    # each of P's block ids + 1: D holds P's later positions, another request's KV, or bytes P never had
    _, _, report = broken
    c = {c["name"]: c for c in report["checks"]}["kv_digest_match"]
    assert not c["passed"] and c["data"]["differ"] > 0, c["detail"]
    assert set(c["data"]["holds"]) <= {"another position", "another request", "nothing P had", "zeros"}, c["detail"]
    assert c["data"]["first_holds"] and "D holds" in c["detail"]


def test_nothing_left_running(broken):
    _, run_dir, _ = broken
    assert processes_tagged(run_dir / "logs") == []
