"""The release history table: Markdown with every cell, where outcomes change, and a PNG heatmap."""

import json
import re

import pytest

from harness.core.errors import ConfigError
from harness.releases.history import Cell, Column, HistoryTable, colour, render_markdown, render_png
from harness.releases.history_cli import import_runs, importable_pairs
from harness.releases.store import ResultStore

VERSIONS = ["0.21.0", "0.22.0", "0.24.0", "0.27.0", "0.32.0"]
COLUMNS = [Column("tiny-k1-p1-d2", "K=1 P1→D2 regime B", "B"), Column("tiny-k1-p2-d2", "K=1 P2→D2 regime C", "C")]


def table() -> HistoryTable:
    t = HistoryTable(VERSIONS, COLUMNS, revision="abc123", command="python -m harness history ...", date="2026-12-04")
    outcomes: dict[str, list[str | None]] = {
        "tiny-k1-p1-d2": ["assert-45330", "assert-45330", "server-exited", "ok", "kv-lease-expired"],
        "tiny-k1-p2-d2": ["ok", "ok", "server-exited", "ok", None],
    }
    for entry, row in outcomes.items():
        for v, o in zip(VERSIONS, row, strict=False):
            if o is not None:
                t.cells[(v, entry)] = Cell(
                    o,
                    "store" if v == "0.21.0" else "run",
                    f"/runs/{entry}/{v}",
                    "ok" if v != "0.21.0" else ("assert-45330" if entry == "tiny-k1-p1-d2" else "ok"),
                    "detail" if o != "ok" else "",
                )
    return t


def test_markdown_has_a_row_per_release_and_a_cell_per_entry():
    md = render_markdown(table())
    assert "| vLLM | tiny-k1-p1-d2 (K=1 P1→D2 regime B) | tiny-k1-p2-d2 (K=1 P2→D2 regime C) |" in md
    assert "| 0.21.0 | assert-45330 · | ok · |" in md  # reused from the store
    assert "| 0.22.0 | assert-45330 ⚠ | ok |" in md  # the config's families expected ok of 0.22.0
    assert "| 0.24.0 | server-exited ⚠ | server-exited ⚠ |" in md
    assert "| 0.32.0 | kv-lease-expired ⚠ | not measured |" in md
    assert "![release history](history.png)" in md


def test_where_outcomes_change_skips_unmeasured_releases():
    t = table()
    assert t.boundaries("tiny-k1-p1-d2") == [
        "assert-45330 on 0.22.0 -> server-exited on 0.24.0",
        "server-exited on 0.24.0 -> ok on 0.27.0",
        "ok on 0.27.0 -> kv-lease-expired on 0.32.0",
    ]
    assert t.boundaries("tiny-k1-p2-d2") == [
        "ok on 0.22.0 -> server-exited on 0.24.0",
        "server-exited on 0.24.0 -> ok on 0.27.0",
    ]
    assert "- tiny-k1-p2-d2: ok on 0.22.0 -> server-exited on 0.24.0" in render_markdown(t)


def test_png_is_an_image_of_the_table(tmp_path):
    import matplotlib.image as mpimg

    path = tmp_path / "history.png"
    render_png(table(), path)
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    img = mpimg.imread(path)
    assert img.shape[0] > 200 and img.shape[1] > 400
    # the outcome colours are drawn: a red (assert-45330) and a green (ok) cell are in the picture
    rgb = (img[:, :, :3] * 255).round().astype(int).reshape(-1, 3).tolist()
    pixels = {tuple(p) for p in rgb}
    for outcome in ("assert-45330", "ok", "server-exited"):
        h = colour(outcome).lstrip("#")
        assert tuple(int(h[i : i + 2], 16) for i in (0, 2, 4)) in pixels, outcome


def test_matrix_reports_are_imported_into_the_store(tmp_path):
    report = tmp_path / "nightly" / "matrix" / "x" / "report.json"
    report.parent.mkdir(parents=True)
    report.write_text(
        json.dumps(
            {
                "pairs": [
                    {
                        "id": "tinyllama-p2-d8",
                        "vllm_version": "0.32.0",
                        "observed": "ok",
                        "expected": "ok",
                        "regime": "B",
                        "run_dir": "/r",
                        "detail": "",
                    },
                    {
                        "id": "qwen25-3b-p4-d2",
                        "vllm_version": "0.32.0",
                        "observed": None,
                        "expected": "rejected",
                        "regime": "D",
                    },
                ]
            }
        )
    )
    store = ResultStore(tmp_path / "store", revision="r1")
    assert import_runs(tmp_path / "nightly", store, "nightly") == 1
    got = store.get("tinyllama-p2-d8", "0.32.0")
    assert got is not None and got.outcome == "ok"
    assert store.get("qwen25-3b-p4-d2", "0.32.0") is None


def test_each_failure_seen_says_what_upstream_knows_of_it():
    t = table()
    t.cells[("0.24.0", "tiny-k1-p2-d2")] = Cell(
        "server-exited", "run", "/r", "ok", "All kv cache tensors must have the same number of blocks"
    )
    md = render_markdown(t).split("## Known upstream reports", 1)[1]
    assert "- tiny-k1-p1-d2 assert-45330 (0.21.0, 0.22.0): known upstream: #45330 (closed)" in md
    assert "- tiny-k1-p2-d2 server-exited (0.24.0): known upstream: #47816 (closed" in md
    assert "- tiny-k1-p1-d2 kv-lease-expired (0.32.0): no known upstream report as of 2026-12-05" in md


PAIR = {
    "id": "tinyllama-p2-d8",
    "vllm_version": "0.32.0",
    "observed": "ok",
    "expected": "ok",
    "regime": "B",
    "run_dir": "/r",
}


@pytest.mark.parametrize(
    "bad",
    [
        {"id": "../../../escaped"},
        {"vllm_version": "../../x"},
        {"id": "/tmp/abs"},
        {"vllm_version": "0.32.0/../../y"},
        {"id": None},
        {"observed": ["ok"]},
        {"detail": {"a": 1}},
    ],
)
def test_an_imported_pair_that_would_leave_the_store_is_refused_and_nothing_is_stored(tmp_path, bad):
    """All or nothing: one line naming the report and the pair, before any pair of the folder is stored."""
    report = tmp_path / "nightly" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"pairs": [PAIR, {**PAIR, "id": "second", **bad}]}))
    store = ResultStore(tmp_path / "store", revision="r1")
    with pytest.raises(ConfigError) as e:
        import_runs(tmp_path / "nightly", store, "nightly")
    assert "\n" not in str(e.value) and str(report) in str(e.value) and "pairs[1]" in str(e.value)
    assert not (tmp_path / "store").exists() and sorted(p.name for p in tmp_path.iterdir()) == ["nightly"]


@pytest.mark.parametrize(
    "text,said",
    [
        ("[1, 2]", "a JSON list"),
        ("not json", "not JSON"),
        ('{"pairs": 3}', "not a list"),
        ('{"pairs": [3]}', "pairs[0] is not a mapping"),
    ],
)
def test_a_report_of_another_shape_is_one_line(tmp_path, text, said):
    (tmp_path / "report.json").write_text(text)
    with pytest.raises(ConfigError, match=re.escape(said)):
        importable_pairs(tmp_path)


def test_import_runs_from_a_missing_folder_is_one_line(tmp_path):
    with pytest.raises(ConfigError, match="not a folder"):
        importable_pairs(tmp_path / "nope")
