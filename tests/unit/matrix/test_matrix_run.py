"""Judging a matrix run: outcomes, verdicts, the #45330 line per version, the report (no servers)."""

import dataclasses
import io
import json

from harness.matrix.plan import PlannedPair
from harness.matrix.run import observed_outcome, pair_line, run_matrix, summary, version_line
from harness.run.config import E2EConfig


def pair(id_="tiny-k1-p1-d2", regime="B", predicted="ok", expected="ok", run=True, tp=(1, 2), tolerated=None):
    return PlannedPair(
        id_,
        "tiny-llama",
        "cpu",
        tp[0],
        tp[1],
        1,
        regime,
        predicted,
        expected,
        "fixed",
        run,
        None if run else "a gpu entry; this run is on cpu",
        tolerated,
    )


def report(verdict="pass", cls=None):
    d = {"verdict": verdict}
    if cls:
        d["failure"] = {"class": cls}
        d["reason"] = f"{cls} in the decode log"
    return d


def test_outcomes_in_the_matrix_words():
    assert observed_outcome(report()) == "ok"
    assert observed_outcome(report("fail", "assert-45330")) == "assert-45330"
    assert observed_outcome(report("fail", "rejected-replicated-p-gt-d")) == "rejected"
    assert observed_outcome(report("fail", "kv-lease-expired")) == "kv-lease-expired"
    assert observed_outcome({"verdict": "fail"}) == "checks-failed"


class FakeRuns:
    """Stands in for PDRun: answers each pair from a table, records the configs it was given."""

    def __init__(self, answers):
        self.answers, self.seen = answers, []

    def __call__(self, cfg, cache):
        self.seen.append(cfg)
        return self.answers[(cfg.python, cfg.tp_p, cfg.tp_d)]


def run(plans, answers, tmp_path, monkeypatch):
    monkeypatch.setattr("harness.matrix.run.model_for", lambda p, models: f"/models/k{p.kv_heads}")
    fake = FakeRuns(answers)
    pythons = {v: f"/envs/{v}/python" for v in plans}
    results = run_matrix(plans, pythons, {}, E2EConfig(), tmp_path, out=io.StringIO(), run_pair=fake)
    return results, fake


def test_0_21_reproduces_and_0_32_does_not(tmp_path, monkeypatch):
    plans = {
        "0.21.0": [pair(predicted="assert-45330", expected="assert-45330"), pair("gpu-one", run=False)],
        "0.32.0": [pair(), pair("tiny-k1-p2-d1", "D", "rejected", "rejected", tp=(2, 1))],
    }
    answers = {
        ("/envs/0.21.0/python", 1, 2): report("fail", "assert-45330"),
        ("/envs/0.32.0/python", 1, 2): report(),
        ("/envs/0.32.0/python", 2, 1): report("fail", "rejected-replicated-p-gt-d"),
    }
    results, fake = run(plans, answers, tmp_path, monkeypatch)
    assert [r.verdict for r in results] == ["as expected", "skipped", "as expected", "as expected"]
    assert version_line("0.21.0", results) == "#45330 REPRODUCED on vLLM 0.21.0 (tiny-k1-p1-d2)"
    assert version_line("0.32.0", results).startswith("#45330 NOT REPRODUCED on vLLM 0.32.0 (outputs match baseline")
    # each version runs from its own interpreter, each pair in its own folder
    assert {c.python for c in fake.seen} == {"/envs/0.21.0/python", "/envs/0.32.0/python"}
    assert fake.seen[0].run_dir == tmp_path / "vllm-0.21.0" / "tiny-k1-p1-d2"
    data = json.loads((tmp_path / "report.json").read_text())
    assert data["complete"] and data["all_as_expected"] and len(data["pairs"]) == 4
    assert data["versions"]["0.21.0"].startswith("#45330 REPRODUCED")
    md = (tmp_path / "report.md").read_text()
    assert "| 0.21.0 | tiny-k1-p1-d2 | 1 | 1→2 | B | assert-45330 | assert-45330 | assert-45330 | as expected |" in md


