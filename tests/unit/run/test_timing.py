"""The timing breakdown of a run's report (harness/run/timing.py) and `python -m harness bench e2e`, on synthetic
reports."""

import json

import pytest

from harness.cli import main as cli_main
from harness.run.timing import TARGET_HARNESS_SHARE, breakdown, render

# The keys harness/run/pipeline.py records, with lm-eval on both sides.
TIMINGS = {
    "baseline_launch_to_ready": 40.0,
    "baseline_requests": 10.0,
    "lm_eval_baseline": 100.0,
    "baseline_phase": 155.0,
    "prefill_launch_to_ready": 50.0,
    "decode_launch_to_ready": 60.0,
    "proxy_launch_to_ready": 2.0,
    "pd_requests": 12.0,
    "lm_eval_pd": 110.0,
    "pd_teardown": 3.0,
    "pd_phase": 190.0,
    "wall": 350.0,
}


def test_parallel_launches_count_once_and_the_rest_is_harness_time():
    b = breakdown(TIMINGS)
    assert b.external_s == pytest.approx(40 + 10 + 100 + 60 + 2 + 12 + 110 + 3)
    assert b.harness_own_s == pytest.approx(13.0)
    assert b.harness_own_share == pytest.approx(13 / 350)
    assert not b.within_target and TARGET_HARNESS_SHARE == 0.03
    items = {i.name: i for i in b.items}
    assert items["decode launch->ready"].counted_s == 60 and items["prefill launch->ready"].counted_s == 0
    assert b.by_category == pytest.approx(
        {"launch_to_ready": 102.0, "requests": 22.0, "evaluation": 210.0, "teardown": 3.0}
    )


def test_phase_remainders_are_the_harness_work_inside_each_phase():
    phases = {p.phase: p for p in breakdown(TIMINGS).phases}
    assert phases["baseline_phase"].remainder_s == pytest.approx(5.0)  # includes the unrecorded baseline teardown
    assert phases["pd_phase"].remainder_s == pytest.approx(3.0)
    # Everything outside the phases plus their remainders is the harness's own time: nothing counted twice.
    outside = TIMINGS["wall"] - TIMINGS["baseline_phase"] - TIMINGS["pd_phase"]
    assert breakdown(TIMINGS).harness_own_s == pytest.approx(outside + 5.0 + 3.0)


def test_baseline_teardown_is_counted_when_recorded():
    b = breakdown({**TIMINGS, "baseline_teardown": 4.0})
    assert b.by_category["teardown"] == pytest.approx(7.0) and b.harness_own_s == pytest.approx(9.0)
    assert not any("not recorded" in n for n in b.notes)
    assert any("not recorded" in n for n in breakdown(TIMINGS).notes)


def test_run_without_accuracy_or_with_a_reused_baseline():
    t = {k: v for k, v in TIMINGS.items() if not k.startswith(("lm_eval", "baseline"))}
    t["pd_phase"] = 80.0
    t["wall"] = 81.0
    b = breakdown(t)
    assert "evaluation" not in b.by_category and [p.phase for p in b.phases] == ["pd_phase"]
    assert b.harness_own_s == pytest.approx(81 - (60 + 2 + 12 + 3))


def test_failed_run_and_inconsistent_timings():
    with pytest.raises(ValueError, match="wall"):
        breakdown({"baseline_launch_to_ready": 3.0})
    b = breakdown({"baseline_launch_to_ready": 30.0, "wall": 31.0})
    assert b.harness_own_s == pytest.approx(1.0) and any("no phase timings" in n for n in b.notes)
    b = breakdown({**TIMINGS, "pd_phase": 100.0})
    assert any("pd_phase" in n and "more than the phase" in n for n in b.notes)


def test_to_dict_and_render():
    b = breakdown(TIMINGS)
    d = b.to_dict()
    assert {
        "wall_s",
        "items",
        "by_category_s",
        "phases",
        "external_s",
        "harness_own_s",
        "harness_own_share",
        "target_share",
        "within_target",
        "notes",
    } <= set(d)
    assert json.loads(json.dumps(d)) == d
    text = render(b, "runs/x/report.json")
    assert "harness own" in text and "MISSED" in text and "prefill launch->ready" in text


def test_bench_e2e_cli(tmp_path, capsys):
    report = tmp_path / "run" / "report.json"
    report.parent.mkdir()
    report.write_text(json.dumps({"verdict": "pass", "timings_s": TIMINGS}))
    assert cli_main(["bench", "e2e", "--run-dir", str(report.parent), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["report"] == str(report) and d["harness_own_s"] == pytest.approx(13.0)
    assert cli_main(["bench", "e2e", "--report", str(report)]) == 0
    assert "harness own" in capsys.readouterr().out
    assert cli_main(["bench", "e2e", "--report", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_staggered_gpu_launches_add_up():
    b = breakdown(TIMINGS, staggered=True)
    assert b.by_category["launch_to_ready"] == pytest.approx(40 + 50 + 60 + 2)
    assert b.harness_own_s == pytest.approx(13.0 - 50.0)  # such a report's pd_phase would be 50 s longer
    assert not any("start together" in n for n in b.notes)


def test_several_servers_per_role_overlap():
    t = {k: v for k, v in TIMINGS.items() if not k.startswith(("prefill", "decode"))}
    t.update(
        {
            "prefill[0]_launch_to_ready": 30.0,
            "prefill[1]_launch_to_ready": 45.0,
            "decode[0]_launch_to_ready": 60.0,
            "decode[1]_launch_to_ready": 20.0,
        }
    )
    b = breakdown(t)
    assert b.by_category["launch_to_ready"] == pytest.approx(40 + 60 + 2)
    assert len([i for i in b.items if i.category == "launch_to_ready"]) == 6


def test_bench_e2e_reads_the_stagger_flag(tmp_path, capsys):
    report = tmp_path / "report.json"
    report.write_text(json.dumps({"config": {"gpu_plan": {"stagger_start": True}}, "timings_s": TIMINGS}))
    assert cli_main(["bench", "e2e", "--report", str(report), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["by_category_s"]["launch_to_ready"] == pytest.approx(152.0)
