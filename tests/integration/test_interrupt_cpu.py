"""Ctrl-C (SIGINT) or SIGTERM to a harness run that has real vLLM servers up: everything goes, the report stays.

The signal goes to the harness process only, as Ctrl-C in a terminal reaches it: the servers run in
sessions of their own, so the harness alone must tear them down.
"""

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.helpers import processes_tagged

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


def wait_for_server_processes(run_dir: Path, harness: subprocess.Popen, at_least: int = 2, timeout_s: float = 300) -> list[int]:
    """PIDs of the run's vLLM processes once the API server has spawned its engine (a real server mid start-up)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert harness.poll() is None, "the run ended before its servers started"
        pids = processes_tagged(run_dir / "logs")
        if len(pids) >= at_least:
            return pids
        time.sleep(0.2)
    raise AssertionError("no vLLM engine process appeared")


@pytest.mark.parametrize("sig,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["sigint", "sigterm"])
def test_a_signal_ends_the_run_and_every_server_within_10_s(tmp_path, sig, code):
    run_dir = tmp_path / "run"
    harness = subprocess.Popen([sys.executable, "-m", "harness", "e2e", "--run-dir", str(run_dir)], cwd=REPO,
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        pids = wait_for_server_processes(run_dir, harness)
        harness.send_signal(sig)
        t0 = time.monotonic()
        out, _ = harness.communicate(timeout=60)
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in pids if psutil.pid_exists(p)], timeout=max(0.0, 10 - (time.monotonic() - t0)))
    finally:
        if harness.poll() is None:
            harness.kill()
            harness.wait()
    assert alive == [] and processes_tagged(run_dir / "logs") == [], f"still running 10 s after {sig.name}: {alive}"
    assert harness.returncode == code, out[-3000:]
    report = json.loads((run_dir / "report.json").read_text())
    assert report["verdict"] == "interrupted" and report["failure"]["class"] == "interrupted"
    assert sig.name in report["failure"]["reason"]
    assert "verdict: interrupted" in out
    # the log of the server that was starting is kept
    assert Path(report["logs"]["baseline"]).stat().st_size > 0
