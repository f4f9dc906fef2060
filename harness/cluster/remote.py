"""One server of a run on a Ray node: ``python -m harness.cluster.remote --ray ADDRESS --node-id ID [--env NAME ...]
-- ARGV...``, what ``Host.wrap`` makes of a server's command when its host is a Ray node (``hosts/placement.py``).

This launcher runs here, under the harness's process owner like any server (its log, its watchdog, its teardown by
process group). It connects to the cluster, places an actor on that node (``NodeAffinitySchedulingStrategy``, not
soft: the node or nothing), and the actor starts ARGV there through the same process owner (``serve/procs.py``: a
process group and a watchdog of its own on the node). The launcher streams the server's output into its own output,
so the harness reads the server's log here as if it ran here (fatal lines, UCX's tables, the report's logs), and
exits with the server's exit code. SIGTERM or SIGINT to the launcher stops the server on its node (SIGTERM, SIGKILL
after ``REMOTE_GRACE_S``) and says what, if anything, was left there. If the launcher dies without that, Ray ends
the actor with its owner and the node's watchdog stops the server's group.

The server gets the node's environment (as Ray's worker has it, without what Ray adds) and the variables named by
``--env``, with their values here: the harness's own settings of the server (its command's environment)."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import tempfile
import threading
from pathlib import Path
from typing import Any

from harness.core.argtypes import HarnessArgumentParser

REMOTE_GRACE_S = 8.0  # the server's SIGTERM -> SIGKILL on its node (vLLM stops in a few seconds)
START_TIMEOUT_S = 120.0  # placing the actor and starting the server (Ray may first start a worker on the node)
POLL_S = 0.25
CHUNK = 1 << 20


class NodeProcess:
    """The actor on the node: owns one server there and hands its output out by offset."""

    def __init__(self, repo: str):
        if repo not in sys.path:
            sys.path.insert(0, repo)
        self.proc: Any = None

    def start(self, name: str, argv: list[str], env: dict[str, str], cwd: str) -> dict[str, Any]:
        import ray

        from harness.cluster.node import start_in_node_env
        from harness.serve.procs import ManagedProcess, ProcessSpec

        log = Path(tempfile.mkdtemp(prefix="pdh-remote-")) / f"{name}.log"
        self.proc = ManagedProcess(
            ProcessSpec(name, tuple(argv), log, env=env, cwd=Path(cwd), stop_grace_s=REMOTE_GRACE_S)
        )
        start_in_node_env(self.proc)
        ctx = ray.get_runtime_context()
        return {"node_id": ctx.get_node_id(), "node_ip": ray.util.get_node_ip_address(), "pid": self.proc.pid,
                "log": str(log)}  # fmt: skip

    def poll(self, offset: int) -> tuple[bytes, int | None]:
        """The output from ``offset`` on (at most CHUNK bytes), and the exit code once it has ended and all is read."""
        rc = self.proc.returncode
        with open(self.proc.spec.log_path, "rb") as f:
            f.seek(offset)
            data = f.read(CHUNK)
        return data, (rc if len(data) < CHUNK else None)

    def stop(self) -> tuple[int | None, list[int]]:
        """Stop the server's group; (its exit code, PIDs of it still alive on the node afterwards)."""
        rc = self.proc.stop()
        return rc, self.proc.leftover_pids()


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = HarnessArgumentParser(prog="python -m harness.cluster.remote", description=__doc__.splitlines()[0])
    p.add_argument("--ray", required=True, help="the cluster's address (ray://HEAD[:PORT] or HEAD:PORT)")
    p.add_argument("--node-id", required=True, help="the Ray node to run on")
    p.add_argument("--env", action="append", default=[], metavar="NAME", help="a variable to take along")
    p.add_argument("--name", default=None, help="the server's name on the node (default: from its command)")
    p.add_argument("argv", nargs=argparse.REMAINDER, help="-- the command")
    a = p.parse_args(argv)
    if a.argv[:1] == ["--"]:
        a.argv = a.argv[1:]
    if not a.argv:
        p.error("give the command after --")
    return a


def _say(line: str) -> None:
    sys.stdout.buffer.write(f"# remote: {line}\n".encode())
    sys.stdout.flush()


def _stream(actor: Any, ray: Any, offset: int) -> tuple[int, int | None]:
    """Copy the server's new output here; (the new offset, its exit code once it ended and all was read)."""
    data, rc = ray.get(actor.poll.remote(offset), timeout=60)
    if data:
        sys.stdout.buffer.write(data)
        sys.stdout.flush()
    return offset + len(data), (rc if not data else None)


def run(a: argparse.Namespace, stop: threading.Event) -> int:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from harness.cluster.ray_tasks import connected
    from harness.cluster.tasks import parse_address
    from harness.core.paths import REPO_ROOT

    env = {n: os.environ[n] for n in a.env if n in os.environ}
    name = a.name or Path(a.argv[0]).name
    with connected(parse_address(a.ray)) as ray:
        # After ray.init, which installs its own SIGTERM handler (an exit that drops Ray Client's channel at once,
        # measured: the server was then stopped only by its owner's end, not by this launcher).
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lambda *_: stop.set())  # the loop below stops the server on its node, then exits
        if __name__ != "__main__":  # run as a script, cloudpickle ships __main__'s classes by value anyway
            # the node's worker imports nothing of the harness to unpickle the actor
            ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        strategy = NodeAffinitySchedulingStrategy(node_id=a.node_id, soft=False)
        actor = ray.remote(NodeProcess).options(num_cpus=0, max_restarts=0, scheduling_strategy=strategy)
        handle = actor.remote(str(REPO_ROOT))
        try:
            where = ray.get(handle.start.remote(name, list(a.argv), env, os.getcwd()), timeout=START_TIMEOUT_S)
            _say(f"started on Ray node {where['node_ip']} ({where['node_id'][:12]}) as PID {where['pid']}, "
                 f"its log there {where['log']}")  # fmt: skip
            offset, rc = 0, None
            while rc is None and not stop.is_set():
                offset, rc = _stream(handle, ray, offset)
                if rc is None:
                    stop.wait(POLL_S)
            if rc is None:
                rc, left = ray.get(handle.stop.remote(), timeout=REMOTE_GRACE_S + 30)
                while (new := _stream(handle, ray, offset)[0]) != offset:  # what it wrote as it stopped
                    offset = new
                _say(f"stopped on its node: exit code {rc}; left there: {', '.join(map(str, left)) or 'nothing'}")
            return exit_status(rc)
        finally:
            with contextlib.suppress(Exception):
                ray.kill(handle)


def exit_status(rc: int | None) -> int:
    """The server's exit code as this process's: a signal (negative in Popen) as 128 + its number, like a shell."""
    if rc is None:
        return 128 + signal.SIGTERM
    return 128 - rc if rc < 0 else rc


def main(argv: list[str] | None = None) -> int:
    a = parse_args(argv)
    stop = threading.Event()
    try:
        return run(a, stop)
    except Exception as e:  # one line in the server's log: what the harness then reports
        _say(f"failed: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}")
        return 3


if __name__ == "__main__":
    sys.exit(main())
