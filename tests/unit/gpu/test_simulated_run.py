"""A run on a simulated GPU box (harness/run/simulated.py, harness/run/report.py): the data-path checks become skipped
ones with the reason "simulated GPUs", never passed ones; the report says the run was simulated."""

from __future__ import annotations

from pathlib import Path

from harness.accuracy.settings import AccuracySettings
from harness.checks.check import Check
from harness.gpu.run import GpuRun
from harness.render.run_markdown import render_markdown, simulated_note
from harness.run import simulated
from harness.run.config import E2EConfig
from harness.run.context import RunContext
from harness.run.report import Report
from harness.simbox.box import SIMULATED_ENV
from harness.workload.client import GenerationSettings

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def ctx_on(monkeypatch, box: str | None, accuracy: bool = False) -> RunContext:
    if box:
        monkeypatch.setenv(SIMULATED_ENV, box)
    else:
        monkeypatch.delenv(SIMULATED_ENV, raising=False)
    from tests.unit.gpu.fake_nvml import FakeNvml, gpus

    gpu = GpuRun(2, 8, TINYLLAMA) if box else GpuRun(2, 8, TINYLLAMA, nvml=FakeNvml([gpus(8)]))
    cfg = E2EConfig(device="gpu", model=TINYLLAMA)
    rep = Report(config={"gpu_plan": gpu.plan.to_dict()})
    rep.checks = [
        Check("all_requests_answered", True, "18/18"),
        Check("outputs_match_baseline", True, "18 exact"),
        Check("nixl_transfers_counted", False, "no nixl"),
        Check("smoke_capital_of_france", False, "no Paris"),  # a stand-in's answer: not a data-path verdict
        Check("no_process_left", True, "ok"),
        Check("gpu_free_before_pd", True, "ok"),
    ]
    rep.comparison, rep.load = {"summary": "18 exact"}, {"requests": 4}
    ctx = RunContext(
        cfg, Path("/runs/x"), rep, [], GenerationSettings(), model=TINYLLAMA, served_name=TINYLLAMA, gpu=gpu
    )
    if accuracy:
        ctx.accuracy = AccuracySettings(task="gsm8k")
    return ctx


def test_data_path_checks_are_skipped_never_passed(monkeypatch):
    ctx = ctx_on(monkeypatch, "8x80", accuracy=True)
    simulated.apply(ctx)
    rep = ctx.report
    assert [c.name for c in rep.checks] == ["all_requests_answered", "no_process_left", "gpu_free_before_pd"]
    skipped = {s["name"]: s["reason"] for s in rep.skipped_checks}
    assert {
        "outputs_match_baseline",
        "nixl_transfers_counted",
        "smoke_capital_of_france",
        "accuracy_pd_within_tolerance",
    } <= set(skipped)
    assert all(r.startswith("simulated GPUs (PD_HARNESS_SIMULATED_GPUS=8x80)") for r in skipped.values())
    assert rep.comparison is None and rep.load is None and rep.verdict == "pass"
    d = rep.to_dict()
    assert d["simulated"].startswith("SIMULATED GPUs (PD_HARNESS_SIMULATED_GPUS=8x80)")
    assert f"{len(rep.config['simulated_gpus']['checks_skipped'])} data-path checks skipped" in d["simulated"]
    assert d["simulated"] in render_markdown(d)


def test_a_real_box_is_left_alone(monkeypatch):
    ctx = ctx_on(monkeypatch, None)
    simulated.apply(ctx)
    assert len(ctx.report.checks) == 6 and ctx.report.comparison and "simulated" not in ctx.report.to_dict()
    assert simulated_note({}) is None


def test_a_run_stopped_before_evaluation_still_says_simulated():
    note = simulated_note({"gpu_plan": {"simulated": "8x40"}})
    assert note and "8x40" in note and "not evaluated" in note
