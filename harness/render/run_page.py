"""report.html of one run: verdict and failure class on top, the checks, the comparison with the first divergent
token of each diverged prompt highlighted in both texts, and a timeline of the run.

One static file that opens from disk with no network: inline CSS, the timeline an inline SVG, no script, no
font or image fetched. Pure: rendered from the report's dict (report.json), so any run folder can be
rendered again. ``page`` and ``esc`` serve the matrix page too.
"""

from __future__ import annotations

import html
import math
import os
import traceback
import urllib.parse
from pathlib import Path
from typing import Any

from harness.checks.check import failed_checks_reason
from harness.checks.kv_digest import location_in

CSS = """
body{font:14px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;
margin:0;color:#1f2328;background:#fff}
main{max-width:1200px;margin:0 auto;padding:0 20px 40px}
h1{font-size:22px;margin:0 0 6px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #d0d7de;padding-bottom:4px}
header.top{padding:16px 20px;color:#fff}header.top .inner{max-width:1200px;margin:0 auto}
.v-pass{background:#1a7f37}.v-fail{background:#cf222e}.v-interrupted{background:#9a6700}
.badge{display:inline-block;font-weight:700;padding:2px 10px;border-radius:12px;background:#fff;letter-spacing:.04em}
.v-pass .badge{color:#1a7f37}.v-fail .badge{color:#cf222e}.v-interrupted .badge{color:#9a6700}
.reason{margin-top:6px;white-space:pre-wrap}.meta{color:#57606a;margin:10px 0}.meta span{margin-right:16px}
table{border-collapse:collapse;margin:6px 0;width:100%}
th,td{border:1px solid #d0d7de;padding:4px 8px;text-align:left;vertical-align:top}
th{background:#f6f8fa}tr.pass td.res{color:#1a7f37;font-weight:600}tr.fail td.res{color:#cf222e;font-weight:700}
tr.fail{background:#ffebe9}tr.skip td.res{color:#57606a}
.st-exact{color:#1a7f37}.st-tolerated{color:#9a6700;font-weight:600}.st-mismatch{color:#cf222e;font-weight:700}
pre{background:#f6f8fa;border:1px solid #d0d7de;padding:8px;overflow:auto;white-space:pre-wrap;word-break:break-word}
.diverged{border:1px solid #d0d7de;border-left:4px solid #cf222e;padding:6px 10px;margin:10px 0}
.diverged.tolerated{border-left-color:#9a6700}
.side{display:grid;grid-template-columns:90px 1fr;gap:4px 10px;margin:4px 0}.side .who{color:#57606a;font-weight:600}
.text{font-family:ui-monospace,"DejaVu Sans Mono",monospace;white-space:pre-wrap;word-break:break-word;
background:#f6f8fa;padding:3px 6px}
mark.div-token{background:#ffd33d;color:#1f2328;outline:2px solid #bf8700;border-radius:2px;padding:0 1px}
.after{color:#8c959f}.note{color:#57606a;font-style:italic}
.grid{border-collapse:collapse;width:auto;margin:8px 0 18px}
.grid td,.grid th{text-align:center;min-width:120px}.grid td{height:54px}
.grid td a{color:inherit;text-decoration:none;display:block}.grid td a:hover{text-decoration:underline}
.o-ok{background:#dafbe1}.o-assert-45330{background:#ffd8b5}.o-rejected{background:#ddf4ff}.o-fail{background:#ffcecb}
.o-skipped{background:#eaeef2;color:#57606a}.unexpected{outline:3px solid #1f2328;outline-offset:-3px;font-weight:700}
.legend span{display:inline-block;padding:2px 8px;margin:2px 6px 2px 0;border:1px solid #d0d7de}
"""

VERDICT_CLASS = {"pass": "v-pass", "fail": "v-fail", "interrupted": "v-interrupted"}
# timeline bar colours by kind of step
KIND_COLOUR = {
    "phase": "#d0d7de",
    "launch": "#0969da",
    "requests": "#1a7f37",
    "evaluation": "#8250df",
    "teardown": "#bc4c00",
    "setup": "#6e7781",
}


def esc(x: Any) -> str:
    return html.escape("" if x is None else str(x), quote=True)


def page(title: str, body: str) -> str:
    """A whole document; non-ASCII characters become references, so the file reads the same in any encoding."""
    doc = (
        f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f'<meta name="viewport" content="width=device-width, initial-scale=1"><title>{esc(title)}</title>'
        f"<style>{CSS}</style></head><body>\n{body}\n</body></html>\n"
    )
    return doc.encode("ascii", "xmlcharrefreplace").decode("ascii")


