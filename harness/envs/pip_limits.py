"""Bounds on every pip (and installer) subprocess of the harness: a stalled download must fail, never hang a run.

Two layers: pip's own ``--timeout`` (seconds a socket may stay silent) and ``--retries`` end a dead connection;
a wall-clock limit on the whole subprocess ends anything else (a download that trickles, a build that hangs).
On that limit the subprocess's whole process group is killed (pip runs build back-ends as children) and the
caller's error names the command and its log.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import subprocess
from collections.abc import Mapping, Sequence

# pip's defaults are 15 s and 5 retries; a large wheel from a busy mirror may pause longer than 15 s.
PIP_SOCKET_TIMEOUT_S = 60
PIP_RETRIES = 5
# The wall clock for one pip command: a GPU vLLM install downloads several GB. PD_HARNESS_PIP_TIMEOUT_S overrides.
PIP_WALL_TIMEOUT_S = 3600.0
TIMEOUT_ENV = "PD_HARNESS_PIP_TIMEOUT_S"


def pip_network_args(env: Mapping[str, str] | None = None) -> list[str]:
    """``--timeout S --retries N`` for a pip command line; pip's own PIP_DEFAULT_TIMEOUT / PIP_RETRIES settings win,
    as a person who set them asked for them."""
    env = os.environ if env is None else env
    return [
        "--timeout",
        env.get("PIP_DEFAULT_TIMEOUT") or str(PIP_SOCKET_TIMEOUT_S),
        "--retries",
        env.get("PIP_RETRIES") or str(PIP_RETRIES),
    ]


def wall_timeout_s(env: Mapping[str, str] | None = None) -> float:
    """The wall-clock limit of one pip command (read at call time, so a test or a person can change it)."""
    raw = (os.environ if env is None else env).get(TIMEOUT_ENV, "")
    try:
        return float(raw) if raw.strip() else PIP_WALL_TIMEOUT_S
    except ValueError:
        return PIP_WALL_TIMEOUT_S


class SubprocessTimedOut(RuntimeError):
    """A subprocess ran past its wall-clock limit and was killed."""

    def __init__(self, cmd: Sequence[str], timeout_s: float, log: str | None):
        self.cmd = list(cmd)
        self.timeout_s = timeout_s
        self.log = log
        where = f"; log {log}" if log else ""
        super().__init__(
            f"`{shlex.join(self.cmd)}` ran past {timeout_s:.0f} s (a stalled download?) and was killed{where}"
        )


def log_name(log: object) -> str | None:
    """The path of an open log file, for error messages."""
    name = getattr(log, "name", None)
    return name if isinstance(name, str) else None


def _kill_group(proc: subprocess.Popen) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def run_bounded(
    cmd: Sequence[str], timeout_s: float, log: str | None = None, *, capture_output: bool = False, **popen_kwargs
) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd)`` with a wall-clock limit that kills the command's whole process group (not only
    the command: subprocess.run's own timeout leaves pip's children running and holding its pipes).
    Raises ``SubprocessTimedOut`` naming the command and ``log``; on any other exception the group is killed too."""
    if capture_output:
        popen_kwargs.update(stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    # Its own process group (a new session: process_group=0 would need Python 3.11), so the limit reaches every
    # process pip started.
    with subprocess.Popen(list(cmd), start_new_session=True, **popen_kwargs) as proc:
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.communicate(timeout=10)
            raise SubprocessTimedOut(cmd, timeout_s, log) from None
        except BaseException:
            _kill_group(proc)
            raise
    return subprocess.CompletedProcess(list(cmd), proc.returncode, out, err)
