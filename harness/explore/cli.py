"""`python -m harness explore`: draw samples from the declared space, run each as an edge-matrix pair on CPU, and
write what was found (explore.json, explore.md). Deterministic for a seed; ``--resume`` continues a killed one."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.core.argtypes import non_negative_int, positive, positive_int
from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.explore import signature as sig
from harness.explore.follow_up import FindingFollowUp, FollowUp, real_follow_up, run_follow_ups
from harness.explore.results import Results, SampleResult, render
from harness.explore.sample import Sample, Sampler
from harness.explore.space import SPACE_YAML, Space, entry_of, load_space
from harness.matrix.config import EDGE_YAML, MatrixFile, load_matrix
from harness.matrix.plan import PlannedPair, plan
from harness.upstream.known import load_known

REPEATS_LIMIT = 200  # draws in a row that only repeat done samples: the space is exhausted


def add_parser(sub) -> None:
    p = sub.add_parser("explore", help="a budgeted search of P/D settings for new, deduplicated failures")
    budget = p.add_mutually_exclusive_group(required=True)
    budget.add_argument("--runs", type=positive_int, help="samples to run (skipped ones do not count)")
    budget.add_argument("--hours", type=positive(float), help="stop starting samples after this long")
    p.add_argument("--seed", type=non_negative_int, default=0, help="the sampler's seed (default 0)")
    p.add_argument("--space", type=Path, default=SPACE_YAML, help="the declared space (configs/explore_space.yaml)")
    p.add_argument("--vllm-version", help="default: $VLLM_VERSION or the one .venv serves")
    p.add_argument("--run-dir", type=Path, help="results and runs (default: runs/<timestamp>-explore)")
    p.add_argument("--resume", action="store_true", help="continue the explore in --run-dir, skipping its samples")
    p.add_argument("--load-requests", type=non_negative_int, default=0, help="each sample's load phase (default 0)")
    p.add_argument("--dry-run", action="store_true", help="draw and plan the samples, run nothing, write nothing")
    p.add_argument(
        "--no-follow-up",
        action="store_true",
        help="for a new signature, skip the control without P/D, shrink and the repro bundle (recorded as skipped)",
    )
    p.add_argument(
        "--shrink-probes", type=positive_int, default=8, help="a new signature's shrink: at most this many probe runs"
    )


@dataclass(frozen=True)
class Ran:
    observed: str
    report: dict[str, Any]
    run_dir: str | None


Runner = Callable[[PlannedPair, str], Ran]


@dataclass
class Explore:
    space: Space
    edge: MatrixFile
    models: dict
    version: str
    results: Results
    runner: Runner
    out: Any = sys.stdout
    follow_up: FollowUp | None = None  # None: a new signature's follow-ups are recorded as skipped (--no-follow-up)

    def follow(self) -> None:
        """The pending follow-ups of every new signature, once per signature (from its first sample); each step is
        saved as it ends. A second sample of a signature is counted in its finding, not followed up again."""
        for r in self.results.samples:
            if r.status != "ran" or r.verdict != sig.NEW or not r.signature:
                continue
            rec = self.results.follow_ups.get(r.signature)
            if rec is None:
                rec = FindingFollowUp(r.signature, r.sample["id"], r.outcome or "", r.run_dir)
                self.results.follow_ups[r.signature] = rec
            pending = rec.pending(self.follow_up is not None)
            if not pending:
                continue
            if self.follow_up is not None:
                print(f"explore: new {r.signature}: {', '.join(pending)} of {rec.sample}", file=self.out, flush=True)
            run_follow_ups(rec, self.follow_up, self.results.save)

    def step(self, s: Sample, dry_run: bool = False) -> SampleResult | None:
        """Plan one sample and run it (or say why not); None on a dry run."""
        base = SampleResult(s.to_dict(), s.axis_values(), self.version, "skipped")
        try:
            entry = entry_of(s.id, s.model, s.kv_heads, dict(s.values))
        except ValueError as e:  # a combination the entry schema refuses (e.g. an axis this device cannot run)
            base.why = f"not a valid entry: {str(e).splitlines()[-1]}"
            return None if dry_run else base
        p = plan(MatrixFile(entries=[entry], families=self.edge.families), self.models, self.version, "cpu", 0)[0]
        base.predicted = p.predicted
        if not p.run or p.predicted == "invalid":
            base.why = p.skip_reason or f"the topology predicts {p.predicted}: vLLM refuses it before it runs"
        print(
            f"explore: {s.describe()} -> predicted {p.predicted}" + (f"; skipped: {base.why}" if base.why else ""),
            file=self.out,
            flush=True,
        )
        if dry_run or base.why:
            return None if dry_run else base
        t0 = time.monotonic()
        ran = self.runner(p, self.version)
        failure = ran.report.get("failure") or {}
        if failure.get("source") == "preflight":  # refused before anything launched: not a run, not a finding
            base.why = f"refused before launch: {failure.get('reason')}"
            return base
        found = sig.signature_of(ran.observed, ran.report)
        verdict, why = sig.classify(
            ran.observed,
            p.predicted,
            found,
            entry.settings(),
            load_known(),
            self.edge,
            str(ran.report.get("reason") or ""),
            self.version,
            s.model,
            s.kv_heads,
        )
        return SampleResult(
            s.to_dict(),
            s.axis_values(),
            self.version,
            "ran",
            ran.observed,
            p.predicted,
            verdict,
            why,
            found.text() if found else None,
            ran.run_dir,
            round(time.monotonic() - t0, 1),
        )


def explore(ex: Explore, sampler: Sampler, runs: int | None, hours: float | None, dry_run: bool = False) -> int:
    """Draw and run samples within the budget; the results file and page are rewritten after each. Returns how many
    samples ran."""
    deadline = time.monotonic() + hours * 3600 if hours else None
    ran = repeats = 0
    if not dry_run and ex.results.samples:  # a resumed explore first ends the follow-ups it was killed in
        ex.follow()
        write_atomic(ex.results.path.with_suffix(".md"), render(ex.results, ex.space))
    while (runs is None or ran < runs) and (deadline is None or time.monotonic() < deadline):
        s = sampler.draw()
        if ex.results.done(s.id):
            repeats += 1
            if repeats >= REPEATS_LIMIT:
                print(f"explore: {REPEATS_LIMIT} draws in a row were done samples: the space is covered", file=ex.out)
                break
            continue
        repeats = 0
        r = ex.step(s, dry_run)
        if dry_run:
            ran += 1
            continue
        assert r is not None
        ex.results.add(r)
        ex.follow()
        write_atomic(ex.results.path.with_suffix(".md"), render(ex.results, ex.space))
        ran += r.status == "ran"
        print(
            f"explore: {ran} ran, {len(ex.results.samples)} drawn; {r.sample['id']}: {r.verdict or r.status}"
            + (f" {r.signature}" if r.signature else ""),
            file=ex.out,
            flush=True,
        )
    return ran


def matrix_runner(run_dir: Path, python: str, models: dict, load_requests: int) -> Runner:
    """Each sample run as the matrix runs a pair (its model built, its baseline cached), in ``run_dir``."""
    from harness.matrix.cli import base_config
    from harness.matrix.run import run_matrix

    base = base_config("cpu", load_requests)

    def run(p: PlannedPair, version: str) -> Ran:
        r = run_matrix({version: [p]}, {version: python}, models, base, run_dir / p.id)[0]
        report = Path(r.run_dir) / "report.json" if r.run_dir else None
        d = json.loads(report.read_text()) if report and report.exists() else {}
        return Ran(r.observed or "harness-error", d, r.run_dir)

    return run


def main(a: argparse.Namespace) -> int:
    from harness.core.interrupts import catch_interrupts
    from harness.envs.vllm_env import EnvSetupFailed, ensure_env, versions_from
    from harness.models.config import load_models

    try:
        space = load_space(a.space)
        edge, models = load_matrix(EDGE_YAML)
        version = versions_from(a.vllm_version, "cpu")[0]
        run_dir = Path(a.run_dir) if a.run_dir else _new_dir()
        results = Results.open(run_dir / "explore.json", a.seed, version, a.resume)
        if not a.resume and not a.dry_run and results.path.exists():
            raise ConfigError(f"{run_dir} holds an explore already: --resume it, or give a new --run-dir")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    k_of = {m.id: m.kv_heads for m in load_models().models if getattr(m, "kv_heads", None)}
    sampler = Sampler(space, a.seed, k_of, covered=results.covered())
    runner: Runner = lambda p, v: Ran("harness-error", {}, None)  # noqa: E731 - the dry run runs nothing
    if not a.dry_run:
        catch_interrupts()
        try:
            runner = matrix_runner(run_dir / "samples", str(ensure_env("cpu", version)), models, a.load_requests)
        except EnvSetupFailed as e:
            print(f"error: {e}", file=sys.stderr)
            return 1
        print(f"explore folder: {run_dir}", flush=True)
    follow_up = None if a.no_follow_up else real_follow_up(a.shrink_probes)
    ex = Explore(space, edge, models, version, results, runner, follow_up=follow_up)
    try:
        explore(ex, sampler, a.runs, a.hours, a.dry_run)
    except KeyboardInterrupt:
        print(f"interrupted; --resume continues it: {results.path}", file=sys.stderr)
        return 130
    if not a.dry_run:
        if a.no_follow_up:
            print("follow-ups of new signatures: skipped (--no-follow-up), recorded as such")
        print(f"report: {results.path.with_suffix('.md')}")
    return 0


def _new_dir() -> Path:
    import datetime as dt
    import os

    from harness.core.paths import REPO_ROOT

    return REPO_ROOT / "runs" / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-explore-{os.getpid()}"
