"""Run the GQA-replication matrix: one P/D run per planned pair and version, verdicts, the #45330 line, a report.

The judging is pure (``observed_outcome``, ``judge``, ``version_line``); ``run_matrix``
launches through ``PDRun``, so a pair is the same run as ``python -m harness e2e``.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from harness.core import progress
from harness.core.files import write_atomic
from harness.matrix.config import pair_config
from harness.matrix.plan import PlannedPair
from harness.models.config import ModelEntry
from harness.render import matrix_page as matrix_html
from harness.run.config import E2EConfig

# A run's failure class -> the matrix outcome it stands for (the rest keep their class name).
OUTCOME_OF_CLASS = {"assert-45330": "assert-45330", "rejected-replicated-p-gt-d": "rejected"}


@dataclass(frozen=True)
class PairResult:
    pair: PlannedPair
    vllm_version: str
    observed: str | None  # None: not run
    as_expected: bool | None  # None: not run
    run_dir: str | None = None
    detail: str = ""
    simulated: bool = False  # stand-in servers answered (PD_HARNESS_SIMULATED_GPUS): no vLLM computed its outputs

    @property
    def known_upstream(self) -> str | None:
        """What upstream knows of the pair's expected known failure, when the pair showed it."""
        return self.pair.upstream if self.pair.upstream and self.observed == self.pair.expected else None

    @property
    def intermittent(self) -> bool:
        """The pair showed its known intermittent failure (accepted, but never called a pass)."""
        return self.observed is not None and self.observed == self.pair.tolerated != self.pair.expected

    @property
    def verdict(self) -> str:
        if self.as_expected is None:
            return "skipped"
        if self.intermittent:
            return "known intermittent"
        return "as expected" if self.as_expected else "UNEXPECTED"

    def to_dict(self) -> dict:
        return {
            **self.pair.to_dict(),
            "vllm_version": self.vllm_version,
            "observed": self.observed,
            "verdict": self.verdict,
            "run_dir": self.run_dir,
            "detail": self.detail,
            "simulated": self.simulated,
        }


def observed_outcome(report: dict) -> str:
    """What a finished P/D run showed, in the matrix's words: ok only when every check passed."""
    if report.get("verdict") == "pass":
        return "ok"
    cls = (report.get("failure") or {}).get("class", "checks-failed")
    return OUTCOME_OF_CLASS.get(cls, cls)


def judge(pair: PlannedPair, observed: str) -> bool:
    return observed in (pair.expected, pair.tolerated)


def version_line(version: str, results: list[PairResult]) -> str:
    """The one line a maintainer reads: did #45330 reproduce on this version?"""
    ran = [r for r in results if r.vllm_version == version and r.observed is not None]
    if ran and all(r.simulated for r in ran):
        return f"#45330 NOT TESTED on vLLM {version}: simulated GPUs (stand-in servers; no vLLM computed an output)"
    ran = [r for r in ran if not r.simulated]
    hit = [r.pair.id for r in ran if r.observed == "assert-45330"]
    if hit:
        return f"#45330 REPRODUCED on vLLM {version} ({', '.join(hit)})"
    in_b = [r for r in ran if r.pair.regime == "B"]
    # An edge entry's recorded known failure (another bug, as its entry expects) neither passes nor fails #45330.
    other = [r for r in in_b if r.observed != "ok" and (not r.as_expected or r.intermittent)]
    ok = [r for r in in_b if r.observed == "ok"]
    if other:
        known = " [known intermittent: see the entry's evidence]" if other[0].intermittent else ""
        return f"#45330 on vLLM {version}: FAILED for another reason: {other[0].observed} ({other[0].pair.id}){known}"
    if ok:
        return f"#45330 NOT REPRODUCED on vLLM {version} (outputs match baseline: {', '.join(r.pair.id for r in ok)})"
    if in_b:
        return (
            f"#45330 NOT TESTED on vLLM {version}: every regime-B pair failed as its entry expects, for another "
            f"reason ({', '.join(f'{r.pair.id}: {r.observed}' for r in in_b)})"
        )
    return f"#45330 NOT TESTED on vLLM {version}: no regime-B pair (P <= K < D) ran"


