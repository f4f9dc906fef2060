"""GPU discovery and pre-/post-run memory checks through NVML (nvidia-ml-py's ``pynvml``).

The NVML module is a parameter (default: the real ``pynvml``), so every path is tested against a
fake module. GPU indexes are NVML's (PCI bus order); the GPU plan sets CUDA_DEVICE_ORDER=PCI_BUS_ID
so CUDA_VISIBLE_DEVICES means the same GPUs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from harness.gpu.plan import GIB, GpuPlan

# Free memory may come back a little short of what it was (driver caches, another user's context).
RELEASE_TOLERANCE_GIB = 1.0


class GpuCheckFailed(RuntimeError):
    """A GPU lacks the free memory a plan needs, or is still held after teardown."""


@dataclass(frozen=True)
class GpuInfo:
    index: int
    name: str
    total_gib: float
    free_gib: float
    pids: tuple[int, ...] = ()  # compute processes on this GPU


@dataclass(frozen=True)
class Discovery:
    """What NVML sees; ``available`` is False (with a reason) when there is no driver, never an exception."""

    available: bool
    gpus: tuple[GpuInfo, ...] = ()
    reason: str | None = None
    driver: str | None = None

    @property
    def count(self) -> int:
        return len(self.gpus)

    def by_index(self) -> dict[int, GpuInfo]:
        return {g.index: g for g in self.gpus}


def _real_nvml():
    import pynvml

    return pynvml


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)  # older pynvml returns bytes


def _read(nvml) -> tuple[GpuInfo, ...]:
    out = []
    for i in range(nvml.nvmlDeviceGetCount()):
        h = nvml.nvmlDeviceGetHandleByIndex(i)
        mem = nvml.nvmlDeviceGetMemoryInfo(h)
        try:
            pids = tuple(sorted(p.pid for p in nvml.nvmlDeviceGetComputeRunningProcesses(h)))
        except nvml.NVMLError:
            pids = ()  # some drivers refuse this query in containers; memory still tells the story
        out.append(GpuInfo(i, _text(nvml.nvmlDeviceGetName(h)), mem.total / GIB, mem.free / GIB, pids))
    return tuple(out)


def discover(nvml=None) -> Discovery:
    """Every GPU with its memory and compute PIDs; no driver or no pynvml gives an unavailable result."""
    if nvml is None:
        try:
            nvml = _real_nvml()
        except ImportError:
            return Discovery(False, reason="nvidia-ml-py (pynvml) is not installed")
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return Discovery(False, reason=f"no NVIDIA driver: {e}")
    try:
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            driver = None
        return Discovery(True, _read(nvml), driver=driver)
    except nvml.NVMLError as e:
        return Discovery(False, reason=f"NVML query failed: {e}")
    finally:
        try:
            nvml.nvmlShutdown()
        except nvml.NVMLError:
            pass


def check_free(plan: GpuPlan, gpus: Sequence[GpuInfo], phase: str | None = None) -> None:
    """Before launch: every GPU of the plan is present and has the free memory its servers will claim."""
    present = {g.index: g for g in gpus}
    problems = []
    for gid, need in plan.required_free_gib(phase).items():
        g = present.get(gid)
        if g is None:
            problems.append(f"GPU {gid} is not present (present: {sorted(present) or 'none'})")
        elif g.free_gib < need:
            held = f"; held by PIDs {', '.join(map(str, g.pids))}" if g.pids else ""
            problems.append(f"GPU {gid} ({g.name}) has {g.free_gib:.1f} GiB free of {g.total_gib:.1f}, the plan needs {need:.1f}{held}")
    if problems:
        raise GpuCheckFailed("; ".join(problems))


@dataclass
class Held:
    pids: dict[int, tuple[int, ...]] = field(default_factory=dict)  # GPU -> our PIDs still on it
    short: dict[int, tuple[float, float]] = field(default_factory=dict)  # GPU -> (free GiB, expected GiB)

    def __bool__(self) -> bool:
        return bool(self.pids or self.short)

    def describe(self) -> str:
        parts = [f"GPU {g}: PIDs {', '.join(map(str, p))} still running" for g, p in sorted(self.pids.items())]
        parts += [f"GPU {g}: {free:.1f} GiB free, expected {want:.1f}" for g, (free, want) in sorted(self.short.items())]
        return "; ".join(parts)


def still_held(gpus: Sequence[GpuInfo], pids: Iterable[int], gpu_ids: Iterable[int], free_before: Mapping[int, float] | None,
               tolerance_gib: float = RELEASE_TOLERANCE_GIB) -> Held:
    """Which of our PIDs are still on the given GPUs, and which GPUs have not got their free memory back."""
    ours = set(pids)
    by_index = {g.index: g for g in gpus}
    held = Held()
    for gid in gpu_ids:
        g = by_index.get(gid)
        if g is None:
            continue
        left = tuple(p for p in g.pids if p in ours)
        if left:
            held.pids[gid] = left
        if free_before is not None and gid in free_before and g.free_gib < free_before[gid] - tolerance_gib:
            held.short[gid] = (g.free_gib, free_before[gid])
    return held


def wait_released(pids: Iterable[int], gpu_ids: Iterable[int], timeout_s: float, free_before: Mapping[int, float] | None = None,
                  nvml=None, poll_s: float = 1.0, clock: Callable[[], float] = time.monotonic,
                  sleep: Callable[[float], None] = time.sleep) -> None:
    """After teardown: wait until none of ``pids`` is on ``gpu_ids`` and each GPU's free memory is back to
    ``free_before`` (GiB, as recorded before launch); GpuCheckFailed naming what is still held after ``timeout_s``."""
    pids, gpu_ids = list(pids), list(gpu_ids)
    deadline = clock() + timeout_s
    while True:
        d = discover(nvml)
        if not d.available:
            raise GpuCheckFailed(f"cannot check GPU release: {d.reason}")
        held = still_held(d.gpus, pids, gpu_ids, free_before)
        if not held:
            return
        if clock() >= deadline:
            raise GpuCheckFailed(f"GPUs not released after {timeout_s:g} s: {held.describe()}")
        sleep(poll_s)
