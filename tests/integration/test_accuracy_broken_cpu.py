"""Proof that the accuracy check can fail: a proxy that hands D wrong remote block ids (real servers, real lm-eval).

The handshake passes and KV moves over NIXL, but D reads the wrong blocks: outputs and the GSM8K
score must drop, and the run must fail with the accuracy checks naming why.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_tagged

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def broken(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("broken") / "run"
    proc = subprocess.run([sys.executable, "-m", "harness", "e2e", "--accuracy", "--accuracy-limit", "60",
                           "--proxy-fault", "corrupt-block-ids", "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=2400)
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())


def test_the_run_fails(broken):
    proc, _, report = broken
    assert proc.returncode == 1 and report["verdict"] == "fail"


def test_the_accuracy_checks_fail_with_a_reason(broken):
    _, _, report = broken
    a = report["accuracy"]
    assert a["baseline_score"] >= 0.8 and a["pd_score"] < a["baseline_score"] - a["tolerance"]
    checks = {c["name"]: c for c in report["checks"]}
    assert not checks["accuracy_pd_within_tolerance"]["passed"]
    assert "P/D" in checks["accuracy_pd_within_tolerance"]["detail"] and "tolerance" in checks["accuracy_pd_within_tolerance"]["detail"]
    assert not checks["accuracy_responses_agree"]["passed"] and "responses differ" in checks["accuracy_responses_agree"]["detail"]
    assert a["score_flips"] > 0 and a["differing_responses"] > a["samples"] // 2
    # the requests did take the P/D path: this is corruption, not a bypass
    assert checks["accuracy_through_pd"]["passed"]


def test_nothing_left_running(broken):
    _, run_dir, _ = broken
    assert processes_tagged(run_dir / "logs") == []
