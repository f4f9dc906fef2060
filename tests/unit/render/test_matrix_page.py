"""The matrix page: one P TP x D TP grid per model and version, cells coloured by what each pair showed and linking
to its run's page; and the matrix's progress lines (pair i/N, an estimate from the pairs done)."""

import io
import re

from harness.core import progress
from harness.matrix.plan import PlannedPair
from harness.matrix.run import PairResult, run_matrix, write_matrix_report
from harness.render import matrix_page as matrix_html
from harness.run.config import E2EConfig


def pair(id_, tp, k=1, model="tiny-llama", expected="ok", run=True, predicted="ok"):
    return PlannedPair(
        id_,
        model,
        "cpu",
        tp[0],
        tp[1],
        k,
        "B",
        predicted,
        expected,
        "fixed",
        run,
        None if run else "a gpu entry; this run is on cpu",
    )


def results(tmp_path):
    m = tmp_path / "matrix"
    return m, [
        PairResult(pair("tiny-k1-p1-d2", (1, 2)), "0.32.0", "ok", True, str(m / "vllm-0.32.0" / "tiny-k1-p1-d2")),
        PairResult(
            pair("tiny-k1-p2-d1", (2, 1), expected="rejected"),
            "0.32.0",
            "rejected",
            True,
            str(m / "vllm-0.32.0" / "tiny-k1-p2-d1"),
        ),
        PairResult(
            pair("tiny-k1-p2-d2", (2, 2)),
            "0.32.0",
            "server-exited",
            False,
            str(m / "vllm-0.32.0" / "tiny-k1-p2-d2"),
            detail="decode: exited before it was ready",
        ),
        PairResult(pair("tiny-k2-p2-d1", (2, 1), k=2), "0.32.0", None, None),
        PairResult(
            pair("tiny-k1-p1-d2", (1, 2), expected="assert-45330"),
            "0.21.0",
            "assert-45330",
            True,
            str(m / "vllm-0.21.0" / "tiny-k1-p1-d2"),
        ),
    ]


def cells(page):
    """(grid title, tp_p, tp_d, classes, observed, link) of every filled cell, grid by grid."""
    out = []
    for title, grid in re.findall(
        r'<h2 class="grid-title">(.*?)</h2><div class="grid-wrap"[^>]*>(.*?)</table></div>', page
    ):
        for cls, tp_p, tp_d, inner in re.findall(
            r'<td class="cell ([^"]+)" data-tp-p="(\d+)" data-tp-d="(\d+)">(.*?)</td>', grid
        ):
            link = re.search(r'href="([^"]+)"', inner)
            found = re.search(r'data-observed="([^"]*)"', inner)
            assert found is not None, inner
            observed = found.group(1)
            out.append((title, int(tp_p), int(tp_d), cls, observed, link.group(1) if link else None))
    return out


def test_one_grid_per_model_and_version_cells_coloured_and_linked(tmp_path):
    m, rs = results(tmp_path)
    write_matrix_report(rs, ["0.32.0", "0.21.0"], m)
    page = (m / "report.html").read_text()
    got = cells(page)
    assert [g[0] for g in got] == ["tiny-llama (K=1, cpu) on vLLM 0.32.0"] * 3 + [
        "tiny-llama (K=2, cpu) on vLLM 0.32.0",
        "tiny-llama (K=1, cpu) on vLLM 0.21.0",
    ]
    by = {(g[0].split(" on vLLM ")[1], g[0].split(",")[0], g[1], g[2]): g[3:] for g in got}
    assert by[("0.32.0", "tiny-llama (K=1", 1, 2)] == ("o-ok", "ok", "vllm-0.32.0/tiny-k1-p1-d2/report.html")
    assert by[("0.32.0", "tiny-llama (K=1", 2, 1)] == (
        "o-rejected",
        "rejected",
        "vllm-0.32.0/tiny-k1-p2-d1/report.html",
    )
    assert by[("0.32.0", "tiny-llama (K=1", 2, 2)] == (
        "o-fail unexpected",
        "server-exited",
        "vllm-0.32.0/tiny-k1-p2-d2/report.html",
    )
    assert by[("0.32.0", "tiny-llama (K=2", 2, 1)] == ("o-skipped", "", None)  # not run: no link, grey
    assert by[("0.21.0", "tiny-llama (K=1", 1, 2)] == (
        "o-assert-45330",
        "assert-45330",
        "vllm-0.21.0/tiny-k1-p1-d2/report.html",
    )
    # the K=1 grid on 0.32.0 is 2 x 2 with one pair missing (P1 -> D1): an empty cell, not a made-up one
    grid = page[page.index("tiny-llama (K=1, cpu) on vLLM 0.32.0") :]
    grid = grid[: grid.index("</table>")]
    assert grid.count("<th>P TP") == 2 and grid.count("<th>D TP") == 2 and grid.count('class="empty"') == 1
    assert 'id="verdict">UNEXPECTED<' in page and "#45330 REPRODUCED on vLLM 0.21.0" in page
    assert page.isascii() and "<script" not in page


def test_a_matrix_in_progress_says_so(tmp_path):
    m, rs = results(tmp_path)
    write_matrix_report(rs[:1], ["0.32.0"], m, complete=False)
    page = (m / "report.html").read_text()
    assert "in progress: 1 pairs so far" in page and 'id="verdict">all as expected<' in page


def test_the_page_of_relative_folders_links_from_the_matrix_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    from pathlib import Path

    rel = Path("runs") / "x-matrix"
    r = PairResult(pair("tiny-k1-p1-d2", (1, 2)), "0.32.0", "ok", True, str(rel / "vllm-0.32.0" / "tiny-k1-p1-d2"))
    page = matrix_html.render_page({"pairs": [r.to_dict()], "versions": {}, "all_as_expected": True}, rel)
    assert cells(page)[0][5] == "vllm-0.32.0/tiny-k1-p1-d2/report.html"


def test_run_matrix_reports_pair_i_of_n_with_an_estimate_from_the_pairs_done(tmp_path, monkeypatch):
    out = io.StringIO()
    clock = [0.0]
    rep = progress.Progress(out, tty=False, ticker=False, clock=lambda: clock[0])
    old = progress.use(rep)
    monkeypatch.setattr("harness.matrix.run.model_for", lambda p, models: f"/models/k{p.kv_heads}")
    took = iter([120.0, 60.0, 90.0])

    def fake_run(cfg, cache):
        clock[0] += next(took)
        return {"verdict": "pass"}

    plans = {"0.32.0": [pair("a", (1, 1)), pair("b", (1, 2)), pair("gpu", (2, 2), run=False), pair("c", (2, 1))]}
    try:
        run_matrix(plans, {"0.32.0": "python"}, {}, E2EConfig(), tmp_path / "m", out=io.StringIO(), run_pair=fake_run)
    finally:
        progress.use(old)
    lines = [line.split("] ", 1)[1] for line in out.getvalue().splitlines()]
    assert lines == [
        "matrix pair 1/3: a on vLLM 0.32.0, P TP1 -> D TP1; no estimate before the first pair ends",
        "matrix pair 1/3: a done in 2 min 00 s",
        "matrix pair 2/3: b on vLLM 0.32.0, P TP1 -> D TP2; about 4 min 00 s left (median of 1 pair(s) done)",
        "matrix pair 2/3: b done in 1 min 00 s",
        "matrix pair 3/3: c on vLLM 0.32.0, P TP2 -> D TP1; about 1 min 30 s left (median of 2 pair(s) done)",
        "matrix pair 3/3: c done in 1 min 30 s",
    ]
    assert (tmp_path / "m" / "report.html").exists()
