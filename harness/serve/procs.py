"""The one owner of every process the harness starts (vLLM servers, the proxy).

A ``ManagedProcess`` starts its command as the leader of a new process group
(in the harness's own session), sends all output to one log file, waits for
readiness under a single deadline, and tears down the whole group - plus every
descendant it ever saw, in case one escaped the group - when it leaves its
``with`` block. Nothing is ever killed by name.

Why a process group and not a session of its own: with the kernel's autogroup
scheduling (on by default) every session is a scheduling group of its own, and
on a small CPU box a NIXL/UCX progress thread spinning in one server's group
starved a peer server's rank bound to the same core for tens of seconds (the
first-request stall of decode TP 2 on CPU: 9 of 13 start-ups in separate
sessions, 0 of 5 in one session, measured side by side). Terminal signals still
reach only the harness: a server's group is never the foreground group.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from harness.core import progress

LOG_TAIL_LINES = 40


class ProcessFailed(RuntimeError):
    """A managed process died, hit a fatal log pattern, or was not ready in time."""

    def __init__(self, name: str, reason: str, returncode: int | None, log_path: Path | None, log_tail: str,
                 after_ready: bool = False):
        self.name = name
        self.reason = reason
        self.returncode = returncode
        self.log_path = log_path  # None for a server this harness did not start (attach mode)
        self.log_tail = log_tail
        self.after_ready = after_ready  # it had been serving: it died, rather than failed to start
        rc = "still running" if returncode is None else f"exit code {returncode}"
        super().__init__(f"{name}: {reason} ({rc}); log {log_path}, last lines:\n{log_tail}")


@dataclass(frozen=True)
class ProcessSpec:
    name: str
    argv: Sequence[str]
    log_path: Path
    env: Mapping[str, str] = field(default_factory=dict)  # added to os.environ
    cwd: Path | None = None
    health_url: str | None = None  # readiness: GET answers 200
    fatal_patterns: Sequence[str] = ()  # regexes; a match in the log fails readiness at once
    ready_timeout_s: float = 300.0
    stop_grace_s: float = 8.0  # SIGTERM -> SIGKILL; vLLM shuts down in a few seconds


def tail_text(text: str, lines: int = LOG_TAIL_LINES) -> str:
    return "\n".join(text.splitlines()[-lines:])


def tail(path: Path, lines: int = LOG_TAIL_LINES) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - 64 * 1024))
            data = f.read().decode("utf-8", "replace")
    except FileNotFoundError:
        return "<no log>"
    return tail_text(data, lines)


def http_ok(url: str, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status == 200
    except (urllib.error.URLError, OSError, ValueError):
        return False


class ManagedProcess:
    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}
        self._log_offset = 0
        self._fatal = [re.compile(p) for p in spec.fatal_patterns]
        self.started_at: float | None = None
        self.ready_after_s: float | None = None

    # -- lifecycle -----------------------------------------------------------
    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def returncode(self) -> int | None:
        return self.proc.poll() if self.proc else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self) -> ManagedProcess:
        if self.proc is not None:
            raise RuntimeError(f"{self.name} already started")
        self.spec.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.spec.env}
        with open(self.spec.log_path, "ab") as log:
            log.write(f"# {self.name}: {' '.join(self.spec.argv)}\n".encode())
            log.flush()
            self._log_offset = log.tell()
            self.proc = subprocess.Popen(
                list(self.spec.argv),
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=env,
                cwd=self.spec.cwd,
                process_group=0,  # its own process group (killpg), in our session: see the module docstring
            )
        self.started_at = time.monotonic()
        self.ready_after_s = None
        self._remember_descendants()
        return self

    def log_tail(self, lines: int = LOG_TAIL_LINES) -> str:
        return tail(self.spec.log_path, lines)

    def log_text(self) -> str:
        try:
            return self.spec.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def fail(self, reason: str) -> ProcessFailed:
        return ProcessFailed(self.name, reason, self.returncode, self.spec.log_path, self.log_tail(),
                             after_ready=self.ready_after_s is not None)

    def _scan_fatal(self) -> str | None:
        if not self._fatal:
            return None
        try:
            with open(self.spec.log_path, "rb") as f:
                f.seek(self._log_offset)
                chunk = f.read()
        except FileNotFoundError:
            return None
        # Only advance to the last full line, so a pattern split across reads is still seen.
        cut = chunk.rfind(b"\n") + 1
        self._log_offset += cut
        text = chunk[:cut].decode("utf-8", "replace")
        for pattern in self._fatal:
            m = pattern.search(text)
            if m:
                line_start = text.rfind("\n", 0, m.start()) + 1
                line_end = text.find("\n", m.end())
                return text[line_start : line_end if line_end >= 0 else None]
        return None

    def check(self, force: bool = False) -> None:
        """Raise at once if the process died or its log shows a fatal pattern (always a full check; ``force``
        is there for the watch interface, which remote servers implement with rate-limited probes)."""
        if self.proc is None:
            raise RuntimeError(f"{self.name} not started")
        self._remember_descendants()
        hit = self._scan_fatal()
        if hit is not None:
            raise self.fail(f"fatal log line: {hit.strip()}")
        if self.proc.poll() is not None:
            raise self.fail("exited while serving" if self.ready_after_s is not None else "exited before it was ready")

    def is_ready(self) -> bool:
        """One readiness probe: alive, no fatal line, and /health answers 200."""
        self.check()
        return self.spec.health_url is None or http_ok(self.spec.health_url)

    def wait_ready(self, deadline: float | None = None, poll_s: float = 0.1) -> float:
        """Block until ready; returns seconds from start to ready."""
        if deadline is None:
            deadline = time.monotonic() + self.spec.ready_timeout_s
        progress.current().status(lambda: starting_status([self]))
        try:
            while True:
                if self.is_ready():
                    assert self.started_at is not None
                    self.ready_after_s = time.monotonic() - self.started_at
                    return self.ready_after_s
                if time.monotonic() >= deadline:
                    raise self.fail(f"not ready within {self.spec.ready_timeout_s:.0f} s")
                time.sleep(poll_s)
        finally:
            progress.current().clear()

    def _remember_descendants(self) -> None:
        if not self.alive():
            return
        try:
            root = psutil.Process(self.proc.pid)  # type: ignore[union-attr]
            for p in [root, *root.children(recursive=True)]:
                self._seen.setdefault(p.pid, p)
        except psutil.Error:
            pass

    def _signal_group(self, sig: int) -> None:
        """``sig`` to the process's whole group (its PID is the group id), remembering descendants first."""
        assert self.proc is not None
        self._remember_descendants()
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)

    def kill(self) -> None:
        """SIGKILL the whole group now (fault injection: a backend dying mid-request)."""
        if self.proc is not None:
            self._signal_group(signal.SIGKILL)
            self.proc.wait()

    def terminate(self) -> None:
        """SIGTERM the group without waiting (``stop_all`` signals every process first, then waits once)."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)

    def stop(self) -> int | None:
        """SIGTERM the group, wait the grace period, SIGKILL, then sweep descendants. Idempotent."""
        if self.proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.spec.stop_grace_s)
        except subprocess.TimeoutExpired:
            pass
        # The leader may have exited while children still run in its group.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._sweep()
        return self.proc.returncode

    def _sweep(self) -> None:
        leftovers = []
        for p in self._seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    p.kill()  # psutil checks create_time, so a reused PID is never hit
                    leftovers.append(p)
            except psutil.Error:
                pass
        psutil.wait_procs(leftovers, timeout=5)

    def seen_pids(self) -> list[int]:
        """Every PID of this process tree seen so far, alive or not (e.g. to check they left the GPUs)."""
        return list(self._seen)

    def leftover_pids(self) -> list[int]:
        """PIDs of processes this object started that are still running (should be empty after stop)."""
        out = []
        for p in self._seen.values():
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    out.append(p.pid)
            except psutil.Error:
                pass
        return out

    @contextlib.contextmanager
    def stopped(self) -> Iterator[None]:
        """Stop the process for the duration of the block, then start and wait for it again."""
        self.stop()
        try:
            yield
        finally:
            self.proc = None
            self.start()
            self.wait_ready()

    def __enter__(self) -> ManagedProcess:
        if self.proc is None:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def stop_all(procs: Sequence[ManagedProcess]) -> None:
    """Tear down several processes in parallel: one grace period in all, not one each."""
    if not procs:
        return
    rep = progress.current()
    names = ", ".join(p.name for p in procs)
    span = rep.begin(f"{names} teardown", "teardown")
    for p in procs:
        p.terminate()
    for p in procs:
        p.stop()
    rep.end(span, True, f"{names} stopped in {progress.duration(rep.clock() - span.start)}")


def starting_status(procs: Sequence[ManagedProcess]) -> str:
    """What each process still starting is doing: its seconds since start and the last line of its log."""
    parts = []
    for p in procs:
        since = time.monotonic() - p.started_at if p.started_at is not None else 0.0
        line = progress.last_line(p.log_tail(5), 120)
        if line.startswith(f"# {p.name}:"):  # only the harness's own header so far
            line = "no output yet"
        parts.append(f"{p.name} starting, {since:.0f} s: {line}")
    return " | ".join(parts)


def start_all(procs: Sequence[ManagedProcess], stack: contextlib.ExitStack, timeout_s: float) -> dict[str, float]:
    """Start processes together and wait until all are ready under one deadline.

    Their teardown is registered on ``stack`` before the first starts, so a
    failure anywhere tears down whatever already started. Returns launch->ready
    seconds by name.
    """
    started: list[ManagedProcess] = []
    stack.callback(stop_all, started)
    rep = progress.current()
    spans = {}
    if procs:
        rep.phase(f"starting {', '.join(p.name for p in procs)} (logs: {procs[0].spec.log_path.parent})")
    for p in procs:
        p.start()
        started.append(p)
        spans[p.name] = rep.begin(f"{p.name} start-up", "launch")
    deadline = time.monotonic() + timeout_s
    pending = list(procs)
    ready: dict[str, float] = {}
    try:
        rep.status(lambda: starting_status(list(pending)))
        while pending:
            for p in list(pending):
                if p.is_ready():
                    assert p.started_at is not None
                    p.ready_after_s = time.monotonic() - p.started_at
                    ready[p.name] = p.ready_after_s
                    pending.remove(p)
                    rep.end(spans[p.name], True, f"{p.name} ready after {progress.duration(p.ready_after_s)}")
                    if pending:
                        rep.status(lambda: starting_status(list(pending)))
            if pending and time.monotonic() >= deadline:
                raise pending[0].fail(f"not ready within {timeout_s:.0f} s")
            if pending:
                time.sleep(0.1)
    finally:
        for name, span in spans.items():
            if span.end is None:
                rep.end(span, False, f"{name}: start-up ended before it was ready")
    return ready
