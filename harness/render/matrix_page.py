"""report.html of a matrix: per model (and K) and vLLM version a grid of P TP x D TP, each cell coloured by what
the pair showed and linking to its run's own report.html; the #45330 line of each version on top.

Pure: rendered from the matrix's report.json dict; one static file, no network (the run page's CSS).
"""

from __future__ import annotations

import os
from pathlib import Path

from harness.render.run_page import esc, href, page

# Outcomes with a colour of their own; every other failure class is coloured as a failure.
OUTCOME_CLASS = {"ok": "o-ok", "assert-45330": "o-assert-45330", "rejected": "o-rejected"}
LEGEND = (
    ("o-ok", "ok: handshake passed, outputs match the baseline"),
    ("o-assert-45330", "assert-45330: the #45330 assertion"),
    ("o-rejected", "rejected at handshake (by design)"),
    ("o-fail", "another failure"),
    ("o-skipped", "not run here"),
    ("o-ok unexpected", "bold outline: not what the entry expects"),
)


def outcome_class(pair: dict) -> str:
    if pair.get("observed") is None:
        return "o-skipped"
    return OUTCOME_CLASS.get(pair["observed"], "o-fail")


def grids(pairs: list[dict]) -> dict[tuple, list[dict]]:
    """The pairs of each grid: (model, K, device, vLLM version), in the order they first appear."""
    out: dict[tuple, list[dict]] = {}
    for p in pairs:
        out.setdefault((p.get("model"), p.get("kv_heads"), p.get("device"), p.get("vllm_version")), []).append(p)
    return out


def _report_link(pair: dict, matrix_dir: Path) -> str | None:
    run_dir = pair.get("run_dir")
    if not run_dir:
        return None
    return href(str(Path(run_dir) / "report.html"), matrix_dir)


def _cell(pair: dict, matrix_dir: Path) -> str:
    observed = pair.get("observed")
    verdict = pair.get("verdict", "")
    lines = [f"<b>{esc(observed if observed is not None else 'not run')}</b>", esc(verdict)]
    if observed is None and pair.get("skip_reason"):
        lines[1] = esc(pair["skip_reason"])
    lines.append(
        f"<small>{esc(pair.get('id'))} &middot; regime {esc(pair.get('regime'))} "
        f"&middot; predicted {esc(pair.get('predicted'))}</small>"
    )
    inner = "<br>".join(lines)
    link = _report_link(pair, matrix_dir)
    if link:
        inner = f'<a href="{link}" title="this pair&#39;s run report">{inner}</a>'
    return f'<div class="pair" data-pair="{esc(pair.get("id"))}" data-observed="{esc(observed)}">{inner}</div>'


def grid_table(pairs: list[dict], matrix_dir: Path) -> str:
    tps_p = sorted({int(p["tp_p"]) for p in pairs})
    tps_d = sorted({int(p["tp_d"]) for p in pairs})
    head = "".join(f"<th>D TP{d}</th>" for d in tps_d)
    rows = []
    for tp_p in tps_p:
        cells = []
        for tp_d in tps_d:
            here = [p for p in pairs if int(p["tp_p"]) == tp_p and int(p["tp_d"]) == tp_d]
            if not here:
                cells.append('<td class="empty">&ndash;</td>')
                continue
            cls = outcome_class(here[0]) + (
                " unexpected" if any(p.get("verdict") == "UNEXPECTED" for p in here) else ""
            )
            cells.append(
                f'<td class="cell {cls}" data-tp-p="{tp_p}" data-tp-d="{tp_d}">'
                + "<hr>".join(_cell(p, matrix_dir) for p in here)
                + "</td>"
            )
        rows.append(f"<tr><th>P TP{tp_p}</th>{''.join(cells)}</tr>")
    return f'<table class="grid"><tr><th>P \\ D</th>{head}</tr>{"".join(rows)}</table>'


def render_page(data: dict, matrix_dir: Path) -> str:
    pairs = data.get("pairs") or []
    ran = [p for p in pairs if p.get("observed") is not None]
    unexpected = [p for p in ran if p.get("verdict") == "UNEXPECTED"]
    ok = bool(ran) and data.get("all_as_expected") and not unexpected
    verdict = "all as expected" if ok else ("UNEXPECTED" if unexpected else "nothing ran")
    state = "" if data.get("complete", True) else f" (in progress: {len(pairs)} pairs so far)"
    top = (
        f'<header class="top {"v-pass" if ok else "v-fail"}"><div class="inner"><h1>GQA-replication matrix '
        f'<span class="badge" id="verdict">{esc(verdict)}</span></h1>'
        f"<div>{len(ran)} of {len(pairs)} pairs ran; {len(unexpected)} unexpected{esc(state)}</div></div></header>"
    )
    lines = "".join(
        f'<li data-version="{esc(v)}"><b>{esc(line)}</b></li>' for v, line in (data.get("versions") or {}).items()
    )
    legend = "".join(f'<span class="{c}">{esc(t)}</span>' for c, t in LEGEND)
    body = [
        top,
        "<main>",
        f'<h2>#45330 by vLLM version</h2><ul id="version-lines">{lines}</ul>',
        f'<div class="legend">{legend}</div>',
    ]
    for (model, k, device, version), ps in grids(pairs).items():
        body.append(
            f'<h2 class="grid-title">{esc(model)} (K={esc(k)}, {esc(device)}) on vLLM {esc(version)}</h2>'
            f'<div class="grid-wrap" data-model="{esc(model)}" data-version="{esc(version)}">'
            f"{grid_table(ps, matrix_dir)}</div>"
        )
    body.append(_pair_table(pairs, matrix_dir))
    body.append("</main>")
    return page(f"GQA-replication matrix: {verdict}", "\n".join(body))


def _pair_table(pairs: list[dict], matrix_dir: Path) -> str:
    rows = []
    for p in pairs:
        link = _report_link(p, matrix_dir)
        run = (
            f'<a href="{link}">{esc(os.path.relpath(os.path.abspath(p["run_dir"]), os.path.abspath(matrix_dir)))}</a>'
            if link
            else esc(p.get("skip_reason") or "")
        )
        tol = f" (intermittent: {p['tolerated']})" if p.get("tolerated") else ""
        rows.append(
            f"<tr><td>{esc(p.get('vllm_version'))}</td><td>{esc(p.get('id'))}</td><td>{esc(p.get('kv_heads'))}</td>"
            f"<td>{esc(p.get('tp_p'))}&rarr;{esc(p.get('tp_d'))}</td><td>{esc(p.get('regime'))}</td><td>{esc(p.get('predicted'))}</td>"
            f"<td>{esc(p.get('expected'))}{esc(tol)}</td>"
            f'<td class="{outcome_class(p)}">{esc(p.get("observed") or "-")}</td>'
            f"<td>{esc(p.get('verdict'))}</td><td>{run}</td><td>{esc(p.get('detail'))}</td></tr>"
        )
    return (
        '<h2>Every pair</h2><table id="pairs"><tr><th>vLLM</th><th>id</th><th>K</th><th>P&rarr;D</th><th>regime</th>'
        "<th>predicted</th><th>expected</th><th>observed</th><th>verdict</th><th>run</th><th>detail</th></tr>"
        + "".join(rows)
        + "</table>"
    )
