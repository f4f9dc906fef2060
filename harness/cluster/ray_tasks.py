"""The driver's side of Ray: connect to a cluster, list its nodes, run task specs (``tasks.py``) as Ray tasks with
their resource needs, hand each finished one back as it ends, and cancel every task still out when the driver is
interrupted or fails (``ray.cancel``, then ``ray.cancel(force=True)`` for what still runs: ``node.py``).

Nothing leaves the machine: Ray's usage reporting is off in this process before Ray is imported
(``RAY_USAGE_STATS_ENABLED=0``, ``core/notrack.py``); the nodes are started with it too (docs/multi-host.md#ray)."""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from types import ModuleType
from typing import Any

from harness.cluster import node as node_task
from harness.cluster.tasks import ENTRY_STOP_GRACE_S, Node, RayAddress, TaskSpec, nodes_from
from harness.core.notrack import NO_TRACK_ENV

# Ray Client's proxy on the head forks a server per driver, which now and then dies in the fork (Ray issue #63202,
# open in 2.60: "Starting Ray client server failed", 3 of about 17 first connections here); a new connection
# gets a new server. Each failed attempt takes Ray Client 40-60 s to give up.
CLIENT_ATTEMPTS = 3
# What Ray Client says when that server died before (or just after) the proxy saw it start; the last: the proxy
# found it already dead (psutil.ZombieProcess in proxier.py start_specific_server, measured here).
CLIENT_SERVER_DIED = ("Starting Ray client server failed", "Proxy failed to Connect to backend", "ZombieProcess")
CONNECT_PROBE_S = 5.0  # a TCP connection to the address first: an unreachable cluster is said in seconds
# After ray.cancel: how long the driver waits for its tasks to end (an entry's harness tears its servers down within
# its stop grace), before it cancels the rest by force and waits for those.
CANCEL_GRACE_S = ENTRY_STOP_GRACE_S + 15.0
FORCED_WAIT_S = 30.0


class ClusterError(RuntimeError):
    """The cluster cannot be used: Ray is missing, the address does not answer, Ray refused the connection."""


def import_ray() -> ModuleType:
    """Ray, with its usage reporting off in this process; ClusterError when it is not installed."""
    os.environ.update(NO_TRACK_ENV)
    try:
        import ray
    except ImportError as e:
        raise ClusterError(
            f"--ray needs Ray in this environment ({e}); install requirements/harness.txt (ray[client])"
        ) from None
    return ray


def probe(address: RayAddress, timeout_s: float = CONNECT_PROBE_S) -> str | None:
    """None when something accepts a TCP connection at the address; else why not."""
    try:
        with socket.create_connection((address.host, address.port), timeout=timeout_s):
            return None
    except ConnectionRefusedError:
        return "connection refused (is the Ray head running, and is this its port?)"
    except TimeoutError:
        return f"no answer within {timeout_s:g} s"
    except OSError as e:
        return e.strerror or str(e)


@contextmanager
def connected(address: RayAddress) -> Iterator[ModuleType]:
    """``ray`` connected to the cluster at ``address`` for the block; disconnected after it, whatever happens."""
    ray = import_ray()
    why = probe(address)
    if why is not None:
        raise ClusterError(f"cannot reach the Ray cluster at {address.url}: {why}")
    for attempt in range(1, CLIENT_ATTEMPTS + 1):
        try:
            ray.init(address=address.url, logging_level="ERROR", log_to_driver=False)
            break
        except Exception as e:
            if address.client and any(m in str(e) for m in CLIENT_SERVER_DIED) and attempt < CLIENT_ATTEMPTS:
                print(
                    f"ray: the head's Ray Client server for this driver died as it started (Ray issue #63202); "
                    f"connecting again ({attempt + 1}/{CLIENT_ATTEMPTS})",
                    file=sys.stderr,
                    flush=True,
                )
                continue
            hint = (
                "" if address.client else " (from a machine that is not a node of the cluster, give ray://HEAD:10001)"
            )
            raise ClusterError(f"cannot connect to the Ray cluster at {address.url}: {e}{hint}") from None
    try:
        # Ship the node task's code with each task: a node's worker imports nothing of the harness to unpickle it.
        ray.cloudpickle.register_pickle_by_value(node_task)
        yield ray
    finally:
        ray.shutdown()


def live_nodes(ray: ModuleType) -> list[Node]:
    return nodes_from(ray.nodes())


# (spec, what the node task returned or None, why the task failed in Ray or None)
Finished = tuple[TaskSpec, dict | None, str | None]


def run_tasks(
    ray: ModuleType, specs: Sequence[TaskSpec], on_done: Callable[[TaskSpec, dict | None, str | None], None]
) -> list[Finished]:
    """Submit every spec as a task (its CPUs and GPUs; never retried: an entry's run is not repeated behind the
    matrix's back) and call ``on_done`` as each ends, in the order they end. An exception or interrupt here (the
    driver's Ctrl-C or SIGTERM) cancels every task still out, waits for them to end, and goes on up."""
    remote = ray.remote(node_task.run_entry)
    refs: dict[Any, TaskSpec] = {}
    finished: list[Finished] = []
    try:
        for spec in specs:
            opts = {"num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, "max_retries": 0, "name": spec.name}
            refs[remote.options(**opts).remote(spec.payload())] = spec
        pending = list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in ready:
                spec = refs[ref]
                try:
                    ran, error = ray.get(ref), None
                except Exception as e:  # the task failed in Ray (its worker or node died, ...): the entry says so
                    ran, error = None, f"{type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                finished.append((spec, ran, error))
                on_done(spec, ran, error)
    except BaseException:
        cancel(ray, [r for r in refs if not any(f[0] is refs[r] for f in finished)])
        raise
    return finished


def cancel(ray: ModuleType, refs: Sequence[Any], grace_s: float = CANCEL_GRACE_S) -> None:
    """Cancel tasks and wait, bounded, until Ray reports them ended. First in Python (a KeyboardInterrupt in the
    task: it stops its entry's process group, whose harness tears its servers down), then, for what is still
    running after ``grace_s``, by force (Ray kills the worker and its child processes: ``node.py``)."""
    for force, wait_s in ((False, grace_s), (True, FORCED_WAIT_S)):
        for ref in refs:
            # already done, or the connection is gone: nothing more to cancel from here
            with contextlib.suppress(Exception):
                ray.cancel(ref, force=force)
        refs = _still_running(ray, refs, wait_s)
        if not refs:
            return


def _still_running(ray: ModuleType, refs: Sequence[Any], wait_s: float) -> list[Any]:
    deadline = time.monotonic() + wait_s
    pending = list(refs)
    while pending and time.monotonic() < deadline:
        try:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=1.0)
        except Exception:
            return []
    return pending
