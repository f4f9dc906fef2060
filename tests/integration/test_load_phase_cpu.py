"""The load phase of a passing `make e2e` (the session's run, tests/integration/conftest.py): every answer compared,
the planned cancels happened at both hops and the servers confirm them, the small KV pool was reused, and P and D
went back to idle."""

import pytest

# a hang fails this module's test, not all of CI: about 3x its run
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def report(e2e_accuracy_run):
    _, _, report = e2e_accuracy_run
    assert report is not None and report["verdict"] == "pass", report and report.get("reason")
    return report


def checks(report):
    return {c["name"]: c for c in report["checks"]}


def test_every_load_answer_matches_the_baseline(report):
    load = report["load"]
    c = checks(report)
    for name in ("load_requests_answered", "load_outputs_match_baseline", "logprobs_match_baseline"):
        assert c[name]["passed"], c[name]
    planned = [o for o in load["outcomes"] if not o["abort"]]
    assert load["matched"] == len(planned) and not load["mismatched"]
    shapes = {o["shape"] for o in load["outcomes"]}
    assert {"k*bs", "k*bs-1", "k*bs+1"} <= shapes, "block-edge lengths are in the load"


def test_cancels_fired_at_both_hops_and_servers_confirm_them(report):
    load = report["load"]
    c = checks(report)["load_aborts_fired"]
    assert c["passed"], c["detail"]
    assert load["aborted_by_client"]["prefill"] > 0 and load["aborted_by_client"]["decode"] > 0
    assert c["data"]["confirmed_by_server"]["prefill"] and c["data"]["confirmed_by_server"]["decode"]


def test_the_small_pool_was_reused_and_nothing_leaked(report):
    c = checks(report)
    assert c["load_kv_blocks_reused"]["passed"], c["load_kv_blocks_reused"]
    for pool in report["load"]["pools"]:
        assert pool["blocks_needed"] > pool["blocks"]
    assert c["no_kv_leak"]["passed"], c["no_kv_leak"]


def test_the_report_says_how_the_baseline_answered(report):
    load = report["load"]
    assert "same concurrency" in load["baseline_answered"]
    assert load["latency"]["pd"]["ttft_p50_s"] is not None and load["latency"]["baseline"]["e2e_p99_s"] is not None