def test_another_failure_is_named_and_is_unexpected(tmp_path, monkeypatch):
    plans = {"0.32.0": [pair()]}
    results, _ = run(plans, {("/envs/0.32.0/python", 1, 2): report("fail", "kv-lease-expired")}, tmp_path, monkeypatch)
    assert results[0].verdict == "UNEXPECTED" and "kv-lease-expired" in results[0].detail
    assert (
        version_line("0.32.0", results)
        == "#45330 on vLLM 0.32.0: FAILED for another reason: kv-lease-expired (tiny-k1-p1-d2)"
    )
    assert "0/1 pairs as expected" in summary(results, ["0.32.0"])
    assert not json.loads((tmp_path / "report.json").read_text())["all_as_expected"]


def test_a_known_failure_of_another_bug_is_neither_a_45330_failure_nor_a_pass(tmp_path, monkeypatch):
    plans = {"0.32.0": [pair("edge-bs64", expected="output-mismatch"), pair("edge-prefix", tp=(1, 2))]}
    answers = {("/envs/0.32.0/python", 1, 2): report("fail", "output-mismatch")}
    results, _ = run({"0.32.0": plans["0.32.0"][:1]}, answers, tmp_path, monkeypatch)
    assert results[0].verdict == "as expected"
    assert version_line("0.32.0", results).startswith(
        "#45330 NOT TESTED on vLLM 0.32.0: every regime-B pair failed as its entry expects"
    )
    results.append(
        run({"0.32.0": plans["0.32.0"][1:]}, {("/envs/0.32.0/python", 1, 2): report()}, tmp_path, monkeypatch)[0][0]
    )
    assert (
        version_line("0.32.0", results) == "#45330 NOT REPRODUCED on vLLM 0.32.0 (outputs match baseline: edge-prefix)"
    )


def test_no_regime_b_pair_is_not_a_pass(tmp_path, monkeypatch):
    plans = {"0.32.0": [pair("tiny-k1-p1-d1", "A", tp=(1, 1))]}
    results, _ = run(plans, {("/envs/0.32.0/python", 1, 1): report()}, tmp_path, monkeypatch)
    assert version_line("0.32.0", results).startswith("#45330 NOT TESTED on vLLM 0.32.0")


def test_an_unexpected_pass_is_unexpected(tmp_path, monkeypatch):
    plans = {"0.21.0": [pair(predicted="assert-45330", expected="assert-45330")]}
    results, _ = run(plans, {("/envs/0.21.0/python", 1, 2): report()}, tmp_path, monkeypatch)
    assert results[0].verdict == "UNEXPECTED"


def test_a_known_intermittent_failure_is_accepted_but_never_called_a_pass(tmp_path, monkeypatch):
    plans = {"0.32.0": [pair(tolerated="kv-lease-expired")]}
    results, _ = run(plans, {("/envs/0.32.0/python", 1, 2): report("fail", "kv-lease-expired")}, tmp_path, monkeypatch)
    assert results[0].as_expected and results[0].verdict == "known intermittent"
    assert version_line("0.32.0", results) == (
        "#45330 on vLLM 0.32.0: FAILED for another reason: kv-lease-expired "
        "(tiny-k1-p1-d2) [known intermittent: see the entry's evidence]"
    )
    assert "1/1 pairs as expected (1 with a known intermittent failure)" in summary(results, ["0.32.0"])
    md = (tmp_path / "report.md").read_text()
    assert "| ok (intermittent: kv-lease-expired) | kv-lease-expired | known intermittent |" in md


def test_with_a_known_intermittent_failure_a_clean_run_is_the_fix_proven(tmp_path, monkeypatch):
    plans = {"0.32.0": [pair(tolerated="kv-lease-expired")]}
    results, _ = run(plans, {("/envs/0.32.0/python", 1, 2): report()}, tmp_path, monkeypatch)
    assert results[0].verdict == "as expected"
    assert version_line("0.32.0", results).startswith("#45330 NOT REPRODUCED on vLLM 0.32.0")


