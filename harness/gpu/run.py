"""The GPU side of one run: where each server goes, free memory before a phase, release after it.

Glue between the pure planner (``gpu_plan``) and NVML (``nvml``), with NVML injectable so that it
is tested here with a fake module. The pipeline asks it for each server's placement and calls
``before(phase)`` / ``after(phase, pids)`` around the baseline and the P/D phase; each check that passed is
kept in ``checks`` for the report (one that fails raises GpuCheckFailed: the run fails as gpu-check-failed).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import replace

from harness.checks.check import Check
from harness.core.errors import ConfigError
from harness.gpu.nvml import RELEASE_TOLERANCE_GIB, GpuCheckFailed, check_free, discover, wait_released
from harness.gpu.plan import (
    GpuPlan,
    PlanError,
    ServerPlacement,
    UtilizationError,
    model_memory,
    plan_baseline,
    plan_gpus,
)

RELEASE_TIMEOUT_S = 120.0  # a driver takes a few seconds to hand memory back after the processes exit


class GpuRun:
    """``gpu_memory_utilization``: the run's value given by hand (--gpu-memory-utilization, GPU_MEMORY_UTILIZATION),
    every server's share; the plan refuses one that does not fit its shared GPUs (see plan.py), and the free-memory
    check then checks what the servers are given. ``env``: where CUDA_VISIBLE_DEVICES is read (default os.environ).
    ``baseline_only``: only the baseline runs on this host (attach mode), at D's TP, alone on its GPUs; a phase with
    no server here has nothing to check."""

    def __init__(
        self,
        tp_p: int,
        tp_d: int,
        model: str | None,
        nvml=None,
        release_timeout_s: float = RELEASE_TIMEOUT_S,
        sleep=time.sleep,
        gpu_memory_utilization: float | None = None,
        env: Mapping[str, str] | None = None,
        baseline_only: bool = False,
    ):
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
        what = f"the baseline at TP{tp_d}" if baseline_only else f"P TP{tp_p} + D TP{tp_d}"
        try:
            memory = model_memory(model)
            self.plan: GpuPlan = (
                plan_baseline(d.plan_gpus(), tp_d, memory, util=util)
                if baseline_only
                else plan_gpus(d.plan_gpus(), tp_p, tp_d, memory, util=util)
            )
        except UtilizationError as e:
            raise ConfigError(
                f"gpu_memory_utilization {util:g} (--gpu-memory-utilization or GPU_MEMORY_UTILIZATION) "
                f"does not fit {what} here: {e}"
            ) from None
        except PlanError as e:
            raise ConfigError(f"no GPU placement for {what}: {e}") from None
        self.simulated = d.simulated  # the PD_HARNESS_SIMULATED_GPUS value when the box is simulated
        self.driver = d.driver  # NVML's driver version (None: not read): part of a calibration's key
        self.plan = replace(self.plan, simulated=d.simulated)
        self._free_before: dict[str, dict[int, float]] = {}
        self.checks: list[Check] = []  # the NVML checks made so far, in order (all passed: a failure raises)

    def placement(self, role: str, index: int = 0) -> ServerPlacement:
        return self.plan.server(role, index)

    def _gpu_ids(self, phase: str) -> list[int]:
        return sorted({g for s in self.plan.phase(phase) for g in s.gpus})

    def before(self, phase: str) -> None:
        """Every GPU of ``phase`` has the memory its servers will claim (else GpuCheckFailed naming it)."""
        if not self.plan.phase(phase):
            return
        d = discover(self.nvml, self.env)
        if not d.available:
            raise GpuCheckFailed(f"cannot check free GPU memory: {d.reason}")
        check_free(self.plan, d.gpus, phase)
        self._free_before[phase] = {g.index: g.free_gib for g in d.gpus}
        need = self.plan.required_free_gib(phase)
        free = {g.index: g.free_gib for g in d.gpus}
        tight = min(need, key=lambda g: free[g] - need[g])  # the GPU with the least to spare
        detail = (
            f"NVML: GPUs {_ids(need)} have the free memory the {phase} phase's servers will take (least to "
            f"spare: GPU {tight}, {free[tight]:.1f} GiB free, {need[tight]:.1f} needed){self._sim()}"
        )
        data = {"free_gib": _gib(free, need), "need_gib": _gib(need, need)}
        self.checks.append(Check(f"gpu_free_before_{phase}", True, detail, data))

    def after(self, phase: str, pids: Iterable[int]) -> None:
        """Our processes have left the GPUs and the memory is back; otherwise this run fails, not the next one."""
        if not self.plan.phase(phase):
            return
        pids, gpu_ids, t0 = sorted(pids), self._gpu_ids(phase), time.monotonic()
        wait_released(
            pids,
            gpu_ids,
            self.release_timeout_s,
            self._free_before.get(phase),
            nvml=self.nvml,
            sleep=self.sleep,
            env=self.env,
        )
        self.checks.append(
            Check(
                f"gpu_released_after_{phase}",
                True,
                f"NVML: none of the {phase} phase's {len(pids)} "
                f"PIDs on GPUs {_ids(gpu_ids)} after teardown, free memory back to within "
                f"{RELEASE_TOLERANCE_GIB:g} GiB of before, after {time.monotonic() - t0:.1f} s"
                f"{self._sim()}",
                {"pids": pids},
            )
        )

    def _sim(self) -> str:
        return f" [simulated box {self.simulated}]" if self.simulated else ""


def _ids(gpus: Iterable[int]) -> str:
    return ",".join(map(str, gpus))


def _gib(values: Mapping[int, float], only: Iterable[int]) -> dict[str, float]:
    return {str(g): round(values[g], 2) for g in only}
