"""The results file of an explore (``explore.json``, rewritten after each sample, so a killed explore loses at most
the sample in flight and ``--resume`` goes on from it) and its page (``explore.md``)."""

from __future__ import annotations

import itertools
import json
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.explore.follow_up import DONE, NEEDS_NO_PD, STEPS, FindingFollowUp
from harness.explore.signature import EXPECTED, KNOWN, NEW, PASS, values_that_matter
from harness.explore.space import Space

FORMAT = 1


@dataclass
class SampleResult:
    sample: dict[str, Any]  # Sample.to_dict()
    axis_values: dict[str, str]
    version: str
    status: str  # ran | skipped
    outcome: str | None = None  # the matrix's word for what the run showed (ok, a failure class)
    predicted: str | None = None
    verdict: str | None = None  # pass | expected | known | new (ran); None when skipped
    why: str = ""  # the skip reason, or what made it expected or known
    signature: str | None = None
    run_dir: str | None = None
    seconds: float = 0.0


@dataclass
class Results:
    path: Path
    seed: int
    version: str
    samples: list[SampleResult] = field(default_factory=list)
    follow_ups: dict[str, FindingFollowUp] = field(default_factory=dict)  # by signature: the new ones' follow-ups

    @classmethod
    def open(cls, path: Path, seed: int, version: str, resume: bool) -> Results:
        """A new results file, or (``resume``) the one at ``path``, which must be of this seed and version."""
        if not resume or not path.exists():
            return cls(path, seed, version)
        try:
            d = json.loads(path.read_text())
            samples = [SampleResult(**s) for s in d["samples"]]
            follow_ups = {f["signature"]: FindingFollowUp.from_dict(f) for f in d.get("follow_ups") or []}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise ConfigError(f"{path}: not an explore results file ({type(e).__name__}: {e})") from None
        if (d.get("seed"), d.get("version")) != (seed, version):
            raise ConfigError(
                f"{path} is of seed {d.get('seed')} on vLLM {d.get('version')}, not seed {seed} on {version}: "
                "resume with the same --seed and version, or give a new --run-dir"
            )
        return cls(path, seed, version, samples, follow_ups)

    def done(self, sample_id: str) -> bool:
        return any(r.sample["id"] == sample_id for r in self.samples)

    def covered(self) -> Counter:
        """(axis, value) words of every sample drawn so far (the sampler's coverage on resume)."""
        return Counter(kv for r in self.samples for kv in r.axis_values.items())

    def add(self, r: SampleResult) -> None:
        self.samples.append(r)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        d = {
            "format": FORMAT,
            "seed": self.seed,
            "version": self.version,
            "samples": [asdict(s) for s in self.samples],
            "follow_ups": [{**asdict(f), "pd": f.pd_words()} for f in self.follow_ups.values()],
        }
        write_atomic(self.path, json.dumps(d, indent=1) + "\n")


def findings(results: Results) -> list[dict[str, Any]]:
    """One row per signature of the samples that ran and failed: its verdict, count, first sample, and the axis values
    that matter; new ones first."""
    ran = [r for r in results.samples if r.status == "ran"]
    passing = [r.axis_values for r in ran if r.verdict == PASS]
    rows = []
    for sig, group in itertools.groupby(
        sorted((r for r in ran if r.signature), key=lambda r: r.signature or ""), key=lambda r: r.signature
    ):
        g = list(group)
        rows.append(
            {
                "signature": sig,
                "verdict": g[0].verdict,
                "count": len(g),
                "first": g[0].sample["id"],
                "why": g[0].why,
                "matters": values_that_matter([r.axis_values for r in g], passing),
                "run_dir": g[0].run_dir,
                "follow_up": results.follow_ups.get(str(sig)),
            }
        )
    return sorted(rows, key=lambda x: (_rank(x), -int(x["count"])))


def pd_finding(row: dict[str, Any]) -> bool:
    """A new finding that counts as a P/D one: not one whose control without P/D failed as the run did."""
    fu = row.get("follow_up")
    return row["verdict"] == NEW and not (fu is not None and fu.needs_pd is False)


def _rank(row: dict[str, Any]) -> int:
    """New P/D findings first, then new ones that need no P/D, known, expected."""
    if row["verdict"] == NEW:
        return 0 if pd_finding(row) else 1
    return {KNOWN: 2, EXPECTED: 3}.get(str(row["verdict"]), 4)


