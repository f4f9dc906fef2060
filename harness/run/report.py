"""Run reports: report.json (for machines), written with report.md (render/run_markdown.py) and report.html
(render/run_page.py) for people."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.checks.check import Check
from harness.core.files import write_atomic
from harness.core.redact import redact_tree
from harness.render import run_page as run_html
from harness.render.run_markdown import known_upstream_line, render_markdown, simulated_note


@dataclass
class Report:
    config: dict[str, Any]
    versions: dict[str, str | None] = field(default_factory=dict)
    checks: list[Check] = field(default_factory=list)
    timings_s: dict[str, float] = field(default_factory=dict)
    comparison: dict[str, Any] | None = None
    commands: dict[str, str] = field(default_factory=dict)
    logs: dict[str, str] = field(default_factory=dict)
    failure: dict[str, Any] | None = None  # set when the run could not complete
    accuracy: dict[str, Any] | None = None  # lm-eval scores and per-sample diff (with --accuracy)
    load: dict[str, Any] | None = None  # the load phase: requests, aborts, comparison, latency, pool reuse
    faults: dict[str, Any] | None = None  # injected faults and the requests they hit
    prefix_cache: dict[str, Any] | None = (
        None  # D's prefix-cache scenarios: each request's token sources, predicted and seen
    )
    skipped_checks: list[dict[str, str]] = field(default_factory=list)  # checks this run could not make, with why
    timing_breakdown: dict[str, Any] | None = None  # harness/run/timing.py: where the wall time went
    events: list[dict[str, Any]] = field(default_factory=list)  # {name, kind, start_s, end_s, ok}: the run's timeline

    @property
    def verdict(self) -> str:
        if self.failure is not None and self.failure.get("class") == "interrupted":
            return "interrupted"
        return "pass" if self.failure is None and self.checks and all(c.passed for c in self.checks) else "fail"

    @property
    def reason(self) -> str | None:
        if self.failure is not None:
            return str(self.failure.get("reason"))
        if not self.checks:
            return "no check ran"
        failed = [c for c in self.checks if not c.passed]
        return "; ".join(f"{c.name}: {c.detail}" for c in failed) or None

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"verdict": self.verdict}
        if self.verdict != "pass":
            d["reason"] = self.reason
            if self.failure is not None and self.failure.get("class") != "interrupted":
                d["known_upstream"] = known_upstream_line(self.failure, self.versions.get("vllm"))
        sim = simulated_note(self.config)
        if sim:  # next to the verdict: a pass on a simulated GPU box proves the harness's path, not vLLM
            d["simulated"] = sim
        d.update(
            config=self.config,
            versions=self.versions,
            checks=[c.to_dict() for c in self.checks],
            skipped_checks=self.skipped_checks,
            timings_s={k: round(v, 3) for k, v in self.timings_s.items()},
            timing_breakdown=self.timing_breakdown,
            comparison=self.comparison,
            commands=self.commands,
            logs=self.logs,
        )
        if self.accuracy is not None:
            d["accuracy"] = self.accuracy
        if self.load is not None:
            d["load"] = self.load
        if self.faults is not None:
            d["faults"] = self.faults
        if self.prefix_cache is not None:
            d["prefix_cache"] = self.prefix_cache
        if self.failure is not None:
            d["failure"] = self.failure
        if self.events:
            d["events"] = self.events
        return d


def write_report(report: Report, run_dir: Path, runs_root: Path | None = None) -> dict[str, Any]:
    """report.json, .md and .html, secrets masked (core/redact.py: the config, commands, attach URLs, log excerpts);
    returns what was written."""
    d = redact_tree(report.to_dict())
    run_dir.mkdir(parents=True, exist_ok=True)
    write_atomic(run_dir / "report.json", json.dumps(d, indent=2, default=str) + "\n")
    write_atomic(run_dir / "report.md", render_markdown(d))
    write_atomic(run_dir / "report.html", run_html.render_page(d, run_dir))
    if runs_root is not None:
        point_latest(runs_root, run_dir)
    return d


def point_latest(runs_root: Path, run_dir: Path) -> None:
    """runs/latest -> the newest run, replaced atomically."""
    link = runs_root / "latest"
    tmp = runs_root / f".latest-{os.getpid()}"
    try:
        target = os.path.relpath(run_dir.resolve(), runs_root.resolve())
    except ValueError:
        target = str(run_dir.resolve())
    if tmp.is_symlink() or tmp.exists():
        tmp.unlink()
    os.symlink(target, tmp)
    os.replace(tmp, link)


def print_summary(d: dict, run_dir: Path, out=sys.stdout) -> None:
    """The checks, the failure and the verdict of a report, for the terminal."""
    for c in d.get("checks", []):
        print(f"  [{'PASS' if c['passed'] else 'FAIL'}] {c['name']}: {c['detail']}", file=out)
    if d.get("failure"):
        print(f"  run failed [{d['failure'].get('class', 'unknown')}]: {d['failure']['reason']}", file=out)
        print("  " + str(d["failure"].get("excerpt", "")).replace("\n", "\n  "), file=out)
    print(
        f"verdict: {d['verdict']}"
        + (f" ({d.get('reason')})" if d["verdict"] != "pass" else "")
        + (f" [{d['simulated']}]" if d.get("simulated") else ""),
        file=out,
    )
    print(f"report: {run_dir / 'report.md'}", file=out)