def test_a_different_failure_beside_a_known_intermittent_one_is_unexpected(tmp_path, monkeypatch):
    plans = {"0.32.0": [pair(tolerated="kv-lease-expired")]}
    results, _ = run(plans, {("/envs/0.32.0/python", 1, 2): report("fail", "output-mismatch")}, tmp_path, monkeypatch)
    assert results[0].verdict == "UNEXPECTED"


def test_stand_in_answers_are_never_read_as_45330_not_reproduced(tmp_path, monkeypatch):
    plans = {"0.32.0": [pair()]}
    sim = {**report(), "simulated": "SIMULATED GPUs (PD_HARNESS_SIMULATED_GPUS=8x80): stand-in servers in vLLM's place"}
    results, _ = run(plans, {("/envs/0.32.0/python", 1, 2): sim}, tmp_path, monkeypatch)
    assert results[0].observed == "ok" and results[0].simulated  # the night judges the step by it
    assert version_line("0.32.0", results) == (
        "#45330 NOT TESTED on vLLM 0.32.0: simulated GPUs (stand-in servers; no vLLM computed an output)"
    )
    md = (tmp_path / "report.md").read_text()
    assert "| ok (simulated GPUs) | as expected |" in md and "NOT REPRODUCED" not in md
    assert json.loads((tmp_path / "report.json").read_text())["pairs"][0]["simulated"] is True


def test_a_known_failure_already_reported_upstream_says_so(tmp_path, monkeypatch):
    known = dataclasses.replace(
        pair("edge-conv", expected="output-mismatch"),
        upstream="known upstream: #55208 (open): the same offsets; PR #55306 (open)",
    )
    results, _ = run(
        {"0.32.0": [known]}, {("/envs/0.32.0/python", 1, 2): report("fail", "output-mismatch")}, tmp_path, monkeypatch
    )
    assert results[0].verdict == "as expected"
    md = (tmp_path / "report.md").read_text()
    assert "- 0.32.0 edge-conv: output-mismatch in the decode log — known upstream: #55208 (open)" in md
    assert "known upstream: #55208" in pair_line(results[0])


import pytest  # noqa: E402

from harness.core.interrupts import Interrupted  # noqa: E402


@pytest.mark.parametrize("phase", ["model", "run-before-report", "run-after-report"])
def test_a_pair_interrupted_in_any_phase_leaves_its_own_interrupted_report(tmp_path, monkeypatch, phase):
    """A Ray cancel (or Ctrl-C) reaches an entry while its model is built, before its run writes a report, or after:
    the pair's folder always holds a report of class interrupted (issue: a cancelled entry that wrote none)."""
    import signal

    def model_for(p, models):
        if phase == "model":
            raise Interrupted(signal.SIGTERM)
        return "/models/k1"

    def run_pair(cfg, cache):
        if phase == "run-after-report":  # the run's own report: kept, not replaced
            cfg.run_dir.mkdir(parents=True)
            (cfg.run_dir / "report.json").write_text(json.dumps({"failure": {"class": "interrupted", "own": True}}))
        raise Interrupted(signal.SIGTERM)

    monkeypatch.setattr("harness.matrix.run.model_for", model_for)
    with pytest.raises(Interrupted):
        run_matrix(
            {"0.32.0": [pair()]},
            {"0.32.0": "/py"},
            {},
            E2EConfig(),
            tmp_path,
            out=io.StringIO(),
            run_pair=run_pair,
        )
    d = json.loads((tmp_path / "vllm-0.32.0" / "tiny-k1-p1-d2" / "report.json").read_text())
    assert d["failure"]["class"] == "interrupted"
    assert d["failure"].get("own") is (True if phase == "run-after-report" else None)
    if phase != "run-after-report":
        assert "SIGTERM before the pair's run started" in d["failure"]["reason"] and d["verdict"] == "interrupted"