def tp_text(value: object) -> str:
    """A TP size of a report's config for people: "TP2", or "TP unknown (not served)"."""
    return f"TP{value}" if isinstance(value, int) else f"TP {value}"


def href(path: str, base: Path) -> str:
    """A link to ``path`` that works from the page's folder ``base``: relative under it, else a file:// address.
    A relative ``path`` is taken from the current folder, as the run that wrote it had it."""
    target, root = os.path.abspath(path), os.path.abspath(base)
    rel = os.path.relpath(target, root)
    if rel == ".." or rel.startswith(".." + os.sep):
        return esc(Path(target).as_uri())
    return esc(urllib.parse.quote(rel))


def render_page(d: dict, run_dir: Path) -> str:
    """report.html of one run. A rendering error still gives a page with the verdict and the error (never no page)."""
    cfg = d.get("config") or {}
    tps = f"P {tp_text(cfg.get('tp_p'))} -> D {tp_text(cfg.get('tp_d'))}"
    title = f"P/D run {tps}: {str(d.get('verdict', '?')).upper()}"
    try:
        body = _body(d, run_dir)
    except Exception:
        body = (
            _header(d) + "<main><h2>This page could not be rendered in full</h2>"
            "<p>See report.json and report.md beside it.</p>"
            f'<pre id="render-error">{esc(traceback.format_exc())}</pre></main>'
        )
    return page(title, body)


def _body(d: dict, run_dir: Path) -> str:
    parts = [
        _header(d),
        "<main>",
        _meta(d),
        _checks(d),
        _failure(d),
        _comparison(d),
        _accuracy(d),
        _timeline(d),
        _breakdown(d),
        _details(d, run_dir),
        "</main>",
    ]
    return "\n".join(p for p in parts if p)


def _header(d: dict) -> str:
    cfg = d.get("config") or {}
    verdict = str(d.get("verdict", "fail"))
    fail = d.get("failure") or {}
    cls = f'<div>failure class: <b id="failure-class">{esc(fail.get("class"))}</b></div>' if fail else ""
    reason = _reason(d)
    if where := location_in(d.get("checks") or []):
        reason += f'<div class="reason" id="kv-digest-location">{esc(where)}</div>'
    if d.get("known_upstream"):
        reason += f'<div class="reason" id="known-upstream">{esc(d["known_upstream"])}</div>'
    return (
        f'<header class="top {VERDICT_CLASS.get(verdict, "v-fail")}"><div class="inner">'
        f"<h1>P/D run: P {esc(tp_text(cfg.get('tp_p')))} &rarr; D {esc(tp_text(cfg.get('tp_d')))} "
        f'<span class="badge" id="verdict">{esc(verdict.upper())}</span></h1>{cls}{reason}</div></header>'
    )


HEADLINE_CUT = ("; mismatched: ", "; over it: ")  # where a failed check's detail turns into a list of request ids


def _reason(d: dict) -> str:
    """The banner leads with each failed check's counts and first divergence; the request ids stay folded. A run that
    failed otherwise (an exception: a network fault, a dead server) leads with its own reason, even where a check
    made after it (P's blocks after a fault) failed too."""
    if not d.get("reason"):
        return ""
    failed = [c for c in d.get("checks") or [] if not c.get("passed")]
    if d["reason"] != failed_checks_reason((c.get("name"), c.get("detail")) for c in failed):
        failed = []  # the reason is not the failed checks' (run/failures.py from_checks)
    heads = []
    for c in failed:
        detail = str(c.get("detail") or "")
        for cut in HEADLINE_CUT:
            detail = detail.split(cut)[0]
        heads.append(f"{c.get('name')}: {detail}")
    short = "\n".join(heads) if heads else str(d["reason"])
    if short == d["reason"] or len(str(d["reason"])) <= 300:
        return f'<div class="reason" id="reason">{esc(d["reason"])}</div>'
    return (
        f'<div class="reason" id="reason">{esc(short)}</div><details class="reason"><summary>the whole reason, '
        f"with every request id ({len(str(d['reason']))} characters)</summary>{esc(d['reason'])}</details>"
    )


