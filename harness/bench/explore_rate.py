"""Explore's throughput, from what an explore already recorded: ``python -m harness bench explore``.

It runs nothing. From the explore folder's ``explore.json`` it takes each sample's status and seconds (the explore's
own clock from handing the sample to the matrix runner to judging its run; planning is not timed); from each ran
sample's ``report.json`` it takes ``timings_s`` and splits that sample's seconds by category with
harness/run/timing.py. The harness share here is the sample's seconds minus everything spent waiting on servers,
requests, lm-eval and teardown, so it holds both the run's own harness time and the work around the run (the matrix
runner's, judging the outcome).

explore.json is read as JSON, not through harness/explore/results.py: bench sits below explore in the layers.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.core.paths import REPO_ROOT
from harness.run.timing import breakdown

CATEGORIES = ("launch_to_ready", "requests", "evaluation", "teardown", "harness")
LABELS = {
    "launch_to_ready": "server launch->ready",
    "requests": "requests",
    "evaluation": "evaluation (lm-eval)",
    "teardown": "teardown",
    "harness": "harness (in and around the run)",
}


class ExploreRateError(ValueError):
    """The folder is not an explore folder, or its explore.json cannot be read: one line for the user."""


@dataclass(frozen=True)
class MissingReport:
    """A ran sample whose report.json could not be used: its seconds count in the rate, not in the shares."""

    sample: str
    run_dir: str | None
    why: str


@dataclass(frozen=True)
class SampleTime:
    """One ran sample's seconds split by category, and what keeping the P/D servers would have saved of them."""

    sample: str
    seconds: float
    by_category: dict[str, float]
    kept_servers_saving_s: float  # P/D (and proxy) launch->ready plus the P/D teardown


@dataclass
class ExploreRate:
    explore_dir: str
    ran: int
    skipped: int
    ran_seconds: float
    skipped_seconds: float  # a skipped sample starts no server; the explore does not time its planning (0 today)
    cpus: int | None  # this machine's os.cpu_count()
    timed: list[SampleTime] = field(default_factory=list)
    missing: list[MissingReport] = field(default_factory=list)

    @property
    def per_hour(self) -> float | None:
        """Ran samples per hour of ran samples' time (skips are left out: they cost only planning)."""
        return 3600 * self.ran / self.ran_seconds if self.ran_seconds > 0 else None

    @property
    def per_cpu_hour(self) -> float | None:
        return self.per_hour / self.cpus if self.per_hour is not None and self.cpus else None

    @property
    def category_s(self) -> dict[str, float]:
        """Seconds by category summed over the samples with a usable report.json."""
        return {c: sum(t.by_category.get(c, 0.0) for t in self.timed) for c in CATEGORIES}

    @property
    def timed_s(self) -> float:
        return sum(t.seconds for t in self.timed)

    @property
    def shares(self) -> dict[str, float]:
        total = self.timed_s
        return {c: s / total if total > 0 else 0.0 for c, s in self.category_s.items()}

    @property
    def bound_by(self) -> str | None:
        """The category with the largest share: what bounds explore's throughput."""
        return max(self.category_s.items(), key=lambda kv: kv[1])[0] if self.timed_s > 0 else None

    @property
    def kept_servers_saving_s(self) -> float:
        return sum(t.kept_servers_saving_s for t in self.timed)

    @property
    def projected_kept_servers_per_hour(self) -> float | None:
        """A projection, not a measurement: samples per hour if every sample reused running P/D servers (and
        proxy), i.e. its seconds less its P/D launch->ready and teardown. An upper bound: samples that differ in
        a server setting cannot reuse servers, and reuse has costs of its own that this leaves out. The baseline's
        launch stays in (the harness often caches the baseline across samples already)."""
        left = self.timed_s - self.kept_servers_saving_s
        return 3600 * len(self.timed) / left if self.timed and left > 0 else None

    def to_dict(self) -> dict[str, Any]:
        return {
            "explore_dir": self.explore_dir,
            "ran": self.ran,
            "skipped": self.skipped,
            "ran_seconds": self.ran_seconds,
            "skipped_seconds": self.skipped_seconds,
            "per_hour": self.per_hour,
            "cpus": self.cpus,
            "per_cpu_hour": self.per_cpu_hour,
            "with_report": len(self.timed),
            "with_report_seconds": self.timed_s,
            "category_s": self.category_s,
            "shares": self.shares,
            "bound_by": self.bound_by,
            "kept_servers_saving_s": self.kept_servers_saving_s,
            "projected_kept_servers_per_hour": self.projected_kept_servers_per_hour,
            "projection_note": "an upper bound, not a measurement: assumes every sample reuses the P/D servers",
            "missing_reports": [asdict(m) for m in self.missing],
            "samples": [asdict(t) for t in self.timed],
        }


def sample_time(sample: str, seconds: float, report: dict[str, Any]) -> SampleTime:
    """Split one sample's seconds by category; raises ValueError when the report has no usable timings."""
    timings = report.get("timings_s")
    if not isinstance(timings, dict):
        raise ValueError("report.json has no timings_s")
    staggered = bool(((report.get("config") or {}).get("gpu_plan") or {}).get("stagger_start"))
    b = breakdown(timings, staggered=staggered)
    by = {c: b.by_category.get(c, 0.0) for c in CATEGORIES if c != "harness"}
    # The explore's clock holds the whole run and the work around it; if it reads less than the run's wall
    # (rounding), the wall is the better figure.
    seconds = max(seconds, b.wall_s)
    by["harness"] = seconds - sum(by.values())
    saving = sum(
        i.counted_s
        for i in b.items
        if i.category in ("launch_to_ready", "teardown") and not i.name.startswith("baseline")
    )
    return SampleTime(sample, seconds, by, saving)


