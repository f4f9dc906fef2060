"""Running the night: each step as its own process group within its timeout, the GPUs checked before and after it,
the steps that cannot run skipped with the reason, JUnit rewritten after each; the worst case all that can take."""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from harness.core.paths import REPO_ROOT
from harness.nightly.junit import junit_xml
from harness.nightly.simulated import judge_simulated
from harness.nightly.step import Step, StepResult
from harness.nightly.steps import CALIBRATE_FALLBACK

STOP_GRACE_S = 120.0  # a step's harness tears its servers down on SIGTERM; then SIGKILL and a sweep
STEP_POLL_S = 0.25  # how often a running step is looked at (a step that ended waits this long, at most)
RELEASE_TIMEOUT_S = 180.0  # after a step, until its GPUs have their memory back
WORST_CASE_NOTE = "every step to run at its timeout, then its stop grace and, a GPU step, the GPU release wait"


def worst_case_s(steps: Sequence[Step]) -> float:
    """The longest a night of ``steps`` can take: every step that runs reaches its timeout and is stopped (its grace)
    and, a GPU step, waits for its GPUs' memory to come back. What a CI job's timeout must hold
    (ci/nightly-gpu.yml)."""
    return sum(
        s.timeout_s + STOP_GRACE_S + (RELEASE_TIMEOUT_S if s.gpu_plan is not None else 0.0)
        for s in steps
        if s.skip_reason is None
    )


def run_step(step: Step, log_path: Path) -> StepResult:
    """Run one step as its own process group; on timeout SIGTERM it (its harness tears down its servers), then
    SIGKILL."""
    from harness.serve.procs import ManagedProcess, ProcessSpec, tail

    t0 = time.monotonic()
    proc = ManagedProcess(
        ProcessSpec(
            name=step.id.replace("/", "-"),
            argv=step.argv,
            log_path=log_path,
            cwd=REPO_ROOT,
            env=dict(step.env),
            stop_grace_s=STOP_GRACE_S,
        )
    )
    with proc:
        while proc.returncode is None and time.monotonic() - t0 < step.timeout_s:
            time.sleep(STEP_POLL_S)
        rc = proc.returncode
    secs = time.monotonic() - t0
    if rc is None:
        return StepResult(step, "timeout", secs, f"no result within {step.timeout_s:g} s; stopped", str(log_path))
    if rc != 0:
        return StepResult(step, "failed", secs, f"exit code {rc}; last lines:\n{tail(log_path, 15)}", str(log_path), rc)
    return StepResult(step, "passed", secs, "", str(log_path), rc)


def _nothing_to_import(s: Step, results: list[StepResult]) -> str:
    """The history step imports the night's GQA-matrix runs (``matrix/<pair>``): where none ran (a box too small for
    every pair), there is no folder to import and the step is skipped, saying so."""
    ran = any(r.step.id.startswith("matrix/") and r.status in ("passed", "failed") for r in results)
    return "" if s.kind != "history" or ran else "no GQA-matrix step ran this night: no runs to import into the history"


