"""Start-up faults through the real e2e CLI, with tests/fakes standing in for the vLLM interpreter.

A server that dies during start-up, and one that never becomes ready: each run must end on its own
(exit 1, no hang), write a report that says how it failed, keep every log in the run folder, and
leave no process behind - including the child each fake starts, like vLLM's engine core.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.core.paths import REPO_ROOT
from harness.serve.procs import RUN_TAG_ENV
from tests.fakes.fake_vllm import CRASH_LINE
from tests.helpers import processes_tagged

FAKES = REPO_ROOT / "tests" / "fakes"
HANG_BOUND_S = 60  # generous: each run below should end in a few seconds


@pytest.fixture
def model_dir(tmp_path) -> Path:
    # A model folder with just the shape (4 heads, K=1): preflight passes and no tiny model gets built.
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 1}))
    return d


def run_e2e(fake: str, run_dir: Path, model: Path, *extra: str) -> tuple[subprocess.CompletedProcess, float]:
    env = {**os.environ, "FAKE_VLLM_REAL_PYTHON": sys.executable, "FAKE_VLLM_MAX_LIFE_S": "120"}
    t0 = time.monotonic()
    try:
        cp = subprocess.run(
            [
                sys.executable,
                "-m",
                "harness",
                "e2e",
                "--device",
                "cpu",
                "--python",
                str(FAKES / fake),
                "--run-dir",
                str(run_dir),
                "--model",
                str(model),
                *extra,
            ],
            cwd=REPO_ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=HANG_BOUND_S * 2,
        )
    finally:
        elapsed = time.monotonic() - t0
        leftovers = processes_tagged(run_dir / "logs")
        for pid in leftovers:  # never leave anything running, even when the assertions below fail
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    assert leftovers == [], f"processes of the run still running after the CLI exited: {leftovers}"
    return cp, elapsed


def assert_logs_kept(run_dir: Path) -> str:
    logs = sorted((run_dir / "logs").glob("*.log"))
    assert logs, "no process log in the run folder"
    for log in logs:
        assert log.stat().st_size > 0, f"{log} is empty"
    text = (run_dir / "logs" / "baseline.log").read_text()
    # The fake started a child beside itself: "nothing left" above covered a real descendant.
    m = re.search(r"fake vLLM \(\S+\) pid (\d+), child (\d+)", text)
    assert m, text
    assert not [pid for pid in map(int, m.groups()) if still_ours(pid, run_dir / "logs")]
    return text


def still_ours(pid: int, logs_dir: Path) -> bool:
    try:
        p = psutil.Process(pid)
        return p.status() != psutil.STATUS_ZOMBIE and p.environ().get(RUN_TAG_ENV) == str(logs_dir)
    except psutil.Error:
        return False


def read_report(run_dir: Path) -> dict:
    return json.loads((run_dir / "report.json").read_text())


def test_a_server_that_exits_during_start_up_fails_the_run_at_once(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    cp, elapsed = run_e2e("python-exit-at-start", run_dir, model_dir)
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert elapsed < HANG_BOUND_S
    d = read_report(run_dir)
    assert d["verdict"] == "fail"
    f = d["failure"]
    assert f["class"] == "server-exited", f
    assert f["returncode"] == 1
    assert CRASH_LINE in f["excerpt"]  # the log tail, with the server's own last words
    assert CRASH_LINE in assert_logs_kept(run_dir)
    assert "server-exited" in cp.stdout


def test_a_server_that_never_gets_ready_fails_at_the_deadline(tmp_path, model_dir):
    run_dir = tmp_path / "run"
    cp, elapsed = run_e2e("python-never-ready", run_dir, model_dir, "--ready-timeout", "5")
    assert cp.returncode == 1, cp.stdout + cp.stderr
    assert 5 <= elapsed < HANG_BOUND_S  # waited for the deadline, not forever
    d = read_report(run_dir)
    assert d["verdict"] == "fail"
    f = d["failure"]
    assert f["class"] == "startup-timeout", f
    assert "not ready within 5 s" in f["reason"]
    assert "/health answers 503" in f["excerpt"]
    assert_logs_kept(run_dir)


def test_the_fake_interpreter_passes_everything_else_to_python(monkeypatch):
    # The pipeline reads versions with `<python> -c CODE`; the proxy runs as `<python> toy_proxy_server.py`.
    from harness.run.versions import installed_versions

    monkeypatch.setenv("FAKE_VLLM_REAL_PYTHON", sys.executable)
    v = installed_versions(str(FAKES / "python-never-ready"))
    assert "error" not in v, v
    assert v["torch"]


def test_two_runs_at_once_keep_apart(tmp_path, model_dir):
    """Ports, run folders and logs of two simultaneous runs never mix, and each cleans up only its own."""
    from concurrent.futures import ThreadPoolExecutor

    dirs = [tmp_path / "a", tmp_path / "b"]
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda d: run_e2e("python-never-ready", d, model_dir, "--ready-timeout", "5"), dirs))
    reports = [read_report(d) for d in dirs]
    assert [cp.returncode for cp, _ in results] == [1, 1]
    assert [r["failure"]["class"] for r in reports] == ["startup-timeout"] * 2
    ports = [set(re.findall(r"--port (\d+)", r["commands"]["baseline"])) for r in reports]
    assert ports[0] and ports[1] and not ports[0] & ports[1]
    for d in dirs:
        assert str(d / "logs") in read_report(d)["logs"]["baseline"]


def test_a_harness_error_still_writes_the_report(tmp_path, monkeypatch):
    """An unexpected exception inside the run (a harness bug) ends it with a report that carries the traceback."""
    from harness.run import pipeline
    from harness.run.config import E2EConfig

    def boom(cfg):
        raise RuntimeError("a bug in the harness")

    monkeypatch.setattr(pipeline, "resolve_model", boom)
    d = pipeline.PDRun(E2EConfig(run_dir=tmp_path / "run")).run()
    on_disk = read_report(tmp_path / "run")
    assert d["verdict"] == on_disk["verdict"] == "fail"
    assert on_disk["failure"]["class"] == "harness-error" and "a bug in the harness" in on_disk["failure"]["reason"]
    assert "Traceback" in on_disk["failure"]["excerpt"]