def rate(
    explore_dir: str, samples: list[dict[str, Any]], reports: dict[str, dict | str], cpus: int | None
) -> ExploreRate:
    """The record from explore.json's samples and the ran samples' reports by sample id (a dict, or why none)."""
    ran = [s for s in samples if s.get("status") == "ran"]
    skipped = [s for s in samples if s.get("status") == "skipped"]
    out = ExploreRate(
        explore_dir,
        len(ran),
        len(skipped),
        sum(_seconds(s) for s in ran),
        sum(_seconds(s) for s in skipped),
        cpus,
    )
    for s in ran:
        sid = _id(s)
        report = reports.get(sid, "report.json missing")
        if isinstance(report, str):
            out.missing.append(MissingReport(sid, s.get("run_dir"), report))
            continue
        try:
            out.timed.append(sample_time(sid, _seconds(s), report))
        except (ValueError, TypeError) as e:
            out.missing.append(MissingReport(sid, s.get("run_dir"), f"report.json unusable: {e}"))
    return out


def read_samples(explore_dir: Path) -> list[dict[str, Any]]:
    path = explore_dir / "explore.json"
    if not path.is_file():
        raise ExploreRateError(f"{explore_dir}: no explore.json (not an explore folder, or no sample finished yet)")
    try:
        d = json.loads(path.read_text())
        samples = d["samples"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ExploreRateError(f"{path}: not an explore results file ({type(e).__name__}: {e})") from None
    if not isinstance(samples, list) or not all(isinstance(s, dict) for s in samples):
        raise ExploreRateError(f"{path}: not an explore results file (samples is not a list of objects)")
    return samples


def run_folder(run_dir: str, explore_dir: Path) -> Path:
    """A recorded run folder: absolute, or relative to where the explore ran (usually the repo root)."""
    p = Path(run_dir)
    if p.is_absolute():
        return p
    for base in (Path.cwd(), REPO_ROOT, explore_dir):
        if (base / p).is_dir():
            return base / p
    return p


def read_report(run_dir: str | None, explore_dir: Path) -> dict | str:
    """A ran sample's report.json, or why there is none."""
    if not run_dir:
        return "no run folder recorded"
    path = run_folder(run_dir, explore_dir) / "report.json"
    try:
        d = json.loads(path.read_text())
    except FileNotFoundError:
        return "report.json missing"
    except (OSError, ValueError) as e:
        return f"report.json unreadable ({type(e).__name__}: {e})"
    return d if isinstance(d, dict) else "report.json is not a JSON object"


def explore_rate(explore_dir: Path, cpus: int | None = None) -> ExploreRate:
    """The record of an explore folder; raises ExploreRateError when it is not one."""
    samples = read_samples(explore_dir)
    reports = {_id(s): read_report(s.get("run_dir"), explore_dir) for s in samples if s.get("status") == "ran"}
    return rate(str(explore_dir), samples, reports, os.cpu_count() if cpus is None else cpus)


def _id(s: dict[str, Any]) -> str:
    return str((s.get("sample") or {}).get("id") or "?")


def _seconds(s: dict[str, Any]) -> float:
    try:
        return float(s.get("seconds") or 0.0)
    except (TypeError, ValueError):
        return 0.0


def _f(x: float | None, fmt: str = ".2f") -> str:
    return "n/a" if x is None else format(x, fmt)


def render(r: ExploreRate) -> str:
    lines = [
        f"explore throughput of {r.explore_dir} (from what it recorded; nothing was run)",
        f"  samples: {r.ran} ran in {r.ran_seconds:.0f} s of sample time, {r.skipped} skipped "
        f"(no server started; {r.skipped_seconds:.1f} s recorded)",
        f"  rate: {_f(r.per_hour)} samples/hour of sample time; {_f(r.per_cpu_hour, '.3f')} samples per CPU-hour "
        f"({r.cpus or 'unknown'} CPUs on this machine)",
    ]
    if r.timed:
        lines.append(f"  where the time went ({len(r.timed)} sample(s) with a report.json, {r.timed_s:.0f} s):")
        shares = r.shares
        for c, s in r.category_s.items():
            mark = "  <- bounds it" if c == r.bound_by else ""
            lines.append(f"    {LABELS[c]:<32} {s:>9.0f} s {100 * shares[c]:5.1f} %{mark}")
        lines += [
            f"  projection, not a measurement: {_f(r.projected_kept_servers_per_hour)} samples/hour if every sample "
            "reused running P/D servers",
            f"    (an upper bound: {r.kept_servers_saving_s:.0f} s of P/D launch->ready and teardown left out)",
        ]
    if r.missing:
        lines.append(f"  {len(r.missing)} ran sample(s) without a usable report.json (in the rate, not in the shares):")
        lines += [f"    - {m.sample} ({m.run_dir or 'no run folder'}): {m.why}" for m in r.missing]
    return "\n".join(lines)
