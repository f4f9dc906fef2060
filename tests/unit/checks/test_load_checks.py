"""The load checks over recorded outcomes: aborts confirmed by client, proxy and server; reuse by pigeonhole;
the logprob threshold catches a slightly wrong KV that flips no token."""

from harness.checks.compare import compare_completions
from harness.checks.load import (
    Pool,
    aborted_in_log,
    blocks_needed,
    check_aborts,
    check_logprobs,
    check_reuse,
    logprob_coverage,
    pool_blocks_from_log,
    pool_from_metrics,
)
from harness.serve.prometheus import parse_metrics
from harness.workload.completion import Completion
from harness.workload.load import LoadRequest
from harness.workload.load_client import LoadOutcome, LoadRun


def outcome(rid, abort=None, status="ok", length=40, tokens=None):
    c = (
        Completion(rid, tuple(tokens or [1, 2]), tuple({t: -0.1} for t in (tokens or [1, 2])), "x")
        if status == "ok"
        else None
    )
    return LoadOutcome(LoadRequest(rid, length, "other", 16, abort, 3 if abort == "decode" else 0), status, c)


STATS0 = {"cancelled": {"before_prefill": 0, "prefill": 0, "between_hops": 0, "decode": 0}, "cancelled_ids": {}}


def stats(**ids):
    return {"cancelled": {s: len(ids.get(s, [])) for s in STATS0["cancelled"]}, "cancelled_ids": ids}


def test_aborts_pass_when_client_proxy_and_servers_agree():
    run = LoadRun([outcome("a"), outcome("p1", "prefill", "aborted"), outcome("d1", "decode", "aborted")])
    logs = {"prefill": "INFO Request cmpl-pd-p1-0-abcd aborted.", "decode": "INFO Request cmpl-pd-d1-0-ef01 aborted."}
    c = check_aborts(run, STATS0, stats(prefill=["pd-p1"], decode=["pd-d1"]), logs, True)
    assert c is not None
    assert c.passed, c.detail
    assert "aborted in the server logs: P 1, D 1" in c.detail


def test_a_planned_abort_that_never_happened_fails():
    run = LoadRun([outcome("d1", "decode", "failed")])
    c = check_aborts(run, STATS0, stats(), {"decode": ""}, True)
    assert c is not None
    assert not c.passed and "never happened: d1" in c.detail


def test_a_cancel_no_server_confirms_fails():
    run = LoadRun([outcome("p1", "prefill", "aborted")])
    c = check_aborts(run, STATS0, stats(prefill=["pd-p1"]), {"prefill": "nothing about it"}, True)
    assert c is not None
    assert not c.passed and "no prefill server logged an abort" in c.detail


def test_a_client_cancel_the_proxy_never_saw_fails():
    run = LoadRun([outcome("d1", "decode", "aborted")])
    c = check_aborts(run, STATS0, stats(), {"decode": "Request cmpl-pd-d1-0 aborted."}, True)
    assert c is not None
    assert not c.passed and "not seen by the proxy: d1" in c.detail


def test_no_planned_abort_is_no_check_not_a_pass():
    assert check_aborts(LoadRun([outcome("a")]), STATS0, stats(), {}, True) is None


def test_planned_prefill_cancels_that_all_landed_in_the_decode_hop_did_not_fire():
    run = LoadRun([outcome("p1", "prefill", "aborted"), outcome("d1", "decode", "aborted")])
    logs = {"decode": "Request cmpl-pd-p1-0 aborted.\nRequest cmpl-pd-d1-0 aborted."}
    c = check_aborts(run, STATS0, stats(decode=["pd-p1", "pd-d1"]), logs, True)
    assert c is not None and c.data is not None
    assert (
        not c.passed and "none of the 1 planned prefill-hop cancels landed in the prefill hop (p1 decode)" in c.detail
    )
    assert c.data["landed"] == {"p1": "decode", "d1": "decode"}
    # one of two landing while P prefilled is enough: the timing is aimed, not exact
    run = LoadRun(
        [outcome("p1", "prefill", "aborted"), outcome("p2", "prefill", "aborted"), outcome("d1", "decode", "aborted")]
    )
    logs = {"prefill": "Request cmpl-pd-p2-0 aborted.", **logs}
    c = check_aborts(run, STATS0, stats(prefill=["pd-p2"], decode=["pd-p1", "pd-d1"]), logs, True)
    assert c is not None and c.passed


def test_abort_log_match_needs_the_whole_id():
    assert aborted_in_log("Request cmpl-pd-load001-t31-0-1a2b aborted.", "pd-load001-t31")
    assert not aborted_in_log("Request cmpl-pd-load001-t31-0-1a2b aborted.", "pd-load001-t3")
    assert not aborted_in_log("Added request cmpl-pd-load001-t31-0-1a2b.", "pd-load001-t31")


