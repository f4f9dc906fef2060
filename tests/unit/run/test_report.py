import json

from harness.checks.check import Check
from harness.run.report import Report, write_report


def test_report_verdict_files_and_latest(tmp_path):
    runs = tmp_path / "runs"
    r1 = Report(config={"tp_p": 1, "tp_d": 2}, checks=[Check("a", True, "ok"), Check("b", False, "bad thing")])
    d = write_report(r1, runs / "one", runs)
    assert d["verdict"] == "fail" and "b: bad thing" in d["reason"]
    on_disk = json.loads((runs / "one" / "report.json").read_text())
    assert on_disk["checks"][1] == {"name": "b", "passed": False, "detail": "bad thing"}
    assert "**FAIL**" in (runs / "one" / "report.md").read_text()
    r2 = Report(config={}, checks=[Check("a", True, "ok")])
    assert write_report(r2, runs / "two", runs)["verdict"] == "pass"
    assert (runs / "latest").resolve() == (runs / "two").resolve()
    assert "reason" not in json.loads((runs / "latest" / "report.json").read_text())


def test_no_checks_or_failure_is_never_a_pass(tmp_path):
    assert Report(config={}).verdict == "fail"
    r = Report(config={}, checks=[Check("a", True, "ok")], failure={"reason": "decode: exited", "excerpt": "tail"})
    d = write_report(r, tmp_path / "x")
    assert d["verdict"] == "fail" and d["reason"] == "decode: exited"
