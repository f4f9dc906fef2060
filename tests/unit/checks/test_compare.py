import pytest

from harness.checks.compare import compare_completions
from harness.workload.completion import Completion, parse_completion


def comp(pid, ids, tops=None, finish="length"):
    tops = tops or [{t: -0.1, t + 1000: -2.0} for t in ids]
    return Completion(pid, tuple(ids), tuple(tops), "", finish, 3)


def test_exact_match_passes():
    r = compare_completions([comp("a", [1, 2, 3])], [comp("a", [1, 2, 3])])
    assert r.passed and r.n_exact == 1 and r.first_divergence is None


def test_tolerated_divergence_when_each_in_others_topk():
    b = comp("a", [1, 2, 3], [{1: 0}, {2: -0.5, 7: -0.6}, {3: 0}])
    p = comp("a", [1, 7, 9], [{1: 0}, {7: -0.5, 2: -0.6}, {9: 0}])
    r = compare_completions([b], [p])
    assert r.passed and r.n_tolerated == 1
    first = r.first_divergence
    assert first is not None and first.divergence is not None
    d = first.divergence
    assert (d.position, d.baseline_token, d.pd_token, d.tolerated) == (1, 2, 7, True)


def test_divergence_outside_topk_is_mismatch():
    b = comp("a", [1, 2], [{1: 0}, {2: -0.1, 5: -1}])
    p = comp("a", [1, 8], [{1: 0}, {8: -0.1, 6: -1}])
    r = compare_completions([b], [p])
    assert not r.passed and r.n_mismatch == 1
    assert "not in" in r.summary()


def test_one_sided_containment_is_not_tolerated():
    b = comp("a", [2], [{2: -0.1, 8: -0.2}])
    p = comp("a", [8], [{8: -0.1, 5: -0.2}])  # baseline's 2 not in P/D top-k
    assert not compare_completions([b], [p]).passed


def test_top_k_limits_the_tolerance():
    b = comp("a", [2], [{2: -0.1, 9: -0.2, 8: -0.3}])
    p = comp("a", [8], [{8: -0.1, 9: -0.2, 2: -0.3}])
    assert compare_completions([b], [p], top_k=3).passed
    assert not compare_completions([b], [p], top_k=2).passed


def test_length_difference_is_mismatch():
    r = compare_completions([comp("a", [1, 2, 3])], [comp("a", [1, 2], finish="stop")])
    assert r.prompts[0].divergence is not None
    assert not r.passed and "length differs" in r.prompts[0].divergence.reason


def test_missing_prompt_and_empty_inputs():
    r = compare_completions([comp("a", [1]), comp("b", [1])], [comp("a", [1])])
    assert r.prompts[1].divergence is not None
    assert not r.passed and "missing on P/D" in r.prompts[1].divergence.reason
    assert not compare_completions([], []).passed
    with pytest.raises(ValueError):
        compare_completions([], [], top_k=0)


def test_parse_vllm_response():
    resp = {
        "choices": [
            {
                "text": " 10 4",
                "finish_reason": "length",
                "logprobs": {
                    "tokens": ["token_id:680", "token_id:917"],
                    "token_logprobs": [-3.1, -2.5],
                    "top_logprobs": [{"token_id:680": -3.1, "token_id:573": -3.5}, {"token_id:917": -2.5}],
                },
            }
        ],
        "usage": {"prompt_tokens": 12},
    }
    c = parse_completion("x", resp)
    assert c.token_ids == (680, 917)
    assert c.top_logprobs[0] == {680: -3.1, 573: -3.5}
    assert c.prompt_tokens == 12 and c.finish_reason == "length"


@pytest.mark.parametrize(
    "resp",
    [
        {},
        {"choices": [{"text": "x", "logprobs": None}]},
        {"choices": [{"logprobs": {"tokens": ["hello"], "top_logprobs": [None]}}]},
    ],
)
def test_parse_errors_are_clear(resp):
    with pytest.raises(ValueError):
        parse_completion("x", resp)