def _meta(d: dict) -> str:
    cfg, ver = d.get("config") or {}, d.get("versions") or {}
    topo = cfg.get("topology") or {}
    heads = cfg.get("model_heads") or {}
    items = [
        ("model", cfg.get("served_model_name") or cfg.get("resolved_model") or cfg.get("model")),
        ("device", cfg.get("device")),
        ("vLLM", ver.get("vllm")),
        ("NIXL", ver.get("nixl")),
        ("KV heads", heads.get("kv_heads")),
        ("regime", topo.get("regime")),
        ("proxy fault", cfg.get("proxy_fault") if cfg.get("proxy_fault") not in (None, "none") else None),
        (
            "wall",
            f"{(d.get('timings_s') or {}).get('wall', 0):.1f} s" if (d.get("timings_s") or {}).get("wall") else None,
        ),
    ]
    return (
        '<div class="meta">'
        + "".join(f"<span>{esc(k)}: <b>{esc(v)}</b></span>" for k, v in items if v is not None)
        + "</div>"
    )


def _checks(d: dict) -> str:
    rows = []
    for c in d.get("checks") or []:
        ok = bool(c.get("passed"))
        rows.append(
            f'<tr class="{"pass" if ok else "fail"}"><td>{esc(c.get("name"))}</td>'
            f'<td class="res">{"pass" if ok else "FAIL"}</td>'
            f"<td>{esc(c.get('detail'))}</td></tr>"
        )
    for c in d.get("skipped_checks") or []:
        rows.append(
            f'<tr class="skip"><td>{esc(c.get("name"))}</td><td class="res">not checked</td>'
            f"<td>{esc(c.get('reason'))}</td></tr>"
        )
    if not rows:
        return '<h2>Checks</h2><p class="note">No check ran.</p>'
    return (
        '<h2>Checks</h2><table id="checks"><tr><th>check</th><th>result</th><th>detail</th></tr>'
        + "".join(rows)
        + "</table>"
    )


def _failure(d: dict) -> str:
    f = d.get("failure")
    if not f:
        return ""
    src = f" in <b>{esc(f.get('source'))}</b>" if f.get("source") else ""
    excerpt = f'<pre id="failure-excerpt">{esc(f.get("excerpt"))}</pre>' if f.get("excerpt") else ""
    return f"<h2>Failure</h2><p>class <b>{esc(f.get('class'))}</b>{src}: {esc(f.get('reason'))}</p>{excerpt}"


def _marked(text: str, span: list[int] | None) -> str:
    """The text with the divergent token in a <mark>; what follows it is dimmed (greedy continuations differ after
    it)."""
    if span is None:
        return f'<span class="text">{esc(text)}</span>'
    s, e = span
    token = text[s:e]
    inner = esc(token) if token else "&#8709;"  # an empty mark: the completion ended here, or the token has no text
    title = (
        "first divergent token"
        if token
        else "first divergent token: no text here (the completion ended, or the token has none)"
    )
    return (
        f'<span class="text">{esc(text[:s])}<mark class="div-token" title="{title}">{inner}</mark>'
        f'<span class="after">{esc(text[e:])}</span></span>'
    )


