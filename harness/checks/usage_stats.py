"""Nothing leaves the machine: every process of the servers this run launched (API server, engine core, workers)
runs with vLLM's usage reporting off, read from the processes' own environment while they serve."""

from __future__ import annotations

from collections.abc import Mapping

from harness.checks.check import Check
from harness.core.notrack import NO_TRACK_ENV, missing_no_track

CHECK_NAME = "no_usage_reporting"


def check_no_usage_reporting(environs: Mapping[str, Mapping[str, str] | None]) -> Check:
    """``environs``: "<server> pid N" -> that process's environment (None: it could not be read from outside).

    Every server's launched process (its API server) must be read and carry the variables; its children (engine
    core, workers) inherit them, and where vLLM's process titles overwrote what /proc shows of theirs they are
    listed as unreadable, not as passed."""
    unread = sorted(name for name, env in environs.items() if env is None)
    lacking = {name: missing_no_track(env) for name, env in environs.items() if env is not None}
    lacking = {name: miss for name, miss in lacking.items() if miss}
    read = sorted(name for name, env in environs.items() if env is not None)
    servers = {name.split(" pid ")[0] for name in environs}
    unchecked = sorted(srv for srv in servers if not any(n.split(" pid ")[0] == srv for n in read))
    data = {"read": read, "unreadable": unread, "lacking": lacking, "variables": NO_TRACK_ENV}
    if lacking:
        worst = "; ".join(f"{name} lacks {', '.join(miss)}" for name, miss in sorted(lacking.items())[:4])
        return Check(
            CHECK_NAME, False, f"{len(lacking)} of {len(read)} server processes may report usage: {worst}", data
        )
    if not environs or unchecked:
        return Check(
            CHECK_NAME,
            False,
            "no process environment could be read for " + (", ".join(unchecked) if unchecked else "any server"),
            data,
        )
    return Check(
        CHECK_NAME,
        True,
        f"{len(read)} server processes read ({', '.join(read)}) run with "
        f"{', '.join(f'{k}={v}' for k, v in NO_TRACK_ENV.items())}"
        + (
            f"; {len(unread)} children inherit them but show no environment from outside "
            f"(vLLM's process titles overwrite it): {', '.join(unread)}"
            if unread
            else ""
        ),
        data,
    )
