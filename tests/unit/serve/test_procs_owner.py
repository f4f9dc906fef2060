"""Processes the harness starts carry their harness's tag; a harness that is gone has its processes stopped by the
next one, and only those (issue 23 item 10; the SIGKILL case itself is tests/integration/test_harness_sigkill_cpu.py).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.serve import procs
from harness.serve.procs import OWNER_ENV, ManagedProcess, ProcessSpec, owner_alive, owner_tag, sweep_orphans

SLEEP = [sys.executable, "-c", "import time; time.sleep(60)"]


def alive(pid: int) -> bool:
    try:
        p = psutil.Process(pid)
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


@pytest.fixture
def spawned():
    """Popen'd helpers, killed and reaped at the end whatever happened."""
    started: list[subprocess.Popen] = []

    def spawn(argv, **kw) -> subprocess.Popen:
        p = subprocess.Popen(argv, **kw)
        started.append(p)
        return p

    yield spawn
    for p in started:
        with contextlib.suppress(ProcessLookupError):
            p.kill()
        p.wait()


def dead_harness_tag(spawn) -> str:
    """The tag of a process that ran and is gone."""
    p = spawn(SLEEP)
    tag = owner_tag(p.pid)
    p.kill()
    p.wait()
    return tag


def test_a_tag_names_one_process_for_ever(spawned):
    me = owner_tag()
    pid, start, ns = me.split(":")
    assert int(pid) == os.getpid() and start.isdigit() and ns
    assert owner_alive(me)
    assert not owner_alive(dead_harness_tag(spawned))
    assert not owner_alive(f"{pid}:{int(start) + 1}:{ns}"), "the same PID with another start time is another process"
    # Nothing is killed on a guess: another PID namespace, or a tag that does not parse, counts as alive.
    assert owner_alive(f"999999:1:{ns}0") and owner_alive("garbage") and owner_alive("")


def test_the_sweep_stops_what_a_gone_harness_left_and_nothing_else(spawned, monkeypatch):
    monkeypatch.setattr(procs, "_sweep_done", False)
    gone = dead_harness_tag(spawned)
    orphan = spawned(SLEEP, env={**os.environ, OWNER_ENV: gone})
    ours = spawned(SLEEP, env={**os.environ, OWNER_ENV: owner_tag()})  # a live harness's (this one's) server
    untagged = spawned(SLEEP, env={k: v for k, v in os.environ.items() if k != OWNER_ENV})
    time.sleep(0.2)  # exec'd: /proc/<pid>/environ is the child's own
    assert orphan.pid in sweep_orphans(grace_s=2)
    assert orphan.wait(5) is not None
    assert alive(ours.pid) and alive(untagged.pid)
    assert sweep_orphans() == [], "once per harness process"


def test_the_sweep_never_stops_the_harness_itself(tmp_path, spawned):
    """A harness started by a harness that is gone (a nightly step, say) carries the dead tag itself."""
    code = (
        "import os, sys; sys.path.insert(0, sys.argv[1]); from harness.serve.procs import orphans\n"
        "print(os.getpid() in orphans())"
    )
    got = subprocess.run(
        [sys.executable, "-c", code, str(Path(__file__).resolve().parents[3])],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, OWNER_ENV: dead_harness_tag(spawned)},
    )
    assert got.stdout.strip() == "False", got.stderr


def test_a_server_carries_the_tag_and_a_normal_stop_leaves_no_watchdog(tmp_path):
    me = psutil.Process()
    before = {c.pid for c in me.children()}
    mp = ManagedProcess(ProcessSpec(name="s", argv=SLEEP, log_path=tmp_path / "s.log", stop_grace_s=2)).start()
    try:
        assert psutil.Process(mp.pid).environ()[OWNER_ENV] == owner_tag()
        watchdogs = [c for c in me.children() if c.pid not in before and c.pid != mp.pid]
        assert len(watchdogs) == 1 and "_watchdog_main" in " ".join(watchdogs[0].cmdline())
        assert OWNER_ENV not in watchdogs[0].environ(), "a watchdog is nobody's target"
        assert os.getpgid(watchdogs[0].pid) == watchdogs[0].pid, "its own group: a signal to the harness's spares it"
    finally:
        mp.stop()
    assert not alive(watchdogs[0].pid) and {c.pid for c in me.children()} <= before
    assert "watchdog" not in (tmp_path / "s.log").read_text(), "dismissed, it touched nothing"