def run_steps(
    steps: Sequence[Step],
    run_dir: Path,
    runner: Callable[[Step, Path], StepResult] = run_step,
    gpu_guard: Callable[[Step], Callable[[], str | None] | str] | None = None,
    out=sys.stdout,
    simulated: str | None = None,
) -> list[StepResult]:
    """Every step in order; JUnit XML rewritten after each, so an interrupted night keeps what ran.

    ``gpu_guard(step)`` checks the GPUs before a step (an error string fails the step unrun) and returns a
    callable that checks after it that they were released (an error string fails the step). ``simulated``: the
    simulated box the night runs on; each step's result is then judged by ``judge_simulated``.
    """
    results: list[StepResult] = []
    junit = run_dir / "junit.xml"
    judge = (lambda r: judge_simulated(r, simulated)) if simulated else (lambda r: r)
    for s in steps:
        missing = _missing(s, results) or _stopped(results) or _nothing_to_import(s, results)
        if s.skip_reason is not None or missing:
            results.append(StepResult(s, "skipped", 0.0, s.skip_reason or missing))
        else:
            print(f"nightly: {s.id} (timeout {s.timeout_s / 60:g} min)", file=out, flush=True)
            after = None
            if gpu_guard is not None and s.gpu_plan is not None:
                check = gpu_guard(s)
                if isinstance(check, str):
                    results.append(StepResult(s, "failed", 0.0, f"GPUs not ready: {check}"))
                    _write(junit, results, out, s, simulated)
                    continue
                after = check
            r = judge(runner(s, run_dir / "steps" / f"{s.id.replace('/', '-')}.log"))
            leak = after() if after else None
            if leak and r.status == "passed":
                r = StepResult(s, "failed", r.seconds, f"GPUs not released: {leak}", r.log)
            if s.kind == "calibrate" and r.status != "passed":  # no step needs it: say what the night does instead
                r = replace(r, message=f"{CALIBRATE_FALLBACK}; {r.message}")
            results.append(r)
            if s.kind == "doctor" and r.status != "passed":
                _show_log(r, out)
        _write(junit, results, out, s, simulated)
    return results


def _stopped(results: Sequence[StepResult]) -> str:
    """Why the night stops before a step: its doctor step found a problem ("" when it goes on)."""
    bad = [r for r in results if r.step.kind == "doctor" and r.status in ("failed", "timeout")]
    return f"the night stopped: step {bad[0].step.id} {bad[0].status} (its lines say what to do)" if bad else ""


def _show_log(r: StepResult, out) -> None:
    """The doctor's lines, as it printed them: the one screen that says why the night stopped."""
    try:
        text = Path(r.log).read_text() if r.log else r.message
    except OSError:
        text = r.message
    print(text.rstrip(), file=out, flush=True)


def _missing(step: Step, results: Sequence[StepResult]) -> str:
    """Why ``step`` cannot run for want of what an earlier step failed to fetch ("" when nothing is missing)."""
    failed = {r.step.id: r for r in results if r.status in ("failed", "timeout")}
    bad = [failed[n] for n in step.needs if n in failed]
    if not bad:
        return ""
    what = ", ".join(r.step.id.removeprefix("prefetch/") for r in bad)
    return f"{what} missing from the local Hugging Face cache: {', '.join(r.step.id for r in bad)} {bad[0].status}"


def _write(junit: Path, results: list[StepResult], out, s: Step, simulated: str | None = None) -> None:
    junit.parent.mkdir(parents=True, exist_ok=True)
    tmp = junit.with_suffix(".xml.tmp")
    tmp.write_text(junit_xml(results, simulated=simulated))
    tmp.replace(junit)
    r = results[-1]
    print(
        f"nightly: {s.id}: {r.status}" + (f" ({r.message.splitlines()[0]})" if r.message else ""), file=out, flush=True
    )


def nvml_guard(step: Step) -> Callable[[], str | None] | str:
    """Before a step: the plan's GPUs (physical NVML ids, within the caller's CUDA_VISIBLE_DEVICES) have the free
    memory its servers will be given. After: our memory came back."""
    from harness.gpu.nvml import GpuCheckFailed, check_free, discover, wait_released

    d = discover()
    if not d.available:
        return d.reason or "NVML unavailable"
    try:
        check_free(step.gpu_plan, d.gpus)  # type: ignore[arg-type]
    except GpuCheckFailed as e:
        return str(e)
    before = {g.index: g.free_gib for g in d.gpus}
    used = sorted({g for s in step.gpu_plan.servers for g in s.gpus})  # type: ignore[union-attr]

    def after() -> str | None:
        try:
            wait_released([], used, RELEASE_TIMEOUT_S, free_before=before)
        except GpuCheckFailed as e:
            return str(e)
        return None

    return after
