"""report.md: a run's report for people, pure over its dict (report.json)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from harness.checks.kv_digest import location_in
from harness.core.errors import ConfigError
from harness.render.run_page import tp_text
from harness.upstream.known import load_known


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


def difference_line(setting: str, baseline: str, servers: Mapping[str, str]) -> str:
    """One setting in which the baseline differs from attached servers, with their values by server name."""
    named = ", ".join(f"{n} {v}" for n, v in servers.items())
    return f"{setting}: the baseline {baseline}; {named}"


def attach_markdown(attach: Mapping[str, Any] | None, config: Mapping[str, Any]) -> list[str]:
    """report.md's section on the attached servers: their TP as known, and where the baseline differs from them."""
    if not attach or "differences" not in attach:
        return []
    sources = attach.get("sources") or {}
    lines = ["", "## Attached servers and the baseline", ""]
    for name, who in (("tp_p", "P"), ("tp_d", "D")):
        lines.append(f"- {who}'s TP: {config.get(name)} ({sources.get(name, 'not recorded')})")
    lines.append(f"- the baseline's TP: {sources.get('baseline_tp', 'not recorded')}")
    lines += ["", "Settings in which the baseline differs from the attached servers:", ""]
    diffs = attach.get("differences") or []
    lines += [f"- {difference_line(d['setting'], d['baseline'], d['servers'])}" for d in diffs] or ["- none"]
    if attach.get("not_compared"):
        lines += ["", "Not compared:", ""] + [f"- {line}" for line in attach["not_compared"]]
    return lines
