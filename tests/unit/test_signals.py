"""A signal to `python -m harness e2e` before its run's servers start (while it reads the serving interpreter's
versions): it ends with a report of class interrupted and exit 128 + the signal, never a traceback or an empty
folder. SIGHUP (a closed terminal or ssh session) is handled as SIGTERM is."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from harness.core.paths import REPO_ROOT

SLOW_PYTHON = """#!/bin/sh
# the serving interpreter's stand-in: reading its versions hangs until the test's signal
touch "$0.called"
exec sleep 60
"""


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_while_the_versions_are_read_ends_with_a_report(tmp_path, signum):
    python, run_dir = tmp_path / "python", tmp_path / "run"
    python.write_text(SLOW_PYTHON)
    python.chmod(0o755)
    proc = subprocess.Popen(
        [sys.executable, "-m", "harness", "e2e", "--device", "cpu", "--python", str(python), "--run-dir", str(run_dir)],
        cwd=REPO_ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "python.called").exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
            time.sleep(0.1)
        proc.send_signal(signum)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 128 + signum, (out, err)
    assert "Traceback" not in err, err
    failure = json.loads((run_dir / "report.json").read_text())["failure"]
    assert failure["class"] == "interrupted" and signal.Signals(signum).name in failure["reason"]