def _comparison(d: dict) -> str:
    comp = d.get("comparison")
    if not comp:
        return ""
    tokens = comp.get("prompt_tokens") or {}
    rows = []
    for p in comp.get("prompts") or []:
        div = p.get("divergence")
        dtxt = (
            ""
            if not div
            else (
                f"token {div.get('position')}: baseline {div.get('baseline_token')} vs P/D "
                f"{div.get('pd_token')} ({div.get('reason')})"
            )
        )
        pid = p.get("prompt_id")
        link = f'<a href="#div-{esc(pid)}">{esc(pid)}</a>' if div else esc(pid)
        rows.append(
            f'<tr><td>{link}</td><td>{esc(tokens.get(pid, ""))}</td><td class="st-{esc(p.get("status"))}">'
            f"{esc(p.get('status'))}</td><td>{esc(p.get('compared_tokens'))}</td><td>{esc(dtxt)}</td></tr>"
        )
    out = [f'<h2>Comparison with the baseline</h2><p id="comparison-summary">{esc(comp.get("summary"))}</p>']
    diverged = [p for p in comp.get("prompts") or [] if p.get("divergence")]
    diverged.sort(key=lambda p: p.get("status") != "mismatch")
    spans, texts = comp.get("token_spans") or {}, comp.get("texts") or {}
    if diverged:
        out.append(f"<h3>First divergent token of each diverged prompt ({len(diverged)})</h3>")
        if comp.get("token_spans_note"):
            out.append(f'<p class="note">Not highlighted: {esc(comp["token_spans_note"])}</p>')
    for p in diverged:
        pid, div = p.get("prompt_id"), p["divergence"]
        sp, tx = spans.get(pid) or {}, texts.get(pid) or {}
        sides = []
        for side, who, tok in (("baseline", "baseline", div.get("baseline_token")), ("pd", "P/D", div.get("pd_token"))):
            text = tx.get(side)
            body = '<span class="note">no answer</span>' if text is None else _marked(text, sp.get(side))
            sides.append(
                f'<div class="who">{who}</div><div class="side-text" data-side="{side}">{body}'
                f' <span class="note">(token id {esc(tok)})</span></div>'
            )
        unmarked = [s for s in ("baseline", "pd") if tx.get(s) is not None and not sp.get(s)]
        why = ""
        if unmarked and not comp.get("token_spans_note"):
            why = (
                '<p class="note">The token&#39;s place in the text is not shown where '
                "the model&#39;s tokenizer does not "
                "reproduce the server&#39;s text exactly.</p>"
            )
        out.append(
            f'<div class="diverged {esc(p.get("status"))}" id="div-{esc(pid)}" data-prompt="{esc(pid)}">'
            f'<b>{esc(pid)}</b> <span class="st-{esc(p.get("status"))}">{esc(p.get("status"))}</span> at token '
            f'{esc(div.get("position"))}: {esc(div.get("reason"))}<div class="side">{"".join(sides)}</div>{why}</div>'
        )
    out.append(
        f"<details{' open' if not diverged else ''}><summary>Every prompt ({len(rows)})</summary>"
        '<table id="prompts"><tr><th>prompt</th><th>prompt tokens</th><th>status</th><th>compared tokens</th>'
        "<th>divergence</th></tr>" + "".join(rows) + "</table></details>"
    )
    return "\n".join(out)


def _accuracy(d: dict) -> str:
    a = d.get("accuracy")
    if not a:
        return ""
    cells = [
        a.get("samples"),
        f"{a.get('baseline_score', 0):.3f}",
        f"{a.get('pd_score', 0):.3f}",
        f"{a.get('delta', 0):+.3f}",
        f"{a.get('tolerance', 0):.3f}",
        a.get("differing_responses"),
        a.get("score_flips"),
    ]
    return (
        f"<h2>Accuracy ({esc(a.get('task'))}, lm-eval {esc(a.get('lm_eval'))})</h2>"
        '<table id="accuracy"><tr><th>samples</th>'
        "<th>baseline</th><th>P/D</th><th>delta</th><th>tolerance</th>"
        "<th>differing responses</th><th>score flips</th></tr>"
        "<tr>" + "".join(f"<td>{esc(c)}</td>" for c in cells) + "</tr></table>"
    )


def tick_step(total: float, target: int = 8) -> float:
    """A round axis step giving about ``target`` ticks over ``total`` seconds."""
    for step in (0.5, 1, 2, 5, 10, 15, 30, 60, 120, 300, 600, 900, 1800, 3600):
        if total / step <= target:
            return step
    return 3600 * math.ceil(total / 3600 / target)


