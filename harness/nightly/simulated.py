"""A night on a simulated GPU box (PD_HARNESS_SIMULATED_GPUS, docs/gpu.md): a step passes when its runs got through
with the stand-in servers, their data-path checks skipped, never passed."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from harness.nightly.step import Step, StepResult
from harness.simbox.box import SIMULATED_ENV

SIM_REASON = "simulated GPUs"


def judge_simulated(r: StepResult, box: str) -> StepResult:
    """A matrix or accuracy step on a simulated box passes when every run it made got through with the stand-ins: each
    run's report marked simulated, verdict pass (its data-path checks skipped). What vLLM would have done cannot be
    shown by stand-ins and is not judged: a matrix entry that expects vLLM to refuse the pair makes the matrix exit 1
    when the stand-ins serve it, which is accepted here. Timeouts and the other steps stay as they ran."""
    if r.status not in ("passed", "failed") or r.step.kind not in ("matrix", "accuracy"):
        return r
    runs = simulated_runs(r.step)
    bad = [f"{name}: {why}" for name, why in runs if why]
    rc_ok = r.returncode == 0 or (r.step.kind == "matrix" and r.returncode == 1)
    if not runs or bad or not rc_ok:
        why = "; ".join(bad) or ("no run report" if not runs else f"exit code {r.returncode}")
        return replace(r, status="failed", message=f"{SIM_REASON}: {why}\n{r.message}".strip())
    note = (
        f"{SIM_REASON} ({SIMULATED_ENV}={box}): {len(runs)} run(s) got through with stand-in servers; their "
        "data-path checks were skipped, not passed"
    )
    if r.returncode:
        note += "; the matrix's expected outcomes of vLLM were not judged (exit code 1: stand-ins cannot show them)"
    return replace(r, status="passed", message=note)


def simulated_runs(step: Step) -> list[tuple[str, str | None]]:
    """Each run a step made (its e2e run, or each pair its matrix ran) and what is wrong with it on a simulated box."""
    import json

    folder = step.run_dir
    if folder is None:
        return []
    if step.kind == "accuracy":
        return [(step.id, _simulated_problem(folder / "report.json"))]
    try:
        pairs = json.loads((folder / "report.json").read_text()).get("pairs") or []
    except (OSError, ValueError):
        return []
    return [(p["id"], _simulated_problem(Path(p["run_dir"]) / "report.json")) for p in pairs if p.get("run_dir")]


def _simulated_problem(report: Path) -> str | None:
    import json

    try:
        d = json.loads(report.read_text())
    except (OSError, ValueError):
        return f"no run report ({report})"
    if not d.get("simulated"):
        return f"{report} is not marked simulated"
    if d.get("verdict") != "pass":
        return f"verdict {d.get('verdict')}: {str(d.get('reason'))[:300]}"
    return None
