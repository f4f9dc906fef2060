"""Hygiene: ports another program holds are never handed out; starting and stopping processes leaks nothing."""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from harness.run.launch import make_proxy
from harness.serve.ports import PortAllocator, PortExhausted, default_lock_dir
from harness.serve.procs import RUN_TAG_ENV, ManagedProcess, ProcessSpec, start_all
from tests.helpers import FULL, processes_tagged


@contextlib.contextmanager
def bound_elsewhere(port: int, host: str):
    """``port`` bound and listening by an unrelated child process (not the harness, no lock file)."""
    code = (
        "import socket, sys, time\n"
        "s = socket.socket()\n"
        f"s.bind(({host!r}, {port}))\n"
        "s.listen()\n"
        "print('bound', flush=True)\n"
        "time.sleep(120)\n"
    )
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "bound"
        yield p
    finally:
        p.kill()
        p.wait()
        p.stdout.close()


@pytest.mark.parametrize("host", ["127.0.0.1", "0.0.0.0"])
def test_a_port_bound_by_another_program_is_never_handed_out(tmp_path, host):
    # Two consecutive ports reserved machine-wide (so no other harness run takes them meanwhile);
    # the test's own allocator uses a private lock dir, so only the bind check can protect the busy one.
    with PortAllocator() as reserve:
        pair = reserve.block(2)
        busy, free = pair.base, pair.base + 1
        with bound_elsewhere(busy, host):
            for seed in range(20):  # the allocator picks at random: cover both choices
                with PortAllocator(lock_dir=tmp_path, port_range=(busy, busy + 2), seed=seed) as alloc:
                    assert alloc.port() == free
                    with pytest.raises(PortExhausted):
                        alloc.port()  # the only other port is the bound one
            with PortAllocator(lock_dir=tmp_path, port_range=(busy, busy + 2)) as alloc, pytest.raises(PortExhausted):
                alloc.block(2)  # a block never spans the bound port either
        # Once the other program is gone, the port is free again.
        with PortAllocator(lock_dir=tmp_path, port_range=(busy, busy + 2)) as alloc:
            assert alloc.block(2).base == busy


def _bindable_now(port: int) -> bool:
    # SO_REUSEADDR: a closed server's TIME_WAIT connections do not count, a live listener does.
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


def _locked_by_someone(lock_dir: Path, port: int) -> bool:
    try:
        fd = os.open(lock_dir / f"{port}.lock", os.O_RDWR)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        fcntl.flock(fd, fcntl.LOCK_UN)
        return False
    except OSError:
        return True
    finally:
        os.close(fd)


def _open_lock_files(lock_dir: Path) -> list[str]:
    me = psutil.Process()
    return [f.path for f in me.open_files() if Path(f.path).parent == lock_dir]


def _running(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# 40 cycles in CI's cut (CI time), 100 in `make test-full`
CYCLES = int(os.environ.get("PD_HARNESS_HYGIENE_CYCLES", "100" if FULL else "40"))
CYCLES_BOUND_S = 600  # self-stopping: the loop gives up (and fails) past this


@pytest.mark.slow
@pytest.mark.timeout(CYCLES_BOUND_S + 120)  # its own bound first, so it is the one that reports
def test_many_proxy_start_stop_cycles_leak_no_process_port_or_fd(tmp_path):
    logs = tmp_path / "logs"
    lock_dir = default_lock_dir()  # the machine-wide one: never collide with a run going on beside this test
    me = psutil.Process()
    started: list[psutil.Process] = []  # every process this test started, with its create time (no PID reuse confusion)
    ports: set[int] = set()
    fds_after_first = None
    t0 = time.monotonic()
    try:
        for i in range(CYCLES):
            assert time.monotonic() - t0 < CYCLES_BOUND_S, f"only {i} of {CYCLES} cycles in {CYCLES_BOUND_S} s"
            with PortAllocator(lock_dir=lock_dir) as alloc, contextlib.ExitStack() as stack:
                port = alloc.port()
                backend = ManagedProcess(
                    ProcessSpec(
                        name="backend",
                        argv=[sys.executable, "-m", "http.server", "--bind", "127.0.0.1", str(port)],
                        log_path=logs / "backend.log",
                        env={RUN_TAG_ENV: str(logs)},
                        health_url=f"http://127.0.0.1:{port}/",
                        ready_timeout_s=60,
                        stop_grace_s=10,
                    )
                )
                url = f"http://127.0.0.1:{port}"
                proxy, proxy_url = make_proxy(sys.executable, alloc, [url], [url], logs, timeout_s=5)
                ports |= {port, int(proxy_url.rsplit(":", 1)[1])}
                try:
                    start_all([backend, proxy], stack, 60)
                finally:
                    for p in (backend, proxy):
                        if p.pid is not None:
                            with contextlib.suppress(psutil.Error):
                                started.append(psutil.Process(p.pid))
                assert backend.is_ready() and proxy.is_ready()
            # Both left their with blocks: stopped, their ports released.
            for p in (backend, proxy):
                assert not p.alive() and p.leftover_pids() == [], (i, p.name, p.leftover_pids())
            assert alloc.held == frozenset()
            if i == 0:
                fds_after_first = me.num_fds()
        fds_end = me.num_fds()
    finally:
        survivors = [p for p in started if _running(p)]
        for p in survivors:
            with contextlib.suppress(psutil.Error):
                p.kill()
        tagged = processes_tagged(logs)
        for pid in tagged:
            with contextlib.suppress(psutil.Error):
                psutil.Process(pid).kill()
    assert len(started) == 2 * CYCLES
    assert survivors == [], f"still running: {[p.pid for p in survivors]}"
    assert tagged == []
    # Ports: none has a live listener left, and this process holds no lock file. A port that another run
    # took meanwhile (its lock held by someone) is not ours.
    leaked = [p for p in sorted(ports) if not _bindable_now(p) and not _locked_by_someone(lock_dir, p)]
    assert leaked == [], f"ports still bound after every process stopped: {leaked}"
    assert _open_lock_files(lock_dir) == []
    # File descriptors: flat after the first cycle (which may open lazily created things once).
    assert fds_end - fds_after_first <= 5, (fds_after_first, fds_end)
    # Every process log stays where it was asked to be.
    assert (logs / "backend.log").stat().st_size > 0 and (logs / "proxy.log").stat().st_size > 0
