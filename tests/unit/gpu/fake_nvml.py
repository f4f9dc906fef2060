"""A stand-in for the ``pynvml`` module: scripted GPU states, one per NVML session (nvmlInit).

The module itself lives in the harness (harness/simbox/box.py), where PD_HARNESS_SIMULATED_GPUS uses it
too; ``FakeNvml([state0, state1, ...])``: each state is a list of ``FakeGpu``; every nvmlInit moves to the
next state and the last one stays, so a test scripts what a poller sees over time.
"""

from __future__ import annotations

from typing import Any

from harness.simbox.box import GIB, FakeGpu, FakeNvml, NVMLError

__all__ = ["GIB", "FakeClock", "FakeGpu", "FakeNvml", "NVMLError", "gpus"]


def gpus(n: int, **kw: Any) -> list[FakeGpu]:
    def fields() -> dict[str, Any]:  # a list (pids) of each GPU's own
        return {k: (list(v) if isinstance(v, list) else v) for k, v in kw.items()}

    return [FakeGpu(**fields()) for _ in range(n)]


class FakeClock:
    """time.monotonic and time.sleep that only move when sleep is called."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps = 0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.sleeps += 1
        self.now += s
