"""The process owner against small real processes."""

import sys
import time

import psutil
import pytest

from harness.serve.ports import PortAllocator
from harness.serve.procs import ManagedProcess, ProcessFailed, ProcessSpec, start_all

SERVER = """
import http.server, sys, time, os
time.sleep(float(sys.argv[2]))
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200); self.end_headers(); self.wfile.write(b"ok")
    def log_message(self, *a): pass
print("serving", flush=True)
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), H).serve_forever()
"""


@pytest.fixture
def alloc(tmp_path):
    with PortAllocator(lock_dir=tmp_path / "locks") as a:
        yield a


def server(tmp_path, port, delay=0.0, name="srv", **kw):
    return ManagedProcess(
        ProcessSpec(
            name=name,
            argv=[sys.executable, "-c", SERVER, str(port), str(delay)],
            log_path=tmp_path / "logs" / f"{name}.log",
            health_url=f"http://127.0.0.1:{port}/",
            **kw,
        )
    )


def test_ready_then_torn_down_with_log(tmp_path, alloc):
    with server(tmp_path, alloc.port(), delay=0.5) as p:
        assert p.wait_ready() >= 0.5
        pid = p.pid
        assert psutil.pid_exists(pid)
    assert not p.alive() and p.leftover_pids() == []
    assert "serving" in (tmp_path / "logs" / "srv.log").read_text()


def test_dead_process_fails_at_once_with_exit_code_and_tail(tmp_path):
    p = ManagedProcess(
        ProcessSpec(
            "bad",
            [sys.executable, "-c", "print('boom: config error'); raise SystemExit(3)"],
            tmp_path / "bad.log",
            health_url="http://127.0.0.1:9/",
            ready_timeout_s=60,
        )
    )
    t0 = time.monotonic()
    with pytest.raises(ProcessFailed) as e, p:
        p.wait_ready()
    assert time.monotonic() - t0 < 20
    assert e.value.returncode == 3 and "boom: config error" in e.value.log_tail


def test_fatal_log_pattern_fails_readiness_even_if_alive(tmp_path):
    code = "import time; print('EngineCore failed to start.', flush=True); time.sleep(60)"
    p = ManagedProcess(
        ProcessSpec(
            "fatal",
            [sys.executable, "-c", code],
            tmp_path / "f.log",
            health_url="http://127.0.0.1:9/",
            fatal_patterns=[r"EngineCore failed to start"],
        )
    )
    with pytest.raises(ProcessFailed, match="fatal log line"), p:
        p.wait_ready()
    assert not p.alive()


def test_deadline(tmp_path, alloc):
    p = server(tmp_path, alloc.port(), delay=30, ready_timeout_s=1)
    with pytest.raises(ProcessFailed, match="not ready within"), p:
        p.wait_ready()
    assert p.leftover_pids() == []


def test_sigterm_ignoring_children_are_killed(tmp_path):
    # A parent that ignores SIGTERM and a grandchild that escapes into its own session.
    code = (
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'], start_new_session=True)\n"
        "print('UP' + 'NOW', flush=True); time.sleep(120)\n"
    )
    p = ManagedProcess(ProcessSpec("stubborn", [sys.executable, "-c", code], tmp_path / "s.log", stop_grace_s=1))
    with p:
        deadline = time.monotonic() + 10
        while "UPNOW" not in p.log_text() and time.monotonic() < deadline:
            time.sleep(0.05)
        p.check()
        kids = psutil.Process(p.pid).children(recursive=True)
        assert kids
    assert p.leftover_pids() == []
    assert not any(k.is_running() and k.status() != psutil.STATUS_ZOMBIE for k in kids)


def test_failed_start_tears_down_the_others(tmp_path, alloc):
    import contextlib

    good = server(tmp_path, alloc.port(), name="good")
    bad = ManagedProcess(
        ProcessSpec(
            "bad", [sys.executable, "-c", "raise SystemExit(1)"], tmp_path / "b.log", health_url="http://127.0.0.1:9/"
        )
    )
    with pytest.raises(ProcessFailed, match="bad"), contextlib.ExitStack() as stack:
        start_all([good, bad], stack, timeout_s=30)
    assert not good.alive() and good.leftover_pids() == []


def test_stopped_restarts(tmp_path, alloc):
    with server(tmp_path, alloc.port()) as p:
        p.wait_ready()
        first = p.pid
        with p.stopped():
            assert not p.alive()
        assert p.alive() and p.pid != first


def test_a_retried_failure_is_fatal_only_once_it_has_come_back_n_times(tmp_path):
    """vLLM retries a failed NIXL handshake with every request: two failures leave the server running, the third
    (its log line as vLLM writes it) fails it, naming the line."""
    from harness.checks.classify import HANDSHAKE_FAILURES_FATAL, REPEATED_FATAL

    line = (
        "ERROR 12-05 10:00:00 [base_worker.py:1261] NIXL transfer failure: handshake_setup_failed | "
        "Context: {'remote_engine_id': 'e1'}"
    )
    go = tmp_path / "go"
    code = (
        f"import os, time; [print({line!r}, flush=True) for _ in range({HANDSHAKE_FAILURES_FATAL - 1})]\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        f"print({line!r}, flush=True); time.sleep(60)"
    )
    p = ManagedProcess(
        ProcessSpec("d", [sys.executable, "-c", code], tmp_path / "d.log", repeated_fatal=REPEATED_FATAL)
    )
    with p:
        deadline = time.monotonic() + 20
        while p.log_tail().count("handshake_setup_failed") < HANDSHAKE_FAILURES_FATAL - 1:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        p.check()  # twice: still serving
        go.touch()
        with pytest.raises(ProcessFailed, match=f"handshake_setup_failed .*seen {HANDSHAKE_FAILURES_FATAL} times"):
            while time.monotonic() < deadline:
                p.check()
                time.sleep(0.05)
