"""report.md says where the run's logprob threshold came from, below the checks that compare against it."""

from __future__ import annotations

import pytest

from harness.checks.check import Check
from harness.render.run_markdown import render_markdown
from harness.run.report import Report, write_report

LOGPROBS = Check(
    "logprobs_match_baseline",
    True,
    "largest |Δ logprob| 3.20e-02 (threshold 1.5) over 18 of 18 requests",
    {"threshold": 1.5, "largest": 0.032},
)


def markdown(config: dict, checks=(LOGPROBS,)) -> str:
    return render_markdown(Report(config=config, checks=list(checks)).to_dict())


@pytest.mark.parametrize(
    "threshold, source, line",
    [
        (
            0.21,
            "calibrated 2026-12-04 (runs/cal-1)",
            "Logprob threshold 0.21, source: calibrated 2026-12-04 (runs/cal-1).",
        ),
        (0.5, "given", "Logprob threshold 0.5, source: given."),
        # the device's default: config says null, the check that used it says which
        (
            None,
            "default (not calibrated on this box)",
            "Logprob threshold 1.5, source: default (not calibrated on this box).",
        ),
    ],
)
def test_the_threshold_and_its_source_follow_the_checks_table(threshold, source, line):
    lines = markdown({"logprob_threshold": threshold, "logprob_threshold_source": source}).splitlines()
    row = next(i for i, text in enumerate(lines) if text.startswith("| logprobs_match_baseline | pass |"))
    assert "(threshold 1.5)" in lines[row] and lines[row + 1 : row + 3] == ["", line]


def test_a_default_no_check_used_is_still_named_by_its_source():
    md = markdown({"logprob_threshold": None, "logprob_threshold_source": "default (the cpu threshold)"}, checks=())
    assert "Logprob threshold the device's default, source: default (the cpu threshold)." in md


def test_no_source_recorded_no_line(tmp_path):
    """A report.json written before the source was recorded (or a run that never chose one) has no such line."""
    write_report(Report(config={"logprob_threshold": 0.3}, checks=[LOGPROBS]), tmp_path)
    assert "Logprob threshold" not in (tmp_path / "report.md").read_text()
