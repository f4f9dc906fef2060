"""An accuracy run's settings are refused when built, one line naming the flag, before any server starts."""

import pytest

from harness.accuracy.settings import AccuracySettings
from harness.core.errors import ConfigError


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(num_fewshot=-1), "--num-fewshot must be >= 0, got -1"),
        (dict(limit=0), "--accuracy-limit must be >= 1, got 0"),
        (dict(num_concurrent=0), "--lm-eval-concurrency must be >= 1, got 0"),
        (dict(request_timeout_s=0.0), "--request-timeout must be > 0 seconds"),
        (dict(timeout_s=float("nan")), "the accuracy timeout must be > 0 seconds"),
        (dict(expected_score=1.5), "expected_score is a score in [0, 1], got 1.5"),
    ],
)
def test_a_setting_no_lm_eval_run_can_take_is_refused_naming_it(settings, words):
    with pytest.raises(ConfigError) as e:
        AccuracySettings(**settings)
    assert str(e.value) == words or str(e.value).startswith(words)


def test_the_defaults_and_the_edges_of_each_range_are_taken():
    AccuracySettings()
    AccuracySettings(num_fewshot=0, limit=1, num_concurrent=1, min_baseline_score=0.0, expected_score=1.0)
