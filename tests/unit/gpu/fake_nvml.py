"""A stand-in for the ``pynvml`` module: scripted GPU states, one per NVML session (nvmlInit).

``FakeNvml([state0, state1, ...])``: each state is a list of ``FakeGpu``; every nvmlInit moves to the
next state and the last one stays, so a test scripts what a poller sees over time.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from types import SimpleNamespace

GIB = 2**30


class NVMLError(Exception):
    pass


@dataclass
class FakeGpu:
    total_gib: float = 80.0
    free_gib: float = 79.0
    pids: list[int] = field(default_factory=list)
    name: str = "NVIDIA H100 80GB HBM3"
    procs_error: bool = False  # nvmlDeviceGetComputeRunningProcesses raises (as in some containers)


class FakeNvml:
    NVMLError = NVMLError

    def __init__(self, states: list[list[FakeGpu]] | None = None, init_error: str | None = None, bytes_names: bool = False):
        self.states = states or [[]]
        self.init_error = init_error
        self.bytes_names = bytes_names
        self.sessions = 0  # nvmlInit calls that succeeded
        self.open = 0  # sessions not yet shut down

    @property
    def _gpus(self) -> list[FakeGpu]:
        return self.states[min(self.sessions, len(self.states)) - 1]

    def _need_init(self) -> None:
        if self.open < 1:
            raise NVMLError("Uninitialized")

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(self.init_error)
        self.sessions += 1
        self.open += 1

    def nvmlShutdown(self) -> None:
        self._need_init()
        self.open -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._need_init()
        return "580.65.06"

    def nvmlDeviceGetCount(self) -> int:
        self._need_init()
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        self._need_init()
        return self._gpus[i]

    def nvmlDeviceGetName(self, h: FakeGpu):
        return h.name.encode() if self.bytes_names else h.name

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu):
        total, free = int(h.total_gib * GIB), int(h.free_gib * GIB)
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu):
        if h.procs_error:
            raise NVMLError("Not Supported")
        return [SimpleNamespace(pid=p, usedGpuMemory=GIB) for p in h.pids]


def gpus(n: int, **kw) -> list[FakeGpu]:
    return [FakeGpu(**{k: (list(v) if isinstance(v, list) else v) for k, v in kw.items()}) for _ in range(n)]


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
