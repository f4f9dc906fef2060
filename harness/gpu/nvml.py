"""GPU discovery and pre-/post-run memory checks through NVML (nvidia-ml-py's ``pynvml``).

The NVML module is a parameter (default: the real ``pynvml``, or what the source installed in its place finds in the
environment, see source.py: the simulated box of harness/simbox), so every path is tested against a fake module.
Discovery lists the GPUs the caller may use: NVML's, restricted to and ordered by the caller's
CUDA_VISIBLE_DEVICES (visible.py). GPU indexes are NVML's (PCI bus order, absolute on the host); the GPU
plan sets CUDA_DEVICE_ORDER=PCI_BUS_ID so that a server's CUDA_VISIBLE_DEVICES means the same GPUs.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from harness.gpu.plan import GIB, Gpu, GpuPlan
from harness.gpu.source import source_for
from harness.gpu.visible import ORDER_ENV, VISIBLE_ENV, resolve_visible

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
    uuid: str = ""


@dataclass(frozen=True)
class Discovery:
    """The GPUs the caller may use, as NVML sees them; ``available`` is False (with a one-line reason) when
    NVML cannot be read or the caller's CUDA_VISIBLE_DEVICES names no GPU of the host, never an exception."""

    available: bool
    gpus: tuple[GpuInfo, ...] = ()  # the visible ones, in the caller's CUDA_VISIBLE_DEVICES order
    reason: str | None = None
    driver: str | None = None
    host_count: int = 0  # every GPU NVML lists on the host
    visible: str | None = None  # the caller's CUDA_VISIBLE_DEVICES (None: unset)
    simulated: str | None = None  # the value of the setting that put a source in NVML's place (a simulated box's)
    source: str | None = None  # that setting as NAME=VALUE, for describe()

    @property
    def count(self) -> int:
        return len(self.gpus)

    def by_index(self) -> dict[int, GpuInfo]:
        return {g.index: g for g in self.gpus}

    def plan_gpus(self) -> tuple[Gpu, ...]:
        """The planner's view: physical NVML ids, total memory and model name."""
        return tuple(Gpu(g.index, g.total_gib, g.name) for g in self.gpus)

    def describe(self) -> str:
        """One line: what was read and how."""
        sim = f" [simulated: {self.source}]" if self.source else ""
        if not self.available:
            return f"NVML cannot be read: {self.reason}{sim}"
        seen = f"{self.count} GPUs"
        if self.visible is not None:
            seen = f"{self.count} of {self.host_count} GPUs visible ({VISIBLE_ENV}={self.visible})"
        kinds = sorted({f"{g.name} {g.total_gib:.1f} GiB" for g in self.gpus})
        ids = ",".join(str(g.index) for g in self.gpus)
        return f"NVML: {seen}" + (f": ids {ids}, {'; '.join(kinds)}" if self.gpus else "") + sim


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
        try:
            uuid = _text(nvml.nvmlDeviceGetUUID(h))
        except (nvml.NVMLError, AttributeError):
            uuid = ""  # only needed to resolve UUIDs in CUDA_VISIBLE_DEVICES
        out.append(GpuInfo(i, _text(nvml.nvmlDeviceGetName(h)), mem.total / GIB, mem.free / GIB, pids, uuid))
    return tuple(out)


def read_host(nvml) -> tuple[tuple[GpuInfo, ...], str | None] | str:
    """Every GPU of the host and the driver version, or why NVML cannot be read."""
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as e:
        return f"no NVIDIA driver: {e}"
    try:
        try:
            driver = _text(nvml.nvmlSystemGetDriverVersion())
        except nvml.NVMLError:
            driver = None
        return _read(nvml), driver
    except nvml.NVMLError as e:
        return f"NVML query failed: {e}"
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def discover(nvml=None, env: Mapping[str, str] | None = None) -> Discovery:
    """The GPUs the caller may use (``env``'s CUDA_VISIBLE_DEVICES; default os.environ) with memory and compute
    PIDs. No driver, no pynvml or a CUDA_VISIBLE_DEVICES naming no GPU gives an unavailable result with the reason.
    ``nvml``: a stand-in module; without one the installed source (source.py) may put one in the real NVML's place
    (the simulated box, when PD_HARNESS_SIMULATED_GPUS is set)."""
    env = os.environ if env is None else env
    raw, sim, tag = env.get(VISIBLE_ENV), None, None
    if nvml is None:
        src = source_for(env)
        if src is not None:
            sim, tag = src.value, src.setting
            if src.nvml is None:
                return Discovery(False, reason=src.problem, simulated=sim, source=tag)
            nvml = src.nvml
            raw = src.visible if src.visible is not None else raw
        else:
            try:
                nvml = _real_nvml()
            except ImportError:
                return Discovery(False, reason="nvidia-ml-py (pynvml) is not installed")
    host = read_host(nvml)
    if isinstance(host, str):
        return Discovery(False, reason=host, visible=raw, simulated=sim, source=tag)
    gpus, driver = host
    v = resolve_visible(raw, [g.uuid for g in gpus], [g.name for g in gpus], env.get(ORDER_ENV))
    if v.problem:
        return Discovery(
            False, reason=v.problem, driver=driver, host_count=len(gpus), visible=raw, simulated=sim, source=tag
        )
    by_index = {g.index: g for g in gpus}
    return Discovery(
        True,
        tuple(by_index[i] for i in v.indices),
        driver=driver,
        host_count=len(gpus),
        visible=raw,
        simulated=sim,
        source=tag,
    )


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
            problems.append(
                f"GPU {gid} ({g.name}) has {g.free_gib:.1f} GiB free of {g.total_gib:.1f}, "
                f"the plan needs {need:.1f}{held}"
            )
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
        parts += [
            f"GPU {g}: {free:.1f} GiB free, expected {want:.1f}" for g, (free, want) in sorted(self.short.items())
        ]
        return "; ".join(parts)


def still_held(
    gpus: Sequence[GpuInfo],
    pids: Iterable[int],
    gpu_ids: Iterable[int],
    free_before: Mapping[int, float] | None,
    tolerance_gib: float = RELEASE_TOLERANCE_GIB,
) -> Held:
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


def wait_released(
    pids: Iterable[int],
    gpu_ids: Iterable[int],
    timeout_s: float,
    free_before: Mapping[int, float] | None = None,
    nvml=None,
    poll_s: float = 1.0,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    env: Mapping[str, str] | None = None,
) -> None:
    """After teardown: wait until none of ``pids`` is on ``gpu_ids`` and each GPU's free memory is back to
    ``free_before`` (GiB, as recorded before launch); GpuCheckFailed naming what is still held after ``timeout_s``."""
    pids, gpu_ids = list(pids), list(gpu_ids)
    deadline = clock() + timeout_s
    while True:
        d = discover(nvml, env)
        if not d.available:
            raise GpuCheckFailed(f"cannot check GPU release: {d.reason}")
        held = still_held(d.gpus, pids, gpu_ids, free_before)
        if not held:
            return
        if clock() >= deadline:
            raise GpuCheckFailed(f"GPUs not released after {timeout_s:g} s: {held.describe()}")
        sleep(poll_s)