def timeline_svg(events: list[dict], wall: float | None = None) -> str:
    """The run's steps as bars on one time axis (seconds from the run's start), one row each, in start order."""
    evs = sorted(events, key=lambda e: (e["start_s"], e.get("kind") != "phase", -e["end_s"]))
    total = max([wall or 0.0] + [e["end_s"] for e in evs]) or 1.0
    label_w, chart_w, row_h, top = 250, 760, 20, 24
    x = lambda s: label_w + chart_w * max(0.0, s) / total  # noqa: E731
    h = top + row_h * len(evs) + 10
    out = [
        f'<svg id="timeline-svg" xmlns="http://www.w3.org/2000/svg" width="{label_w + chart_w + 70}" height="{h}" '
        f'role="img" font-family="sans-serif" font-size="12"><title>timeline of the run</title>'
    ]
    step = tick_step(total)
    t = 0.0
    while t <= total + 1e-9:
        out.append(
            f'<line x1="{x(t):.1f}" y1="{top - 6}" x2="{x(t):.1f}" y2="{h - 6}" stroke="#eaeef2"/>'
            f'<text x="{x(t):.1f}" y="{top - 10}" text-anchor="middle" fill="#57606a">{t:g} s</text>'
        )
        t += step
    for i, e in enumerate(evs):
        y = top + i * row_h
        w = max(1.5, x(e["end_s"]) - x(e["start_s"]))
        colour = KIND_COLOUR.get(e.get("kind") or "", "#6e7781")
        failed = e.get("ok") is False
        stroke = ' stroke="#cf222e" stroke-width="2"' if failed else ""
        indent = 0 if e.get("kind") == "phase" else 12
        label = f"{e['name']}{' (failed)' if failed else ''}"
        bold = "" if indent else ' font-weight="bold"'
        out.append(
            f'<g class="ev" data-kind="{esc(e.get("kind"))}">'
            f'<text x="{4 + indent}" y="{y + 14}"{bold}>{esc(label)}</text>'
            f'<rect x="{x(e["start_s"]):.1f}" y="{y + 3}" width="{w:.1f}" height="{row_h - 6}" rx="2" '
            f'fill="{colour}"{stroke}>'
            f"<title>{esc(e['name'])}: {e['start_s']:.1f} s to {e['end_s']:.1f} s</title></rect>"
            f'<text x="{x(e["start_s"]) + w + 4:.1f}" y="{y + 14}" '
            f'fill="#57606a">{e["end_s"] - e["start_s"]:.1f} s</text></g>'
        )
    out.append("</svg>")
    return "".join(out)


def _timeline(d: dict) -> str:
    events = d.get("events")
    timings = d.get("timings_s") or {}
    legend = "".join(f'<span style="border-left:12px solid {c}">{k}</span>' for k, c in KIND_COLOUR.items())
    if events:
        return (
            f'<h2>Timeline</h2><div class="legend">{legend}</div>'
            f'<div id="timeline">{timeline_svg(events, timings.get("wall"))}</div>'
        )
    if not timings:
        return ""
    # A report written before steps were recorded with their start: durations only, said so.
    evs = [
        {
            "name": k,
            "kind": "phase" if k.endswith("_phase") or k == "wall" else "launch",
            "start_s": 0.0,
            "end_s": float(v),
        }
        for k, v in timings.items()
    ]
    return (
        "<h2>Timeline</h2>"
        '<p class="note">This report has durations but no start times; the bars below all start at 0.</p>'
        f'<div id="timeline">{timeline_svg(evs)}</div>'
    )


def _breakdown(d: dict) -> str:
    tb = d.get("timing_breakdown")
    if not tb:
        return ""
    rows = "".join(
        f"<tr><td>{esc(k)}</td><td>{v:.1f} s</td>"
        f"<td>{100 * v / tb['wall_s'] if tb.get('wall_s') else 0:.1f} %</td></tr>"
        for k, v in (tb.get("by_category_s") or {}).items()
    )
    own = (
        f"<tr><td><b>harness&#39;s own</b></td><td>{tb.get('harness_own_s', 0):.1f} s</td>"
        f"<td>{100 * tb.get('harness_own_share', 0):.1f} % (target {100 * tb.get('target_share', 0):.0f} %)</td></tr>"
    )
    notes = "".join(f'<p class="note">{esc(n)}</p>' for n in tb.get("notes") or [])
    return (
        f'<h2>Where the time went (wall {tb.get("wall_s", 0):.1f} s)</h2><table id="breakdown" style="width:auto">'
        f"<tr><th>category</th><th>seconds</th><th>share</th></tr>{rows}{own}</table>{notes}"
    )


def _details(d: dict, run_dir: Path) -> str:
    import json

    logs = "".join(
        f'<li>{esc(k)}: <a href="{href(v, run_dir)}">{esc(v)}</a></li>' for k, v in (d.get("logs") or {}).items()
    )
    cmds = "".join(f"<li>{esc(k)}: <code>{esc(v)}</code></li>" for k, v in (d.get("commands") or {}).items())
    vers = "".join(f"<li>{esc(k)}: {esc(v)}</li>" for k, v in (d.get("versions") or {}).items())
    return (
        f"<h2>Logs</h2><ul>{logs}</ul>"
        f"<details><summary>Versions</summary><ul>{vers}</ul></details>"
        f"<details><summary>Commands</summary><ul>{cmds}</ul></details>"
        "<details><summary>Configuration</summary>"
        f"<pre>{esc(json.dumps(d.get('config') or {}, indent=2, default=str))}</pre></details>"
        '<p class="note">report.json and report.md beside this page hold the same run.</p>'
    )
