"""Run reports: report.json (for machines) and report.md (for people)."""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.checks.check import Check
from harness.checks.kv_digest import location_in
from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.core.redact import redact_tree
from harness.render import run_page as run_html
from harness.render.run_page import tp_text
from harness.run.attach_report import attach_markdown
from harness.upstream.known import load_known


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


def simulated_note(config: dict[str, Any]) -> str | None:
    """One line for a run on a simulated GPU box (harness/run/simulated.py), None for a real one."""
    box = (config.get("gpu_plan") or {}).get("simulated")
    if not box:
        return None
    sim = config.get("simulated_gpus")
    made = (
        f"{len(sim.get('checks_skipped') or [])} data-path checks skipped, not passed"
        if sim
        else "not evaluated: no data-path check made"
    )
    return f"SIMULATED GPUs (PD_HARNESS_SIMULATED_GPUS={box}): stand-in servers in vLLM's place; {made}"


def render_markdown(d: dict[str, Any]) -> str:
    """report.md: the verdict and why, the checks, then each section the run has, then its configuration."""
    lines = _header_markdown(d) + _checks_markdown(d) + _failure_markdown(d.get("failure"))
    lines += attach_markdown((d.get("config") or {}).get("attach"), d.get("config") or {})
    lines += _accuracy_markdown(d.get("accuracy"))
    lines += load_markdown(d.get("load"))
    lines += prefix_markdown(d.get("prefix_cache"))
    lines += _comparison_markdown(d.get("comparison"))
    lines += _appendix_markdown(d)
    return "\n".join(lines) + "\n"


def _header_markdown(d: dict[str, Any]) -> list[str]:
    cfg = d.get("config", {})
    lines = [
        f"# P/D run: P {tp_text(cfg.get('tp_p'))} -> D {tp_text(cfg.get('tp_d'))} — **{d['verdict'].upper()}**",
        "",
    ]
    if d.get("simulated"):
        lines += [f"**{d['simulated']}**", ""]
    if d.get("reason"):
        lines += [f"Reason: {d['reason']}", ""]
    if where := location_in(d.get("checks") or []):
        lines += [where, ""]
    if d.get("known_upstream"):
        lines += [f"Upstream: {d['known_upstream']}", ""]
    bc = cfg.get("baseline_cache") or {}
    if bc.get("used"):
        lines += [
            f"Baseline: cached answers ({bc.get('where', 'disk')}), computed by run `{bc.get('from_run')}`"
            + (f" at {bc['created']}" if bc.get("created") else "")
            + "; no baseline server ran in this run"
            + (" (`--fresh-baseline` computes it again)." if bc.get("where") == "disk" else "."),
            "",
        ]
    return lines


def _checks_markdown(d: dict[str, Any]) -> list[str]:
    lines = ["## Checks", "", "| check | result | detail |", "|---|---|---|"]
    for c in d.get("checks", []):
        detail = str(c["detail"]).replace("|", "\\|").replace("\n", " ")
        lines.append(f"| {c['name']} | {'pass' if c['passed'] else 'FAIL'} | {detail} |")
    for c in d.get("skipped_checks", []):
        lines.append(f"| {c['name']} | not checked | {c['reason']} |")
    return lines + threshold_markdown(d)


def threshold_markdown(d: dict[str, Any]) -> list[str]:
    """Below the checks that compare logprobs against it: the threshold and where it came from (config
    ``logprob_threshold_source``: given, calibrated <date> (<folder>) or default (<why>), run/thresholds.py)."""
    cfg = d.get("config") or {}
    source = cfg.get("logprob_threshold_source")
    if not source:
        return []
    value = cfg.get("logprob_threshold")
    if value is None:  # the device's default: the checks that used it say which
        value = next(
            (c["data"]["threshold"] for c in d.get("checks", []) if "threshold" in (c.get("data") or {})), None
        )
    shown = "the device's default" if value is None else f"{value:g}"
    return ["", f"Logprob threshold {shown}, source: {source}."]


def _failure_markdown(f: dict[str, Any] | None) -> list[str]:
    if not f:
        return []
    return [
        "",
        "## Failure",
        "",
        f"Class: `{f.get('class', 'unknown')}`",
        "",
        f"{f.get('reason')}",
        "",
        "```",
        str(f.get("excerpt", "")),
        "```",
    ]


def _accuracy_markdown(a: dict[str, Any] | None) -> list[str]:
    if not a:
        return []
    return [
        "",
        f"## Accuracy ({a['task']}, lm-eval {a.get('lm_eval')})",
        "",
        "| samples | baseline | P/D | delta | tolerance | differing responses | score flips |",
        "|---|---|---|---|---|---|---|",
        f"| {a['samples']} | {a['baseline_score']:.3f} | {a['pd_score']:.3f} | {a['delta']:+.3f} | "
        f"{a['tolerance']:.3f} | {a['differing_responses']} | {a['score_flips']} |",
    ]


