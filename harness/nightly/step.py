"""One step of the night (its command, timeout, checks, GPU plan, what it needs) and its result."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from harness.gpu.plan import GpuPlan


@dataclass(frozen=True)
class Step:
    id: str
    kind: str  # doctor / prefetch / calibrate / matrix / accuracy / history
    argv: tuple[str, ...]
    timeout_s: float
    checks: tuple[str, ...]
    gpus_needed: int = 0
    gpu_plan: GpuPlan | None = None
    servers: tuple[tuple[str, str], ...] = ()  # (name, shell command) as planned
    skip_reason: str | None = None
    note: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # added to the step's environment (its GPUs)
    version: str | None = None  # the vLLM version it runs (None: the pinned one)
    needs: tuple[str, ...] = ()  # ids of the prefetch steps it needs: one of them failed, it is skipped

    @property
    def run_dir(self) -> Path | None:
        """Where the step's harness writes its run (its --run-dir), None for a step without one."""
        return Path(self.argv[self.argv.index("--run-dir") + 1]) if "--run-dir" in self.argv else None


@dataclass(frozen=True)
class StepResult:
    step: Step
    status: str  # passed / failed / skipped / timeout
    seconds: float = 0.0
    message: str = ""
    log: str | None = None
    returncode: int | None = None  # the step's exit code (None: not run, or stopped at its timeout)
