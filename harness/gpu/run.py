"""The GPU side of one run: where each server goes, free memory before a phase, release after it.

Glue between the pure planner (``gpu_plan``) and NVML (``nvml``), with NVML injectable so that it
is tested here with a fake module. The pipeline asks it for each server's placement and calls
``before(phase)`` / ``after(phase, pids)`` around the baseline and the P/D phase.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping

from harness.core.errors import ConfigError
from harness.gpu.plan import GpuPlan, PlanError, ServerPlacement, UtilizationError, model_memory, plan_gpus
from harness.gpu.nvml import GpuCheckFailed, check_free, discover, wait_released

RELEASE_TIMEOUT_S = 120.0  # a driver takes a few seconds to hand memory back after the processes exit


class GpuRun:
    """``gpu_memory_utilization``: the run's value given by hand (--gpu-memory-utilization, GPU_MEMORY_UTILIZATION),
    every server's share; the plan refuses one that does not fit its shared GPUs (see plan.py), and the free-memory
    check then checks what the servers are given. ``env``: where CUDA_VISIBLE_DEVICES is read (default os.environ)."""

    def __init__(self, tp_p: int, tp_d: int, model: str, nvml=None, release_timeout_s: float = RELEASE_TIMEOUT_S,
                 sleep=time.sleep, gpu_memory_utilization: float | None = None, env: Mapping[str, str] | None = None):
        self.nvml = nvml
        self.env = env
        self.release_timeout_s = release_timeout_s
        self.sleep = sleep
        d = discover(nvml, env)
        if not d.available:
            raise ConfigError(f"--device gpu, but the GPUs cannot be read: {d.reason}")
        if not d.gpus:
            seen = f" visible ({d.describe()})" if d.visible is not None else ""
            raise ConfigError(f"--device gpu, but NVML lists no GPU{seen}")
        util = gpu_memory_utilization
        try:
            self.plan: GpuPlan = plan_gpus(d.plan_gpus(), tp_p, tp_d, model_memory(model), util=util)
        except UtilizationError as e:
            raise ConfigError(f"gpu_memory_utilization {util:g} (--gpu-memory-utilization or GPU_MEMORY_UTILIZATION) "
                              f"does not fit P TP{tp_p} + D TP{tp_d} here: {e}") from None
        except PlanError as e:
            raise ConfigError(f"no GPU placement for P TP{tp_p} + D TP{tp_d}: {e}") from None
        self._free_before: dict[str, dict[int, float]] = {}

    def placement(self, role: str, index: int = 0) -> ServerPlacement:
        return self.plan.server(role, index)

    def _gpu_ids(self, phase: str) -> list[int]:
        return sorted({g for s in self.plan.phase(phase) for g in s.gpus})

    def before(self, phase: str) -> None:
        """Every GPU of ``phase`` has the memory its servers will claim (else GpuCheckFailed naming it)."""
        d = discover(self.nvml, self.env)
        if not d.available:
            raise GpuCheckFailed(f"cannot check free GPU memory: {d.reason}")
        check_free(self.plan, d.gpus, phase)
        self._free_before[phase] = {g.index: g.free_gib for g in d.gpus}

    def after(self, phase: str, pids: Iterable[int]) -> None:
        """Our processes have left the GPUs and the memory is back; otherwise this run fails, not the next one."""
        wait_released(pids, self._gpu_ids(phase), self.release_timeout_s, self._free_before.get(phase), nvml=self.nvml,
                      sleep=self.sleep, env=self.env)
