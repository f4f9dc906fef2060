from harness.checks.usage_stats import check_no_usage_reporting
from harness.core.notrack import NO_TRACK_ENV, missing_no_track, with_no_track


def test_with_no_track_wins_over_the_callers_values():
    env = with_no_track({"VLLM_NO_USAGE_STATS": "0", "OTHER": "x"})
    assert env["OTHER"] == "x" and not missing_no_track(env)


def test_every_process_with_the_variables_passes():
    c = check_no_usage_reporting({"prefill pid 1": dict(NO_TRACK_ENV), "decode pid 2": {**NO_TRACK_ENV, "A": "b"}})
    assert c.passed and "2 server processes" in c.detail


def test_one_process_without_them_fails_and_is_named():
    c = check_no_usage_reporting({"prefill pid 1": dict(NO_TRACK_ENV), "decode pid 7": {"VLLM_DO_NOT_TRACK": "1"}})
    assert not c.passed
    assert "decode pid 7 lacks" in c.detail and "VLLM_NO_USAGE_STATS" in c.detail
    assert c.data is not None
    assert "VLLM_DO_NOT_TRACK" not in c.data["lacking"]["decode pid 7"]


def test_nothing_readable_is_not_a_pass():
    assert not check_no_usage_reporting({}).passed
    assert not check_no_usage_reporting({"decode pid 3": None}).passed
    # a server none of whose processes could be read fails, though another server's could
    c = check_no_usage_reporting({"prefill pid 1": dict(NO_TRACK_ENV), "decode pid 3": None})
    assert not c.passed and "decode" in c.detail


def test_children_that_show_no_environment_are_listed_not_passed():
    c = check_no_usage_reporting({"decode pid 2": dict(NO_TRACK_ENV), "decode pid 5": None})
    assert c.data is not None
    assert c.passed and c.data["unreadable"] == ["decode pid 5"] and "decode pid 5" in c.detail
