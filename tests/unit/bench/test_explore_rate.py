"""`python -m harness bench explore` (harness/bench/explore_rate.py) on a synthetic explore folder: explore.json
written by the explore's own results class, report.json files whose timings give known figures."""

import json
from pathlib import Path

import pytest

from harness.bench.explore_rate import explore_rate, render
from harness.cli import build_parser
from harness.cli import main as cli_main
from harness.explore.results import Results, SampleResult

# Sample a: launch 100 (P 100 and D 80 start together), requests 30, lm-eval 40, teardown 10; 200 s on the explore's
# clock, so 20 s harness (15 s inside the run, 5 s around it). Kept servers would save P/D launch + teardown: 110 s.
TIMINGS_A = {
    "prefill_launch_to_ready": 100.0,
    "decode_launch_to_ready": 80.0,
    "pd_requests": 30.0,
    "lm_eval_pd": 40.0,
    "pd_teardown": 10.0,
    "pd_phase": 185.0,
    "wall": 195.0,
}
# Sample b: launch 20 (baseline) + 30 (P and D tie: counted once), requests 10 + 10, teardown 5; 100 s, so 25 s
# harness. Kept servers save 30 + 5 s; the baseline's launch stays in.
TIMINGS_B = {
    "baseline_launch_to_ready": 20.0,
    "baseline_requests": 10.0,
    "baseline_phase": 35.0,
    "prefill_launch_to_ready": 30.0,
    "decode_launch_to_ready": 30.0,
    "pd_requests": 10.0,
    "pd_teardown": 5.0,
    "pd_phase": 50.0,
    "wall": 95.0,
}


def sample(sid: str, status: str, seconds: float, run_dir: Path | None) -> SampleResult:
    return SampleResult(
        {"id": sid}, {"model": "tiny"}, "0.32.0", status, run_dir=str(run_dir) if run_dir else None, seconds=seconds
    )


def run_folder(root: Path, name: str, report: str | None) -> Path:
    d = root / "samples" / name
    d.mkdir(parents=True)
    if report is not None:
        (d / "report.json").write_text(report)
    return d


@pytest.fixture
def explore_dir(tmp_path: Path) -> Path:
    a = run_folder(tmp_path, "a", json.dumps({"timings_s": TIMINGS_A}))
    b = run_folder(tmp_path, "b", json.dumps({"timings_s": TIMINGS_B}))
    c = run_folder(tmp_path, "c", None)  # the run died before writing its report
    d = run_folder(tmp_path, "d", "{not json")
    samples = [
        sample("a", "ran", 200.0, a),
        sample("b", "ran", 100.0, b),
        sample("c", "ran", 100.0, c),
        sample("d", "ran", 60.0, d),
        sample("e", "skipped", 0.5, None),
    ]
    Results(tmp_path / "explore.json", 7, "0.32.0", samples).save()
    return tmp_path


def test_rate_counts_ran_samples_over_their_time_and_states_the_cores(explore_dir):
    r = explore_rate(explore_dir, cpus=8)
    assert (r.ran, r.skipped) == (4, 1)
    assert r.ran_seconds == pytest.approx(460.0) and r.skipped_seconds == pytest.approx(0.5)
    assert r.per_hour == pytest.approx(3600 * 4 / 460)
    assert r.per_cpu_hour == pytest.approx(3600 * 4 / 460 / 8) and r.cpus == 8


def test_categories_share_the_sample_time_and_the_largest_bounds_it(explore_dir):
    r = explore_rate(explore_dir, cpus=8)
    assert [t.sample for t in r.timed] == ["a", "b"] and r.timed_s == pytest.approx(300.0)
    assert r.category_s == pytest.approx(
        {"launch_to_ready": 150.0, "requests": 50.0, "evaluation": 40.0, "teardown": 15.0, "harness": 45.0}
    )
    assert sum(r.shares.values()) == pytest.approx(1.0) and r.shares["launch_to_ready"] == pytest.approx(0.5)
    assert r.bound_by == "launch_to_ready"


def test_projection_leaves_out_pd_launch_and_teardown_but_keeps_the_baseline(explore_dir):
    r = explore_rate(explore_dir, cpus=8)
    assert r.kept_servers_saving_s == pytest.approx(110.0 + 35.0)
    assert r.projected_kept_servers_per_hour == pytest.approx(3600 * 2 / (300 - 145))
    projected = r.projected_kept_servers_per_hour
    assert projected is not None and projected > 3600 * 2 / 300


def test_missing_and_unreadable_reports_are_counted_and_listed(explore_dir):
    r = explore_rate(explore_dir, cpus=8)
    why = {m.sample: m.why for m in r.missing}
    assert set(why) == {"c", "d"}
    assert why["c"] == "report.json missing" and why["d"].startswith("report.json unreadable")
    text = render(r)
    assert "2 ran sample(s) without a usable report.json" in text and "- c (" in text and "- d (" in text


def test_a_ran_sample_without_a_run_folder_or_timings_is_listed(tmp_path):
    run = run_folder(tmp_path, "x", json.dumps({"verdict": "pass"}))
    Results(
        tmp_path / "explore.json", 1, "0.32.0", [sample("x", "ran", 10.0, run), sample("y", "ran", 5.0, None)]
    ).save()
    r = explore_rate(tmp_path, cpus=2)
    assert {m.sample: m.why for m in r.missing} == {
        "x": "report.json unusable: report.json has no timings_s",
        "y": "no run folder recorded",
    }
    assert (
        r.bound_by is None and r.projected_kept_servers_per_hour is None and r.per_hour == pytest.approx(3600 * 2 / 15)
    )


def test_staggered_launches_add_up(tmp_path):
    run = run_folder(tmp_path, "s", json.dumps({"timings_s": TIMINGS_A, "config": {"gpu_plan": {"stagger_start": 1}}}))
    Results(tmp_path / "explore.json", 1, "0.32.0", [sample("s", "ran", 300.0, run)]).save()
    r = explore_rate(tmp_path, cpus=2)
    assert r.category_s["launch_to_ready"] == pytest.approx(180.0) and r.kept_servers_saving_s == pytest.approx(190.0)


def test_cli_parses_dir_and_json():
    a = build_parser().parse_args(["bench", "explore", "--dir", "runs/x", "--json"])
    assert (a.cmd, a.bench_cmd, a.dir, a.json) == ("bench", "explore", Path("runs/x"), True)
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["bench", "explore"])
    assert e.value.code == 2


def test_cli_text_and_json(explore_dir, capsys):
    assert cli_main(["bench", "explore", "--dir", str(explore_dir), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["ran"] == 4 and d["bound_by"] == "launch_to_ready" and len(d["missing_reports"]) == 2
    assert d["projected_kept_servers_per_hour"] == pytest.approx(3600 * 2 / 155)
    assert cli_main(["bench", "explore", "--dir", str(explore_dir)]) == 0
    out = capsys.readouterr().out
    assert "samples/hour" in out and "<- bounds it" in out and "projection, not a measurement" in out


def test_a_folder_without_explore_json_is_a_one_line_error(tmp_path, capsys):
    assert cli_main(["bench", "explore", "--dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no explore.json" in err and str(tmp_path) in err
    (tmp_path / "explore.json").write_text("[]")
    assert cli_main(["bench", "explore", "--dir", str(tmp_path)]) == 2
    assert "not an explore results file" in capsys.readouterr().err
