"""Where a run's wall time went: servers, requests, evaluation, teardown, and the harness's own share.

Pure: it reads the ``timings_s`` of a report.json (as harness/run/pipeline.py
records them) and never double counts. The phases nest: ``baseline_phase``
holds the baseline's launch->ready, its requests, ``lm_eval_baseline`` and its
(unrecorded) teardown; ``pd_phase`` holds P's and D's launch->ready (started
together, so they overlap: the longer one counts), the proxy's, the P/D
requests, ``lm_eval_pd`` and ``pd_teardown`` (on a colocated GPU run P and D start one
after the other, and then their launches add up). The harness's own time is the
wall time minus everything spent waiting on servers, requests, lm-eval and
teardown; a phase's remainder (its length minus its measured parts) is the
harness work inside that phase.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

TARGET_HARNESS_SHARE = 0.03

# (key in timings_s, category, phase it belongs to). Keys absent from a report are skipped.
MEASURED = (
    ("baseline_launch_to_ready", "launch_to_ready", "baseline_phase"),
    ("baseline_requests", "requests", "baseline_phase"),
    ("baseline_load", "requests", "baseline_phase"),
    ("lm_eval_baseline", "evaluation", "baseline_phase"),
    ("baseline_teardown", "teardown", "baseline_phase"),  # not recorded today; counted if a report has it
    ("proxy_launch_to_ready", "launch_to_ready", "pd_phase"),
    ("pd_requests", "requests", "pd_phase"),
    ("pd_load", "requests", "pd_phase"),
    ("pd_idle_wait", "requests", "pd_phase"),  # the leak check waits for P and D to go idle
    ("pd_fault_follow_up", "requests", "pd_phase"),  # after a --net-fault's failure: P's blocks followed to idle
    ("lm_eval_pd", "evaluation", "pd_phase"),
    ("pd_teardown", "teardown", "pd_phase"),
)
PHASES = ("baseline_phase", "pd_phase")


def pd_launch_keys(timings: dict[str, float]) -> list[str]:
    """P's and D's launch->ready keys ("prefill", "decode", or "prefill[0]"... with several servers per role)."""
    return [k for k in timings if k.endswith("_launch_to_ready") and k.startswith(("prefill", "decode"))]


@dataclass(frozen=True)
class TimingItem:
    name: str
    category: str  # launch_to_ready, requests, evaluation, teardown
    seconds: float
    counted_s: float  # what it adds to the external total (0 for the shorter of two overlapping launches)


@dataclass(frozen=True)
class PhaseRemainder:
    phase: str
    seconds: float
    measured_s: float

    @property
    def remainder_s(self) -> float:
        return self.seconds - self.measured_s


@dataclass
class TimingBreakdown:
    wall_s: float
    items: list[TimingItem] = field(default_factory=list)
    phases: list[PhaseRemainder] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def external_s(self) -> float:
        return sum(i.counted_s for i in self.items)

    @property
    def by_category(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for i in self.items:
            out[i.category] = out.get(i.category, 0.0) + i.counted_s
        return out

    @property
    def harness_own_s(self) -> float:
        return self.wall_s - self.external_s

    @property
    def harness_own_share(self) -> float:
        return self.harness_own_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def within_target(self) -> bool:
        return self.harness_own_share <= TARGET_HARNESS_SHARE

    def to_dict(self) -> dict:
        return {
            "wall_s": self.wall_s,
            "items": [asdict(i) for i in self.items],
            "by_category_s": self.by_category,
            "phases": [{**asdict(p), "remainder_s": p.remainder_s} for p in self.phases],
            "external_s": self.external_s,
            "harness_own_s": self.harness_own_s,
            "harness_own_share": self.harness_own_share,
            "target_share": TARGET_HARNESS_SHARE,
            "within_target": self.within_target,
            "notes": list(self.notes),
        }


def breakdown(timings: dict[str, float], staggered: bool = False) -> TimingBreakdown:
    """The breakdown of one report's ``timings_s``; raises ValueError without a wall time.

    ``staggered``: P and D were started one after another (colocated GPU runs, ``config.gpu_plan.stagger_start``),
    so their launches add up instead of overlapping."""
    if "wall" not in timings:
        raise ValueError("timings_s has no 'wall' entry (the run did not finish writing its report?)")
    b = TimingBreakdown(wall_s=float(timings["wall"]))
    in_phase: dict[str, float] = {p: 0.0 for p in PHASES}
    launches = sorted(((k, float(timings[k])) for k in pd_launch_keys(timings)), key=lambda x: -x[1])
    for i, (k, s) in enumerate(launches):
        # Started together, only the longest launch adds to the total (ties: the first one).
        counted = s if staggered or i == 0 else 0.0
        b.items.append(TimingItem(k.removesuffix("_launch_to_ready") + " launch->ready", "launch_to_ready", s, counted))
        in_phase["pd_phase"] += counted
    if len(launches) > 1 and not staggered:
        b.notes.append(f"the P/D servers start together: only the longest launch ({launches[0][1]:.1f} s) is counted")
    for key, category, phase in MEASURED:
        if key in timings:
            s = float(timings[key])
            label = key.replace("_launch_to_ready", " launch->ready").replace("_", " ")
            b.items.append(TimingItem(label, category, s, s))
            in_phase[phase] += s
    for phase in PHASES:
        if phase in timings:
            b.phases.append(PhaseRemainder(phase, float(timings[phase]), in_phase[phase]))
    if "baseline_cache_read" in timings:
        b.notes.append(
            "no baseline phase: its answers came from the disk cache "
            f"(read in {float(timings['baseline_cache_read']):.1f} s, "
            "counted as harness time)"
        )
    if "baseline_phase" in timings and "baseline_teardown" not in timings:
        b.notes.append(
            "the baseline's teardown is not recorded separately: it is inside the baseline phase's remainder, "
            "so it counts as harness time here"
        )
    if not any(p in timings for p in PHASES):
        b.notes.append("no phase timings: the run ended before its first phase finished")
    for p in b.phases:
        if p.remainder_s < 0:
            b.notes.append(
                f"{p.phase}: its parts add up to more than the phase ({p.measured_s:.1f} > {p.seconds:.1f} s)"
            )
    return b


def render(b: TimingBreakdown, source: str = "") -> str:
    lines = [f"timing breakdown{' of ' + source if source else ''}: wall {b.wall_s:.1f} s", ""]
    for i in b.items:
        extra = "" if i.counted_s == i.seconds else f"  (overlaps; counted {i.counted_s:.1f} s)"
        lines.append(f"  {i.category:<16} {i.name:<28} {i.seconds:>9.1f} s{extra}")
    for p in b.phases:
        lines.append(
            f"  {'phase':<16} {p.phase:<28} {p.seconds:>9.1f} s  (measured parts {p.measured_s:.1f} s, "
            f"remainder {p.remainder_s:.1f} s)"
        )
    lines.append("")
    for cat, s in b.by_category.items():
        lines.append(f"  {cat:<16} {s:>9.1f} s  {100 * s / b.wall_s if b.wall_s else 0:5.1f} %")
    status = "MET" if b.within_target else "MISSED"
    lines += [
        f"  {'harness own':<16} {b.harness_own_s:>9.1f} s  {100 * b.harness_own_share:5.1f} %  "
        f"(target <= {100 * TARGET_HARNESS_SHARE:g} %: {status})"
    ]
    lines += [f"note: {n}" for n in b.notes]
    return "\n".join(lines)
