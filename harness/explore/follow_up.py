"""What explore does once for each new signature: the control without P/D, ``shrink`` to the smallest configuration
still failing, and a repro bundle with its ISSUE.md draft.

The steps come behind one interface, ``FollowUp`` (a dataclass of callables: tests give fakes, ``real_follow_up`` the
harness's own control, shrink and bundle). Each step's result is recorded as soon as it ends (``StepResult``: done,
skipped with the reason, or failed with its one-line error), so a killed explore keeps the steps it finished and
``--resume`` runs only those it has not. A step that fails never stops explore. A control that fails as the run did
marks the finding "needs no P/D": it is no P/D finding, and neither shrunk nor bundled.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import ConfigError
from harness.core.safe import comment, load_json_object
from harness.explore.no_pd_control import ControlResult, run_no_pd_control
from harness.repro.bundle import write_bundle
from harness.shrink.cli import search_and_write, start_of

STEPS = ("control", "shrink", "bundle", "issue")
DONE, SKIPPED, FAILED = "done", "skipped", "failed"
NO_FOLLOW_UP = "--no-follow-up given"
NEEDS_NO_PD = "needs no P/D"
NEEDS_PD = "needs P/D"
CONTROL_HEADING = "## Control without P/D (the harness's)"


@dataclass(frozen=True)
class Smallest:
    """What a shrink found: the smallest configuration still failing as the run did."""

    config: str  # in words
    folder: str  # the shrink's folder (shrink.json, shrink.md, its probe runs)
    run_dir: str | None = None  # the probe run of that configuration (None: the sample's own run was the smallest)
    cut: str | None = None  # why the search stopped before deciding every axis


@dataclass(frozen=True)
class FollowUp:
    """The follow-up steps, each given the sample's run folder (the control also its outcome)."""

    control: Callable[[Path], ControlResult]
    shrink: Callable[[Path], Smallest]
    bundle: Callable[[Path], Path]  # the bundle's folder; its ISSUE.md is the draft


@dataclass
class StepResult:
    status: str  # done | skipped | failed
    why: str = ""  # skipped: the reason; failed: the error, one line
    outcome: str | None = None  # control: ok or the class it showed; shrink: the smallest configuration in words
    path: str | None = None  # control: its folder; shrink: its folder; bundle: its folder; issue: ISSUE.md
    run_dir: str | None = None  # shrink: the smallest failing run's folder


@dataclass
class FindingFollowUp:
    """The follow-ups of one new signature, from the first sample that showed it."""

    signature: str
    sample: str
    outcome: str  # the sample's outcome (what the control is compared with)
    run_dir: str | None
    steps: dict[str, StepResult] = field(default_factory=dict)

    @property
    def needs_pd(self) -> bool | None:
        """False: the control without P/D failed as the run did; True: it passed; None: not decided."""
        c = self.steps.get("control")
        if c is None or c.status != DONE:
            return None
        if c.outcome == "ok":
            return True
        return False if same_failure(c.outcome, self.outcome) else None

    def pd_words(self) -> str:
        c = self.steps.get("control")
        if self.needs_pd is None and c is not None and c.status == DONE:
            return f"undecided: the control without P/D failed otherwise ({c.outcome})"
        return {True: NEEDS_PD, False: NEEDS_NO_PD, None: "undecided: no control"}[self.needs_pd]

    def pending(self, follow_up_on: bool) -> list[str]:
        """The steps to run now: those not recorded, and with follow-ups on, those skipped for --no-follow-up."""

        def left_out(s: StepResult) -> bool:
            return follow_up_on and s.status == SKIPPED and s.why == NO_FOLLOW_UP

        return [s for s in STEPS if s not in self.steps or left_out(self.steps[s])]

    @classmethod
    def from_dict(cls, d: dict) -> FindingFollowUp:
        steps = {k: StepResult(**v) for k, v in (d.get("steps") or {}).items()}
        return cls(d["signature"], d["sample"], d["outcome"], d.get("run_dir"), steps)


def same_failure(control: str | None, run: str) -> bool:
    """Whether the control failed as the run did: the same class, or both a server that died while serving (the
    control's server is named otherwise than the run's)."""
    return control == run or bool(control and control.endswith("-died") and run.endswith("-died"))


