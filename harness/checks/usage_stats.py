"""Nothing leaves the machine: every process of the servers this run launched (API server, engine core, workers)
runs with vLLM's usage reporting off, read from the processes' own environment while they serve."""

from __future__ import annotations

from collections.abc import Mapping

from harness.checks.check import Check
from harness.core.notrack import NO_TRACK_ENV, missing_no_track

CHECK_NAME = "no_usage_reporting"


def check_no_usage_reporting(environs: Mapping[str, Mapping[str, str] | None]) -> Check:
    """``environs``: "server pid N" -> that process's environment (None: it could not be read)."""
    unread = sorted(name for name, env in environs.items() if env is None)
    lacking = {name: missing_no_track(env) for name, env in environs.items() if env is not None}
    lacking = {name: miss for name, miss in lacking.items() if miss}
    read = len(environs) - len(unread)
    data = {"processes": sorted(environs), "unreadable": unread, "lacking": lacking, "variables": NO_TRACK_ENV}
    if lacking:
        worst = "; ".join(f"{name} lacks {', '.join(miss)}" for name, miss in sorted(lacking.items())[:4])
        return Check(CHECK_NAME, False, f"{len(lacking)} of {read} server processes may report usage: {worst}", data)
    if not read:
        return Check(CHECK_NAME, False, "no server process environment could be read"
                     + (f" ({', '.join(unread)})" if unread else ""), data)
    return Check(CHECK_NAME, True, f"{read} server processes (API servers, engine cores, workers) run with "
                 f"{', '.join(f'{k}={v}' for k, v in NO_TRACK_ENV.items())}"
                 + (f"; {len(unread)} exited before they could be read" if unread else ""), data)
