"""A failing run's report says what upstream already knows of its failure, or that nothing is known."""

from harness.checks.check import Check
from harness.run.report import Report


def report(cls: str, excerpt: str = "", version: str = "0.21.0") -> dict:
    r = Report(config={"tp_p": 1, "tp_d": 2}, versions={"vllm": version})
    r.checks = [Check("outputs_match_baseline", False, "x")]
    r.failure = {"class": cls, "reason": "r", "excerpt": excerpt}
    return r.to_dict()


def test_a_known_failure_names_its_threads_and_an_unknown_one_the_date_of_the_list():
    assert report("assert-45330")["known_upstream"].startswith("known upstream: #45330 (closed)")
    assert report("output-mismatch")["known_upstream"] == (
        "no known upstream report as of 2026-12-05 (configs/known_issues.yaml)"
    )
    line = "All kv cache tensors must have the same number of blocks"
    assert "#47816" in report("server-exited", line, "0.23.0")["known_upstream"]
    assert "#47816" not in report("server-exited", line, "0.32.0")["known_upstream"]
    ok = Report(config={}, versions={})
    ok.checks = [Check("outputs_match_baseline", True, "x")]
    assert "known_upstream" not in ok.to_dict()