def run_follow_ups(rec: FindingFollowUp, fu: FollowUp | None, save: Callable[[], None]) -> None:
    """Each pending step of ``rec`` in order, recorded and saved as it ends; ``fu`` None: skipped (--no-follow-up).
    Only an interrupt stops it (the step in flight is then not recorded: --resume runs it)."""
    for step in rec.pending(fu is not None):
        rec.steps[step] = _step(step, rec, fu)
        save()


def _step(step: str, rec: FindingFollowUp, fu: FollowUp | None) -> StepResult:
    if fu is None:
        return StepResult(SKIPPED, NO_FOLLOW_UP)
    if rec.run_dir is None:
        return StepResult(SKIPPED, "the sample left no run folder")
    if step != "control" and rec.needs_pd is False:
        return StepResult(SKIPPED, "the control without P/D fails as the run did: not a P/D finding")
    run_dir = Path(rec.run_dir)
    try:
        if step == "control":
            c = fu.control(run_dir)
            return StepResult(DONE, comment(c.detail) if c.outcome != "ok" else "", c.outcome, c.run_dir)
        if step == "shrink":
            s = fu.shrink(run_dir)
            return StepResult(DONE, s.cut or "", s.config, s.folder, s.run_dir)
        if step == "bundle":
            return StepResult(DONE, path=str(fu.bundle(run_dir)))
        return _issue(rec)
    except KeyboardInterrupt:
        raise
    except ConfigError as e:
        return StepResult(FAILED, comment(e))
    except Exception as e:  # noqa: BLE001 - a follow-up that fails is recorded; explore goes on
        return StepResult(FAILED, f"{type(e).__name__}: {comment(e)}")


def _issue(rec: FindingFollowUp) -> StepResult:
    """The bundle's ISSUE.md, with what the control without P/D showed added at its end."""
    b = rec.steps.get("bundle")
    if b is None or b.status != DONE or not b.path:
        return StepResult(SKIPPED, f"no bundle ({b.why if b else 'not made'})")
    issue = Path(b.path) / "ISSUE.md"
    if not issue.is_file():
        return StepResult(FAILED, f"the bundle {b.path} holds no ISSUE.md")
    c = rec.steps.get("control")
    if c is not None and c.status == DONE and CONTROL_HEADING not in issue.read_text():  # once, if resumed
        with issue.open("a") as f:
            f.write("\n" + "\n".join(control_section(rec, c)) + "\n")
    return StepResult(DONE, path=str(issue))


def control_section(rec: FindingFollowUp, c: StepResult) -> list[str]:
    said = (
        "passes: the same model and prompts on one plain server with the run's settings match the baseline"
        if c.outcome == "ok"
        else f"fails with `{c.outcome}`" + (f" ({comment(c.why, 300)})" if c.why else "")
    )
    return [
        CONTROL_HEADING,
        "",
        f"`python -m harness explore` served the run's model and prompts on one plain vLLM server (no P/D) with the "
        f"run's settings that one server can carry, and compared it with the baseline as the run does: it {said}. "
        f"Verdict: {rec.pd_words()}. Its folder: `{c.path}`.",
    ]


def real_follow_up(shrink_probes: int = 8, shrink_minutes: float = 60.0) -> FollowUp:
    """The harness's own steps: the control of no_pd_control.py, shrink's search with real probe runs (in
    ``<run>/shrink``, where the bundle's ISSUE.md finds it), and the repro bundle (``<run>/repro``)."""
    return FollowUp(
        control=run_no_pd_control,
        shrink=lambda run_dir: shrink_run(run_dir, shrink_probes, shrink_minutes),
        bundle=lambda run_dir: write_bundle(run_dir),
    )


def shrink_run(run_dir: Path, max_probes: int, max_minutes: float) -> Smallest:
    """``python -m harness shrink RUN_DIR`` from Python: the search with real probes, shrink.json and shrink.md in
    ``<run_dir>/shrink``. ConfigError when the run cannot be shrunk."""
    begun = start_of(load_json_object(Path(run_dir) / "report.json", "report"))
    out = Path(run_dir) / "shrink"
    out.mkdir(parents=True, exist_ok=True)
    result = search_and_write(Path(run_dir), out, begun, max_probes, max_minutes)
    smallest = next(
        (p.run_dir for p in reversed(result.probes) if p.settings == result.minimal and p.outcome == begun[0]), None
    )
    return Smallest(result.minimal.describe(), str(out), smallest, result.cut)
