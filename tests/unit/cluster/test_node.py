"""What a Ray task runs on its node: the entry's environment, and the entry run as a process the task owns."""

import os
import sys
import time
import types
from pathlib import Path

import psutil

from harness.cluster import node

REPO = Path(__file__).resolve().parents[3]


def test_what_ray_added_to_the_worker_is_dropped_what_the_node_had_is_kept():
    assert node.ray_added({"OMP_NUM_THREADS": "1", "A": "x"}, {"A": "x"}) == ["OMP_NUM_THREADS"]
    assert node.ray_added({"OMP_NUM_THREADS": "4"}, {"OMP_NUM_THREADS": "4"}) == []
    assert node.ray_added({"OMP_NUM_THREADS": "1"}, None) == []  # the raylet's unreadable: nothing counts as added
    assert node.ray_added({}, {}) == []


def fake_ray(monkeypatch):
    ctx = types.SimpleNamespace(get_node_id=lambda: "node-1")
    ray = types.SimpleNamespace(
        get_runtime_context=lambda: ctx, util=types.SimpleNamespace(get_node_ip_address=lambda: "10.0.0.9")
    )
    monkeypatch.setitem(sys.modules, "ray", ray)


def test_an_entry_runs_in_its_own_process_group_with_its_output_in_the_task_log(tmp_path, monkeypatch):
    fake_ray(monkeypatch)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray sets it in a worker; this test's parent lacks it
    monkeypatch.setattr(node, "_raylet_env", dict)
    code = (
        "import os; print('pgid-is-pid', os.getpgid(0) == os.getpid()); "
        "print('omp', os.environ.get('OMP_NUM_THREADS')); "
        "print('ray-usage', os.environ['RAY_USAGE_STATS_ENABLED'])"
    )
    log = tmp_path / "task.log"
    out = node.run_entry({"argv": [sys.executable, "-c", code], "cwd": str(REPO), "log": str(log), "stop_grace_s": 5})
    text = log.read_text()
    assert "pgid-is-pid True" in text and "omp None" in text and "ray-usage 0" in text
    assert out["returncode"] == 0 and out["node_ip"] == "10.0.0.9" and out["node_id"] == "node-1"
    assert out["worker_pid"] == os.getpid() and not psutil.pid_exists(out["harness_pid"])
    assert os.environ["OMP_NUM_THREADS"] == "1"  # the worker's own environment as it was


def test_a_cancelled_task_stops_the_entrys_group(tmp_path, monkeypatch):
    """ray.cancel raises KeyboardInterrupt in the task: the entry's group gets SIGTERM and is gone when it returns."""
    fake_ray(monkeypatch)
    polls = []

    def sleep(s):  # the task's poll for the entry's end: the 5th one is where ray.cancel lands
        polls.append(s)
        if len(polls) == 5:
            raise KeyboardInterrupt
        time.sleep(s)

    monkeypatch.setattr(node, "time", types.SimpleNamespace(sleep=sleep, monotonic=time.monotonic))
    token = f"time.sleep(60.{os.getpid()})"  # names this test's processes only
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; {token}']); {token}"
    log = tmp_path / "task.log"
    try:
        node.run_entry({"argv": [sys.executable, "-c", code], "cwd": str(REPO), "log": str(log), "stop_grace_s": 5})
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the interrupt did not go up")
    text = log.read_text()
    assert text.startswith("# matrix-entry:")
    # how the entry ended is in its log: python ends at SIGTERM at once (exit -15), well within the grace
    assert "# task: stopped the entry's harness (SIGTERM): exit code -15 after " in text and "its own teardown" in text
    left = [p for p in psutil.process_iter(["cmdline"]) if token in " ".join(p.info["cmdline"] or [])]
    assert left == []


def test_an_entry_that_outlives_the_grace_is_said_to_be_killed(tmp_path):
    node.note_stop(tmp_path / "task.log", -9, 60.4, 60.0)
    assert (tmp_path / "task.log").read_text() == (
        "# task: stopped the entry's harness (SIGTERM): exit code -9 after 60.4 s, killed after the 60 s grace\n"
    )
