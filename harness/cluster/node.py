"""What one Ray task runs on its node: one matrix entry's harness, as a process the task owns.

Ray ships this module to the node by value (``ray_tasks.py`` registers it so), so the node's worker needs nothing of
the harness importable beforehand; the function puts the harness checkout (the task's ``cwd``, at the same path on
every node) on ``sys.path`` and runs the entry through the harness's own process owner (``serve/procs.py``): the
entry's harness leads a process group of its own and its output goes to the task's log. A task interrupted in Python
(``ray.cancel``) or failing stops the group: SIGTERM, the harness's own teardown of its servers and report, SIGKILL
after the grace period. If the worker itself dies (``ray.cancel(force=True)``, a crash), Ray kills its child processes
(``RAY_kill_child_processes_on_worker_exit``, on by default), the entry's harness among them, whose servers' own
watchdogs then stop them; with that setting off, the entry's watchdog stops the group."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path
from typing import Any

# Ray sets OMP_NUM_THREADS in a worker (to the task's CPUs) when the node's environment does not; a local matrix
# entry runs without it, so the entry's harness gets the node's environment without what Ray added.
RAY_ADDED_ENV = ("OMP_NUM_THREADS",)
POLL_S = 0.2


def ray_added(worker_env: dict[str, str], raylet_env: dict[str, str] | None) -> list[str]:
    """What Ray added to the worker's environment: the RAY_ADDED_ENV variables the raylet (the environment the node
    was started with) lacks. None for the raylet's (unreadable): nothing counts as added."""
    if raylet_env is None:
        return []
    return [k for k in RAY_ADDED_ENV if k in worker_env and k not in raylet_env]


def _raylet_env() -> dict[str, str] | None:
    import psutil

    try:
        parent = psutil.Process().parent()
        return None if parent is None else dict(parent.environ())
    except psutil.Error:
        return None


def start_in_node_env(proc: Any) -> None:
    """Start ``proc`` (a ManagedProcess) in the node's environment: without what Ray added to this worker's, which is
    restored afterwards."""
    added = {k: os.environ.pop(k) for k in ray_added(dict(os.environ), _raylet_env())}
    try:
        proc.start()
    finally:
        os.environ.update(added)  # the worker's own environment as Ray left it


def run_entry(payload: dict[str, Any]) -> dict[str, Any]:
    """Run one entry's harness to its end on this node; returns where it ran, its exit code and its seconds."""
    if payload["cwd"] not in sys.path:
        sys.path.insert(0, payload["cwd"])
    import ray

    from harness.core.notrack import with_no_track
    from harness.serve.procs import ManagedProcess, ProcessSpec

    ctx = ray.get_runtime_context()
    where: dict[str, Any] = {
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "hostname": socket.gethostname(),
        "worker_pid": os.getpid(),
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
    }
    proc = ManagedProcess(
        ProcessSpec(
            "matrix-entry",
            tuple(payload["argv"]),
            Path(payload["log"]),
            env=with_no_track(),  # over the node's environment (the worker's, which the process owner passes on)
            cwd=Path(payload["cwd"]),
            stop_grace_s=float(payload["stop_grace_s"]),
        )
    )
    t0 = time.monotonic()
    try:  # leaving it by any way (done, cancelled, failed) stops the entry's process group
        start_in_node_env(proc)
        assert proc.proc is not None
        where["harness_pid"] = proc.proc.pid
        # Polled, not one wait(): ray.cancel raises KeyboardInterrupt in the task only between Python bytecodes, and
        # a wait() for the entry's end would hold it off until then (measured: the cancel never landed).
        while (returncode := proc.proc.poll()) is None:
            time.sleep(POLL_S)
    finally:
        running = proc.alive()
        t_stop = time.monotonic()
        rc = proc.stop()
        if running:  # cancelled or failed here: how the entry's harness ended goes into its log (issue 26)
            note_stop(Path(payload["log"]), rc, time.monotonic() - t_stop, float(payload["stop_grace_s"]))
    where.update(returncode=returncode, seconds=round(time.monotonic() - t0, 1))
    return where


def note_stop(log: Path, rc: int | None, secs: float, grace_s: float) -> None:
    """One line at the end of the task's log: the entry's harness stopped by this task, its exit code and how long its
    own teardown took (or that the grace ran out and it was killed)."""
    how = f"killed after the {grace_s:g} s grace" if secs >= grace_s else "its own teardown"
    with open(log, "a") as f:
        f.write(f"# task: stopped the entry's harness (SIGTERM): exit code {rc} after {secs:.1f} s, {how}\n")