def test_reuse_is_proved_by_more_blocks_needed_than_the_pool_holds():
    run = LoadRun(
        [
            outcome("a", length=64, tokens=[1] * 16),
            outcome("b", length=33),
            outcome("p", "prefill", "aborted", length=500),
        ]
    )
    # a lower bound: D needed ceil(80/32)=3 for a and ceil(35/32)=2 for b; a prefill abort may have reached no server
    assert blocks_needed([], run, 32, generated=True) == 5
    assert blocks_needed([], run, 32, generated=False) == 2 + 2
    assert check_reuse([Pool("prefill", 3, 32, 4), Pool("decode", 4, 32, 5)]).passed
    c = check_reuse([Pool("prefill", 3, 32, 4), Pool("decode", 8, 32, 5)])
    assert not c.passed and "decode: 5 blocks needed" in c.detail and "(no reuse)" in c.detail
    assert not check_reuse([Pool("decode", None, 32, 5)]).passed


def test_the_pool_comes_from_metrics_or_the_log():
    m = parse_metrics('vllm:cache_config_info{block_size="32",engine="0",num_gpu_blocks="64"} 1.0\n')
    assert pool_from_metrics(m) == (64, 32)
    assert pool_blocks_from_log("INFO [kv_cache_utils.py:1] CPU KV cache size: 1,024 tokens, Maximum ...", 32) == 32
    assert pool_blocks_from_log("nothing", 32) is None


def test_a_logprob_shift_that_flips_no_token_fails_the_threshold():
    base = [Completion("x", (5, 6, 7), ({5: -0.2, 9: -2.0}, {6: -0.1}, {7: -0.3}), "")]
    same = [Completion("x", (5, 6, 7), ({5: -0.2, 9: -2.0}, {6: -0.1}, {7: -0.3}), "")]
    shifted = [Completion("x", (5, 6, 7), ({5: -0.2, 9: -2.0}, {6: -0.45}, {7: -0.3}), "")]
    ok = compare_completions(base, same)
    bad = compare_completions(base, shifted)
    assert bad.passed, "no token flipped: the token comparison alone passes"
    assert check_logprobs([ok], 0.05).passed
    c = check_logprobs([ok, bad], 0.05)
    assert not c.passed and "x (0.35)" in c.detail


def test_the_logprob_check_says_how_many_requests_it_could_look_at():
    base = [
        Completion("x", (5, 6), ({5: -0.2}, {6: -0.1}), ""),
        Completion("y", (8, 9), ({8: -0.1, 3: -0.2}, {9: -0.1}), ""),
    ]
    pd = [
        Completion("x", (5, 6), ({5: -0.2}, {6: -0.1}), ""),
        Completion("y", (4, 9), ({4: -0.1, 5: -0.2}, {9: -0.1}), ""),
    ]
    r = compare_completions(base, pd)
    assert logprob_coverage([r]) == (1, 2)  # y diverged at its first token to a token the baseline did not list
    c = check_logprobs([r], 0.05)
    assert c.passed and "over 1 of 2 requests; 1 diverged at their first token" in c.detail
    assert c.data is not None
    assert c.data["requests_with_positions"] == 1
    only_y = compare_completions(base[1:], pd[1:])
    assert logprob_coverage([only_y]) == (0, 1)  # then the run skips the check (run/evaluate.py), never passes it


def test_a_near_tie_swapped_at_the_first_token_is_judged_by_its_logprobs():
    """A tolerated divergence at token 0 used to leave the logprob check blind: a corrupted KV that swaps two top-5
    tokens went unnamed (seen in CI, issue 26's stop 32). The two tokens' logprobs there now decide."""
    base = [Completion("y", (8, 9), ({8: -0.1, 3: -0.1002}, {9: -0.1}), "")]
    noise = [Completion("y", (3, 9), ({3: -0.1001, 8: -0.1003}, {9: -0.1}), "")]
    swapped = [Completion("y", (3, 9), ({3: -0.1, 8: -0.9}, {9: -0.1}), "")]
    tie, wrong = compare_completions(base, noise), compare_completions(base, swapped)
    assert tie.n_tolerated == wrong.n_tolerated == 1, "both pass the token rule"
    assert logprob_coverage([tie]) == logprob_coverage([wrong]) == (1, 1)
    assert check_logprobs([tie], 1e-3).passed
    c = check_logprobs([wrong], 1e-3)
    assert c.data is not None
    assert not c.passed and c.data["over_threshold"] == ["y"] and "y (0.8)" in c.detail
