"""Readiness-detection delay and teardown time of the process owner (harness/serve/procs.py).

``python -m harness bench lifecycle`` repeats, a few times:

- readiness: a bench backend started with ``--ready-after S`` writes the
  wall-clock moment its /health turned 200; ``ManagedProcess.wait_ready``
  (poll 0.1 s) returns some time later. The delay between the two is what the
  harness adds to every launch->ready (target <= 0.5 s).
- teardown: two backends and the harness's proxy, all ready, stopped the way a
  run stops them (an ExitStack of ManagedProcess, SIGTERM to each group);
  the time until all three are gone (target < 5 s).
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.bench.proxy import backend_proc, toy_proc
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all

TARGET_READY_DELAY_S = 0.5
TARGET_TEARDOWN_S = 5.0


@dataclass(frozen=True)
class LifecycleRound:
    ready_delay_s: float  # backend's own ready moment -> wait_ready returned
    launch_to_ready_s: float  # as the harness reports it (includes --ready-after)
    teardown_s: float  # three processes, SIGTERM -> all gone
    leftovers: int  # processes still alive after stop (should be 0)


@dataclass(frozen=True)
class Spread:
    median: float
    max: float

    @classmethod
    def of(cls, xs: list[float]) -> Spread:
        return cls(statistics.median(xs), max(xs))


def readiness_round(alloc: PortAllocator, logs: Path, ready_after_s: float, i: int) -> tuple[float, float]:
    ready_file = logs / f"ready-{i}.txt"
    proc, _ = backend_proc(alloc, logs, f"ready_backend_{i}", ready_after_s, ready_file)
    with proc:
        launch_to_ready = proc.wait_ready()
        noticed = time.time()
        ready_at = float(ready_file.read_text())
    return noticed - ready_at, launch_to_ready


def teardown_round(alloc: PortAllocator, logs: Path, i: int) -> tuple[float, int]:
    stack = contextlib.ExitStack()
    with stack:
        b1, u1 = backend_proc(alloc, logs, f"td_backend_p_{i}")
        b2, u2 = backend_proc(alloc, logs, f"td_backend_d_{i}")
        start_all([b1, b2], stack, 60)
        proxy, _ = toy_proc(alloc, logs, [u1], [u2])
        start_all([proxy], stack, 60)
        t0 = time.monotonic()
        stack.close()  # the same unwinding a run does at the end of its `with` block
        teardown = time.monotonic() - t0
    return teardown, sum(len(p.leftover_pids()) for p in (b1, b2, proxy))


def run_lifecycle_bench(repeats: int = 3, ready_after_s: float = 3.0, log_dir: Path | None = None) -> dict:
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="bench-lifecycle-"))
    logs.mkdir(parents=True, exist_ok=True)
    rounds = []
    with PortAllocator() as alloc:
        for i in range(repeats):
            delay, l2r = readiness_round(alloc, logs, ready_after_s, i)
            td, left = teardown_round(alloc, logs, i)
            rounds.append(LifecycleRound(delay, l2r, td, left))
    ready, teardown = Spread.of([r.ready_delay_s for r in rounds]), Spread.of([r.teardown_s for r in rounds])
    return {
        "config": {"repeats": repeats, "ready_after_s": ready_after_s, "poll_s": 0.1, "logs": str(logs)},
        "rounds": [asdict(r) for r in rounds],
        "ready_delay_s": asdict(ready),
        "teardown_s": asdict(teardown),
        "targets": [
            {
                "name": "ready_delay_max_s",
                "target": f"<= {TARGET_READY_DELAY_S:g} s",
                "value": ready.max,
                "met": ready.max <= TARGET_READY_DELAY_S,
            },
            {
                "name": "teardown_max_s",
                "target": f"< {TARGET_TEARDOWN_S:g} s",
                "value": teardown.max,
                "met": teardown.max < TARGET_TEARDOWN_S,
            },
        ],
        "leftover_processes": sum(r.leftovers for r in rounds),
    }


def render(d: dict) -> str:
    lines = [
        f"lifecycle benchmark: {d['config']['repeats']} rounds, backend ready after {d['config']['ready_after_s']:g} s"
    ]
    for i, r in enumerate(d["rounds"]):
        lines.append(
            f"  round {i}: ready noticed {1000 * r['ready_delay_s']:.0f} ms after the backend's ready moment "
            f"(launch->ready {r['launch_to_ready_s']:.2f} s); teardown of 3 processes {r['teardown_s']:.2f} s; "
            f"leftovers {r['leftovers']}"
        )
    lines.append(
        f"ready delay: median {1000 * d['ready_delay_s']['median']:.0f} ms, "
        f"max {1000 * d['ready_delay_s']['max']:.0f} ms"
    )
    lines.append(f"teardown:    median {d['teardown_s']['median']:.2f} s, max {d['teardown_s']['max']:.2f} s")
    for t in d["targets"]:
        lines.append(
            f"target {t['name']}: {t['target']}; measured {t['value']:.3f} -> {'MET' if t['met'] else 'MISSED'}"
        )
    return "\n".join(lines)
