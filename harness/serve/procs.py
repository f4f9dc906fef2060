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

Servers die with the harness, however it dies (SIGKILL by the OOM killer or a CI
timeout included), so that none keeps holding GPUs and ports:

- every server has a watchdog: a tiny process (its own group, so a signal to the
  harness's group spares it) that waits on a pipe only the harness holds. The
  kernel closes the pipe when the harness dies; the watchdog then sends SIGTERM
  and, after the grace period, SIGKILL to the server's group and to every process
  tagged with the dead harness. A normal stop tells it "done" first. (Not
  PR_SET_PDEATHSIG: it reaches only the server's leader, not vLLM's engine core
  and workers, and fires when the spawning *thread* exits.)
- every process started here carries ``PD_HARNESS_OWNER=<pid>:<start time>:<pid
  namespace>`` of its harness, inherited by its children; before its first
  start, a harness stops the tagged processes whose harness is gone (a watchdog
  that died too, or a harness killed between its server's start and its
  watchdog's). Only a tag naming a dead harness of this PID namespace counts.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from harness.core import progress

LOG_TAIL_LINES = 40
OWNER_ENV = "PD_HARNESS_OWNER"  # <pid>:<start time>:<pid namespace> of the harness that started the process
# Every process of a run carries its logs folder in this variable, so leftovers can be found by owner, never by name.
RUN_TAG_ENV = "PD_HARNESS_RUN_LOGS"


class ProcessFailed(RuntimeError):
    """A managed process died, hit a fatal log pattern, or was not ready in time."""

    def __init__(
        self,
        name: str,
        reason: str,
        returncode: int | None,
        log_path: Path | None,
        log_tail: str,
        after_ready: bool = False,
    ):
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
    # (regex, n): the n-th matching line fails it; for a failure the server retries that keeps coming back
    repeated_fatal: Sequence[tuple[str, int]] = ()
    ready_timeout_s: float = 300.0
    stop_grace_s: float = 8.0  # SIGTERM -> SIGKILL; vLLM shuts down in a few seconds


def _line_at(text: str, start: int, end: int) -> str:
    """The whole line of ``text`` around a match from ``start`` to ``end``."""
    line_end = text.find("\n", end)
    return text[text.rfind("\n", 0, start) + 1 : line_end if line_end >= 0 else None]


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


# -- servers die with the harness (see the module docstring) ----------------------------------------------------------
_STAT_STATE, _STAT_PGRP, _STAT_SESSION, _STAT_START = 0, 2, 3, 19  # /proc/<pid>/stat fields after "(comm)"


def _stat(pid: int | str) -> list[str] | None:
    """The fields of /proc/<pid>/stat after the command name (which may hold spaces), or None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    return raw[raw.rfind(b")") + 2 :].decode().split()


def _pid_ns(pid: int | str = "self") -> str:
    try:
        return os.readlink(f"/proc/{pid}/ns/pid").strip("pid:[]")
    except OSError:
        return "?"


def owner_tag(pid: int | None = None) -> str:
    """``<pid>:<start time>:<pid namespace>`` of a process (this one by default): a PID that a later process
    reuses has another start time, so the tag names one process for ever."""
    pid = os.getpid() if pid is None else pid
    st = _stat(pid)
    if st is None:
        raise ProcessLookupError(pid)
    return f"{pid}:{st[_STAT_START]}:{_pid_ns(pid)}"


def owner_alive(tag: str) -> bool:
    """Whether the harness a tag names still runs. A tag from another PID namespace, or one that does not parse,
    counts as alive: nothing is ever killed on a guess."""
    parts = tag.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or parts[2] != _pid_ns():
        return True
    st = _stat(parts[0])
    return st is not None and st[_STAT_START] == parts[1] and st[_STAT_STATE] not in ("Z", "X")


def _owner_of(pid: int | str) -> str | None:
    """The OWNER_ENV value a process was started with (its environment at exec), or None."""
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            env = f.read()
    except OSError:  # gone, or another user's
        return None
    key = OWNER_ENV.encode() + b"="
    for entry in env.split(b"\0"):
        if entry.startswith(key):
            return entry[len(key) :].decode(errors="replace")
    return None


def _live_pids() -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            st = _stat(d)
            if st is not None and st[_STAT_STATE] not in ("Z", "X"):
                out.append(int(d))
    return out


def _ancestors() -> set[int]:
    out, pid = set(), os.getpid()
    while pid > 1 and pid not in out:
        out.add(pid)
        st = _stat(pid)
        pid = int(st[1]) if st else 0
    return out


def orphans() -> list[int]:
    """Live processes tagged by a harness that is gone (never this process nor one of its ancestors)."""
    mine = _ancestors()
    found = []
    for pid in _live_pids():
        tag = _owner_of(pid)
        if tag is not None and pid not in mine and not owner_alive(tag):
            found.append(pid)
    return found


def _terminate(find: Callable[[], list[int]], grace_s: float) -> list[int]:
    """SIGTERM to what ``find`` returns, SIGKILL to what it still returns after ``grace_s``; all it ever returned.
    Processes are signalled by PID right after ``find`` saw them with the property that makes them targets."""
    hit: set[int] = set()
    for sig, wait_s in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 5.0)):
        pids = find()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        hit.update(pids)
        deadline = time.monotonic() + wait_s
        while find() and time.monotonic() < deadline:
            time.sleep(0.1)
    return sorted(hit)


_swept = threading.Lock()
_sweep_done = False


def sweep_orphans(grace_s: float = 5.0) -> list[int]:
    """Once per harness process, before its first start: stop what a harness that is gone left running."""
    global _sweep_done
    with _swept:
        if _sweep_done:
            return []
        _sweep_done = True
        found = orphans()
        if not found:
            return []
        progress.current().phase(
            f"stopping {len(found)} processes left by a harness that is gone: PIDs {' '.join(map(str, found))}"
        )
        return _terminate(orphans, grace_s)


def _watchdog_targets(tag: str, pgid: int, sid: str) -> list[int]:
    """The server's group (in the harness's session) and every process tagged with the harness."""
    out = []
    for pid in _live_pids():
        if pid == os.getpid():
            continue
        st = _stat(pid)
        if st is not None and (int(st[_STAT_PGRP]) == pgid and st[_STAT_SESSION] == sid or _owner_of(pid) == tag):
            out.append(pid)
    return out


def _watchdog_main(argv: list[str]) -> None:
    """The watchdog of one server (``argv``: harness tag, server group, harness session, grace seconds)."""
    import select

    tag, pgid, sid, grace_s = argv[0], int(argv[1]), argv[2], float(argv[3])
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)  # the harness's terminal is not ours to obey: only the harness's end is
    while True:
        # The pipe's end is the signal; the poll is a backstop for a harness child that kept the write end.
        if select.select([0], [], [], 1.0)[0]:
            data = os.read(0, 64)
            if data.startswith(b"done"):
                return  # a normal stop
            if not data:
                break  # end of file: the harness is gone
        elif not owner_alive(tag):
            break
    print(f"# watchdog: the harness ({tag}) is gone; stopping the server's group {pgid} and what it tagged", flush=True)
    hit = _terminate(lambda: _watchdog_targets(tag, pgid, sid), grace_s)
    print(f"# watchdog: stopped PIDs {' '.join(map(str, hit)) or 'none (already gone)'}", flush=True)


_WATCHDOG_CODE = (
    "import sys; sys.path.insert(0, sys.argv[1]); "
    "from harness.serve.procs import _watchdog_main; _watchdog_main(sys.argv[2:])"
)
_REPO = str(Path(__file__).resolve().parents[2])
# Popen keywords that make the child the leader of a new process group in our session (process_group is Python
# 3.11+; before it, the same setpgid(0, 0) in the child before exec).
_OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}


@dataclass
class Watchdog:
    """The harness's side of a server's watchdog: the process and the pipe's write end, which only we hold."""

    proc: subprocess.Popen[bytes]
    fd: int | None

    @classmethod
    def start(cls, pgid: int, log, grace_s: float) -> Watchdog:
        r, w = os.pipe()  # both ends close-on-exec: no other child of the harness keeps the write end open
        try:
            env = {k: v for k, v in os.environ.items() if k != OWNER_ENV}  # not a target of an outer watchdog
            proc = subprocess.Popen(
                [sys.executable, "-c", _WATCHDOG_CODE, _REPO, owner_tag(), str(pgid), str(os.getsid(0)), str(grace_s)],
                stdin=r,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                **_OWN_GROUP,
            )  # spared by a signal to the harness's group
        except BaseException:
            os.close(w)
            raise
        finally:
            os.close(r)
        return cls(proc, w)

    def dismiss(self) -> None:
        """The server was stopped here: the watchdog goes without touching anything. Idempotent."""
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.write(self.fd, b"done\n")  # told before the pipe closes, so it never takes the end for our death
            os.close(self.fd)
            self.fd = None
        # Our own unreaped child, so its PID is still its own: no need to wait for it to read "done" (it may
        # still be importing on a loaded machine).
        with contextlib.suppress(ProcessLookupError):
            self.proc.kill()
        self.proc.wait()


class ManagedProcess:
    def __init__(self, spec: ProcessSpec):
        self.spec = spec
        self.proc: subprocess.Popen[bytes] | None = None
        self._seen: dict[int, psutil.Process] = {}
        self._log_offset = 0
        self._fatal = [re.compile(p) for p in spec.fatal_patterns]
        self._repeated = [(re.compile(p), n) for p, n in spec.repeated_fatal]
        self._repeat_counts = [0] * len(self._repeated)
        self.started_at: float | None = None
        self.ready_after_s: float | None = None
        self._watchdog: Watchdog | None = None

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
        sweep_orphans()
        env = {**os.environ, **self.spec.env, OWNER_ENV: owner_tag()}
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
                **_OWN_GROUP,  # its own process group (killpg), in our session: see the module docstring
            )
            try:
                self._watchdog = Watchdog.start(self.proc.pid, log, self.spec.stop_grace_s)
            except BaseException:
                self._signal_group(signal.SIGKILL)  # no server runs without its watchdog
                self.proc.wait()
                raise
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
        return ProcessFailed(
            self.name,
            reason,
            self.returncode,
            self.spec.log_path,
            self.log_tail(),
            after_ready=self.ready_after_s is not None,
        )

    def _scan_fatal(self) -> str | None:
        if not self._fatal and not self._repeated:
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
                return _line_at(text, m.start(), m.end())
        for i, (pattern, n) in enumerate(self._repeated):
            for m in pattern.finditer(text):
                self._repeat_counts[i] += 1
                if self._repeat_counts[i] >= n:
                    return f"{_line_at(text, m.start(), m.end()).strip()} (seen {n} times)"
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
            self._dismiss_watchdog()

    def _dismiss_watchdog(self) -> None:
        if self._watchdog is not None:
            self._watchdog.dismiss()
            self._watchdog = None

    def terminate(self) -> None:
        """SIGTERM the group without waiting (``stop_all`` signals every process first, then waits once)."""
        if self.proc is not None and self.proc.poll() is None:
            self._signal_group(signal.SIGTERM)

    def stop(self) -> int | None:
        """SIGTERM the group, wait the grace period, SIGKILL, then sweep descendants. Idempotent."""
        if self.proc is None:
            return None
        self._signal_group(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=self.spec.stop_grace_s)
        # The leader may have exited while children still run in its group.
        self._signal_group(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        self._sweep()
        self._dismiss_watchdog()  # only now: a harness killed during the stop still has its watchdog finish it
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