def pair_line(r: PairResult) -> str:
    p = r.pair
    sim = " [simulated GPUs]" if r.simulated else ""
    if r.known_upstream:
        sim += f" [{r.known_upstream}]"
    state = f"observed {r.observed:<18} {r.verdict}{sim}" if r.observed is not None else f"skipped: {p.skip_reason}"
    return f"  {p.id:<20} K={p.kv_heads} P{p.tp_p}->D{p.tp_d} regime {p.regime}  predicted {p.predicted:<13} {state}"


def _detail(r: PairResult) -> str:
    """The run's reason, and where its known failure is already described upstream (never presented as new)."""
    return " — ".join(x for x in (r.detail, r.known_upstream) if x)


def render_markdown(results: list[PairResult], versions: list[str], run_dir: Path, complete: bool = True) -> str:
    lines = ["# GQA-replication matrix", ""]
    if not complete:
        lines += [f"In progress: {len(results)} pairs done; the lines below cover only those.", ""]
    lines += [f"- **{version_line(v, results)}**" for v in versions]
    lines += [
        "",
        "| vLLM | id | K | P→D | regime | predicted | expected | observed | verdict | run |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        p = r.pair
        run = os.path.relpath(r.run_dir, run_dir) if r.run_dir else (p.skip_reason or "")
        lines.append(
            f"| {r.vllm_version} | {p.id} | {p.kv_heads} | {p.tp_p}→{p.tp_d} | {p.regime} | {p.predicted} | "
            f"{p.expected}{f' (intermittent: {p.tolerated})' if p.tolerated else ''} | "
            f"{r.observed or '-'}{' (simulated GPUs)' if r.simulated else ''} | {r.verdict} | {run} |"
        )
    details = [r for r in results if r.detail or r.known_upstream]
    if details:
        lines += ["", "## Details", ""] + [f"- {r.vllm_version} {r.pair.id}: {_detail(r)}" for r in details]
    return "\n".join(lines) + "\n"


def write_matrix_report(results: list[PairResult], versions: list[str], run_dir: Path, complete: bool = True) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    data = {
        "complete": complete,
        "versions": {v: version_line(v, results) for v in versions},
        "all_as_expected": all(r.as_expected is not False for r in results),
        "pairs": [r.to_dict() for r in results],
    }
    write_atomic(run_dir / "report.json", json.dumps(data, indent=2) + "\n")
    write_atomic(run_dir / "report.md", render_markdown(results, versions, run_dir, complete))
    write_atomic(run_dir / "report.html", matrix_html.render_page(data, run_dir))


def model_for(pair: PlannedPair, models: dict[str, ModelEntry]) -> str:
    """The model a pair serves: the tiny model of its family built with the entry's K on CPU, else the hub id."""
    entry = models[pair.model]
    if pair.device == "cpu":
        from harness.models.tiny import ensure_tiny_model, spec_for_model_entry

        return str(ensure_tiny_model(spec_for_model_entry(entry, pair.kv_heads)))
    return entry.hub_id or entry.id


def config_for(base: E2EConfig, pair: PlannedPair, model: str, python: str, run_dir: Path) -> E2EConfig:
    """The run of one pair: the TP sizes and the entry's other settings over the matrix's base config (load_matrix
    validated each entry's through the same pair_config)."""
    return pair_config(base, pair.tp_p, pair.tp_d, pair.device, pair.settings, model, python, run_dir)


def new_matrix_dir(runs_root: Path) -> Path:
    return runs_root / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-matrix-{os.getpid()}"


def interrupted_pair_report(pair_dir: Path, p: PlannedPair, version: str, e: KeyboardInterrupt) -> None:
    """The pair's own report when an interrupt (a Ray cancel, Ctrl-C) came before its run wrote one (while its model
    was built, before its servers started): every interrupted pair then says so in its folder, whatever the phase."""
    if (pair_dir / "report.json").exists():
        return
    from harness.run.failures import interrupted
    from harness.run.report import Report, write_report

    config = {"entry": p.id, "vllm_version": version, "tp_p": p.tp_p, "tp_d": p.tp_d, "device": p.device}
    failure = {**interrupted(e), "reason": f"{interrupted(e)['reason']} before the pair's run started"}
    write_report(Report(config=config, failure=failure), pair_dir, runs_root=None)


def run_matrix(
    plans: dict[str, list[PlannedPair]],
    pythons: dict[str, str],
    models: dict[str, ModelEntry],
    base: E2EConfig,
    run_dir: Path,
    out=sys.stdout,
    run_pair: Callable[[E2EConfig, dict], dict] | None = None,
) -> list[PairResult]:
    """Every planned pair of every version, in order; the report is rewritten after each pair so an interrupt keeps
    it."""
    from harness.run.pipeline import PDRun

    def default_run(cfg: E2EConfig, cache: dict) -> dict:
        return PDRun(cfg, baseline_last=True, baseline_cache=cache).run()

    run_pair = run_pair or default_run
    versions = list(plans)
    results: list[PairResult] = []
    rep = progress.current()
    total = sum(p.run and p.predicted != "invalid" for pairs in plans.values() for p in pairs)
    took: list[float] = []  # seconds of each pair run so far: the estimate of what is left
    for version, pairs in plans.items():
        cache: dict = {}  # baselines are shared between the pairs of one version (same model, TP and interpreter)
        rep.clear()
        print(f"vLLM {version} ({pythons[version]}):", file=out, flush=True)
        for p in pairs:
            if not p.run:
                results.append(PairResult(p, version, None, None))
            elif p.predicted == "invalid":
                results.append(
                    PairResult(
                        p, version, None, None, detail="vLLM refuses these TP sizes for this model; not launched"
                    )
                )
            else:
                left = progress.eta_s(took, total - len(took))
                rep.phase(
                    f"matrix pair {len(took) + 1}/{total}: {p.id} on vLLM {version}, P TP{p.tp_p} -> D TP{p.tp_d}; "
                    + (
                        f"about {progress.duration(left)} left (median of {len(took)} pair(s) done)"
                        if left is not None
                        else "no estimate before the first pair ends"
                    )
                )
                t_pair = rep.clock()  # the pair's time includes building its model (the estimate must, too)
                pair_dir = run_dir / f"vllm-{version}" / p.id
                try:
                    cfg = config_for(base, p, model_for(p, models), pythons[version], pair_dir)
                    rep.clear()
                    print(
                        f"  {p.id}: running P TP{p.tp_p} -> D TP{p.tp_d} (run folder {cfg.run_dir})",
                        file=out,
                        flush=True,
                    )
                    report = run_pair(cfg, cache)
                except KeyboardInterrupt as e:
                    interrupted_pair_report(pair_dir, p, version, e)
                    raise
                took.append(rep.clock() - t_pair)
                rep.phase(f"matrix pair {len(took)}/{total}: {p.id} done in {progress.duration(took[-1])}")
                observed = observed_outcome(report)
                detail = "" if observed == "ok" else str(report.get("reason") or "")[:300]
                results.append(
                    PairResult(
                        p,
                        version,
                        observed,
                        judge(p, observed),
                        str(cfg.run_dir),
                        detail,
                        simulated=bool(report.get("simulated")),
                    )
                )
            rep.clear()
            print(pair_line(results[-1]), file=out, flush=True)
            write_matrix_report(results, versions, run_dir, complete=False)
    write_matrix_report(results, versions, run_dir)
    return results


def summary(results: list[PairResult], versions: list[str]) -> str:
    ran = [r for r in results if r.as_expected is not None]
    bad = [r for r in ran if not r.as_expected]
    lines = [version_line(v, results) for v in versions]
    flaky = sum(r.intermittent for r in ran)
    lines.append(
        f"matrix: {len(ran) - len(bad)}/{len(ran)} pairs as expected"
        + (f" ({flaky} with a known intermittent failure)" if flaky else "")
        + f", {len(results) - len(ran)} skipped"
        + (
            "; unexpected: "
            + ", ".join(f"{r.pair.id} on {r.vllm_version} ({r.observed}, expected {r.pair.expected})" for r in bad)
            if bad
            else ""
        )
    )
    return "\n".join(lines)