def pair_coverage(results: Results, space: Space) -> tuple[int, int]:
    """(pairs of axis values run together, pairs the space declares): how much of the space's pairs has run."""
    axes = {"model": [m.id for m in space.models], **{k: [_w(v) for v in c.values] for k, c in space.axes.items()}}
    names = sorted(axes)
    declared = sum(len(axes[a]) * len(axes[b]) for a, b in itertools.combinations(names, 2))
    seen = set()
    for r in results.samples:
        if r.status != "ran":
            continue
        av = {k: v for k, v in r.axis_values.items() if k in axes}
        seen |= {((a, av[a]), (b, av[b])) for a, b in itertools.combinations(sorted(av), 2)}
    return len(seen), declared


def render(results: Results, space: Space) -> str:
    ran = [r for r in results.samples if r.status == "ran"]
    skipped = [r for r in results.samples if r.status == "skipped"]
    by = Counter(r.verdict for r in ran)
    seen, declared = pair_coverage(results, space)
    lines = [
        f"# explore: seed {results.seed} on vLLM {results.version}",
        "",
        f"{len(results.samples)} samples: {len(ran)} ran ({by[PASS]} pass, {by[EXPECTED]} expected, {by[KNOWN]} known, "
        f"{by[NEW]} new), {len(skipped)} skipped (vLLM refuses them, or this machine cannot run them).",
        summary_line(results),
        f"Pairs of axis values run together: {seen} of {declared} the space declares.",
        "",
        "## Findings (new first)",
        "",
    ]
    rows = findings(results)
    if not rows:
        lines.append("No sample failed.")
    for f in rows:
        matters = ", ".join(f"{k}={v}" for k, v in f["matters"].items()) or "none shared by every failing sample alone"
        fu = f["follow_up"]
        tag = f"{f['verdict']}, {NEEDS_NO_PD}" if f["verdict"] == NEW and not pd_finding(f) else f["verdict"]
        lines.append(
            f"- **{tag}** `{f['signature']}` x{f['count']} (first {f['first']}, {f['run_dir']}): "
            f"values that matter: {matters}" + (f"; {f['why']}" if f["why"] else "")
        )
        if fu is not None:
            lines += follow_up_lines(fu)
    lines += ["", "## Coverage (samples run, by axis value)", ""]
    cov = Counter(kv for r in ran for kv in r.axis_values.items())
    for axis in sorted({a for a, _ in cov}):
        lines.append(f"- {axis}: " + ", ".join(f"{v} x{n}" for (a, v), n in sorted(cov.items()) if a == axis))
    if skipped:
        lines += ["", "## Skipped", ""]
        lines += [f"- {r.sample['id']}: {r.why}" for r in skipped]
    return "\n".join(lines) + "\n"


def summary_line(results: Results) -> str:
    """The findings by kind: a new one whose control without P/D fails alike is not counted as a P/D finding."""
    rows = findings(results)
    new = [f for f in rows if f["verdict"] == NEW]
    pd = sum(pd_finding(f) for f in new)
    by = Counter(f["verdict"] for f in rows)
    return (
        f"Findings (one per signature): {pd} new P/D finding(s), {len(new) - pd} new that need no P/D (the control "
        f"without P/D fails alike), {by[KNOWN]} known, {by[EXPECTED]} expected."
    )


def follow_up_lines(fu: FindingFollowUp) -> list[str]:
    """A new finding's follow-ups: each step's result, or why it did not run."""
    lines = [f"  - P/D: {fu.pd_words()}"]
    for name in STEPS:
        s = fu.steps.get(name)
        if s is None:
            lines.append(f"  - {name}: not run yet (an interrupted explore: --resume runs it)")
        elif s.status != DONE:
            lines.append(f"  - {name}: {s.status}: {s.why}")
        elif name == "control":
            lines.append(f"  - control without P/D: {s.outcome} ({s.path})" + (f": {s.why}" if s.why else ""))
        elif name == "shrink":
            at = s.run_dir or "the sample's own run"
            cut = f"; cut short: {s.why}" if s.why else ""
            lines.append(f"  - shrink: smallest still failing: {s.outcome} ({at}; {s.path}){cut}")
        else:
            lines.append(f"  - {name}: {s.path}")
    return lines


def _w(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)