def _comparison_markdown(comp: dict[str, Any] | None) -> list[str]:
    if not comp:
        return []
    lines = [
        "",
        "## Comparison with the baseline",
        "",
        f"{comp.get('summary', '')}",
        "",
        "| prompt | prompt tokens | status | compared tokens | divergence |",
        "|---|---|---|---|---|",
    ]
    tokens = comp.get("prompt_tokens", {})
    for p in comp.get("prompts", []):
        div = p.get("divergence")
        dtxt = (
            ""
            if not div
            else f"pos {div['position']}: baseline {div['baseline_token']} vs P/D {div['pd_token']} ({div['reason']})"
        )
        lines.append(
            f"| {p['prompt_id']} | {tokens.get(p['prompt_id'], '')} | {p['status']} | {p['compared_tokens']} | {dtxt} |"
        )
    return lines


def _appendix_markdown(d: dict[str, Any]) -> list[str]:
    """The configuration, versions, timings, logs and commands."""
    lines = [
        "",
        "## Configuration",
        "",
        "```json",
        json.dumps(d.get("config", {}), indent=2),
        "```",
        "",
        "## Versions",
        "",
    ]
    lines += [f"- {k}: {v}" for k, v in d.get("versions", {}).items()]
    lines += ["", "## Timings (s)", ""] + [f"- {k}: {v}" for k, v in d.get("timings_s", {}).items()]
    tb = d.get("timing_breakdown")
    if tb:
        lines += [
            "",
            f"Harness's own time: {tb['harness_own_s']:.1f} s of {tb['wall_s']:.1f} s wall "
            f"({100 * tb['harness_own_share']:.1f}%, target {100 * tb['target_share']:.0f}%); "
            + ", ".join(f"{k} {v:.1f} s" for k, v in tb["by_category_s"].items()),
        ]
    lines += ["", "## Logs", ""] + [f"- {k}: `{v}`" for k, v in d.get("logs", {}).items()]
    lines += ["", "## Commands", ""] + [f"- {k}: `{v}`" for k, v in d.get("commands", {}).items()]
    return lines


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


def load_markdown(load: dict[str, Any] | None) -> list[str]:
    """The load table of report.md."""
    if not load:
        return []

    def ms(x) -> str:
        return "-" if x is None else f"{1000 * x:.0f}"

    lat = load["latency"]
    pd, base = lat["pd"], lat["baseline"]
    ab = load["aborted_by_client"]
    cancelled = ", ".join(f"{k} {v}" for k, v in load["cancelled_by_proxy"].items() if v) or "none"
    pools = "; ".join(f"{p['server']}: {p['blocks_needed']} needed / {p['blocks']} blocks" for p in load["pools"])
    delta = load.get("max_logprob_delta")
    return [
        "",
        f"## Load ({load['requests']} requests, concurrency {load['concurrency']})",
        "",
        "| aborted by client (P / D) | cancelled by the proxy | matched | mismatched | max Δlogprob | "
        "TTFT p50/p99 ms P/D | baseline | e2e p50/p99 ms P/D | baseline | KV pool |",
        "|---|---|---|---|---|---|---|---|---|---|",
        f"| {ab.get('prefill', 0)} / {ab.get('decode', 0)} | {cancelled} | {load['matched']} | "
        f"{', '.join(load['mismatched']) or 0} | {'-' if delta is None else f'{delta:.2e}'} | "
        f"{ms(pd['ttft_p50_s'])}/{ms(pd['ttft_p99_s'])} | {ms(base['ttft_p50_s'])}/{ms(base['ttft_p99_s'])} | "
        f"{ms(pd['e2e_p50_s'])}/{ms(pd['e2e_p99_s'])} | {ms(base['e2e_p50_s'])}/{ms(base['e2e_p99_s'])} | {pools} |",
        "",
        f"The baseline answered {load['baseline_answered']}. Batching noise cannot fail a correct run: "
        f"{load['why_noise_cannot_fail']}.",
    ]


def prefix_markdown(prefix: dict[str, Any] | None) -> list[str]:
    """D's prefix-cache scenarios: each request's prompt-token sources, predicted vs seen."""
    if not prefix:
        return []
    lines = [
        "",
        f"## D's prefix cache (block size {prefix['block_size_d']})",
        "",
        f"Rule: {prefix['rule']}.",
        "",
        "| request | scenario | tokens | expected local / external / computed | seen | |",
        "|---|---|---|---|---|---|",
    ]
    for r in prefix["requests"]:
        e, m = r["expected"], r["measured"] or {}
        seen = " / ".join(
            str(int(m[k])) if k in m else "-" for k in ("local_cache_hit", "external_kv_transfer", "local_compute")
        )
        lines.append(
            f"| {r['id']} | {r['scenario']} | {r['length']} | {e['local_cache_hit']} / {e['external_kv_transfer']} / "
            f"{e['local_compute']} | {seen} | {'ok' if r['exact'] else 'DIFFERENT'} |"
        )
    return lines


def known_upstream_line(failure: dict[str, Any], version: str | None) -> str | None:
    """configs/known_issues.yaml's line for a failure (its class, its log excerpt for a signature, the release); None
    when the list cannot be read (the run's report never fails on it)."""
    try:
        known = load_known()
    except ConfigError:  # a broken list costs the line, not the report
        return None
    text = f"{failure.get('excerpt') or ''}\n{failure.get('reason') or ''}"
    return known.line_for(cls=failure.get("class"), text=text, version=version)
