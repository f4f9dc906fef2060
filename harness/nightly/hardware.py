"""The GPUs the night plans and runs on (NVML's, a flag's, or a dry run's assumption) and the memory share given by
hand (GPU_MEMORY_UTILIZATION)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from harness.core.errors import ConfigError
from harness.gpu.nvml import Discovery
from harness.gpu.plan import Gpu, uniform_gpus
from harness.run.config import env_defaults

# What a dry run assumes when NVML cannot be read (a real run then refuses): the nightly runner's box.
DEFAULT_GPUS = 8
DEFAULT_GPU_MEM_GIB = 80.0
UTIL_ENV = "GPU_MEMORY_UTILIZATION"  # upstream's name; the steps' e2e runs read it too (harness/run/config.py)


@dataclass(frozen=True)
class Hardware:
    """The GPUs the night plans and runs on, and where that inventory came from."""

    gpus: tuple[Gpu, ...]
    source: str  # one line
    assumed: bool = False  # not (all) read from NVML: a dry run's assumption or a flag's
    simulated: str | None = None  # read from a simulated box (PD_HARNESS_SIMULATED_GPUS's value)
    driver: str | None = None  # NVML's driver version (None: not read): part of the box's calibration key


def choose_hardware(d: Discovery, count: int | None, mem_gib: float | None, dry_run: bool) -> Hardware:
    """The night's GPUs: NVML's (the caller's CUDA_VISIBLE_DEVICES applied), the first ``count`` of them when given.
    A dry run may plan for a box it is not on (flags, else 8 x 80 GiB where NVML cannot be read); a real run
    refuses (ConfigError, one line) GPUs it cannot read, too few GPUs, or a memory size NVML does not report."""
    if not d.available or not d.gpus:
        why = d.describe() if not d.available else f"{d.describe()}: no GPU to run on"
        if not dry_run:
            raise ConfigError(f"the nightly run cannot use the GPUs: {why}; --dry-run prints the plan anywhere")
        n, mem = count or DEFAULT_GPUS, mem_gib or DEFAULT_GPU_MEM_GIB
        given = "--gpus/--gpu-mem-gib" if count or mem_gib else "default"
        return Hardware(uniform_gpus(n, mem), f"{n} x {mem:g} GiB assumed ({given}); {why}", assumed=True)
    seen, sim = d.plan_gpus(), d.simulated
    if count is not None and count > len(seen):
        if not dry_run:
            raise ConfigError(
                f"the nightly run needs {count} GPUs, {len(seen)} present ({d.describe()}); "
                "--dry-run prints the plan anywhere"
            )
        mem = mem_gib or min(g.total_gib for g in seen)
        return Hardware(
            uniform_gpus(count, mem),
            f"{count} x {mem:g} GiB assumed (--gpus {count}); {d.describe()}",
            assumed=True,
            simulated=sim,
            driver=d.driver,
        )
    if mem_gib is not None and not dry_run:
        # The steps' own runs plan with NVML's memory; a night planned otherwise would check the wrong shares.
        raise ConfigError(
            "--gpu-mem-gib only plans a dry run: a real run takes each GPU's memory from NVML, as its steps do"
        )
    chosen = seen[:count] if count else seen
    how = d.describe() + (f"; the first {count} by --gpus" if count and count < len(seen) else "")
    if mem_gib:
        return Hardware(
            tuple(replace(g, total_gib=mem_gib) for g in chosen),
            f"{how}; planned as {mem_gib:g} GiB each (--gpu-mem-gib)",
            assumed=True,
            simulated=sim,
            driver=d.driver,
        )
    return Hardware(chosen, how, simulated=sim, driver=d.driver)


def given_util(env: Mapping[str, str]) -> float | None:
    """GPU_MEMORY_UTILIZATION as an e2e run reads it (ConfigError naming the variable when it is not a share)."""
    return env_defaults({UTIL_ENV: env.get(UTIL_ENV, "")}).get("gpu_memory_utilization")  # type: ignore[return-value]
