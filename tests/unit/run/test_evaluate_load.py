"""The load phase's checks are decided before their results: skipped with a reason, or run."""

from types import SimpleNamespace
from typing import cast

from harness.run.baseline import BaselineResult
from harness.run.context import RunContext
from harness.run.evaluate import evaluate_load
from harness.run.load import PDLoad
from harness.run.pd import PDResult
from harness.serve.axes import ServerAxes
from harness.workload.load import LoadSettings
from harness.workload.load_client import LoadRun
from tests.unit.checks.test_load_checks import STATS0, outcome, stats


def evaluate(outcomes, attached, after=STATS0, logs=None):
    report = SimpleNamespace(skipped_checks=[], load=None)
    cfg = SimpleNamespace(block_sizes=lambda: (16, 16), load=LoadSettings(), axes=ServerAxes())
    ctx = SimpleNamespace(
        gen=SimpleNamespace(logprobs=5), cfg=cfg, load_requests=[o.request for o in outcomes], report=report
    )
    pool = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1"} 1.0\n'
    from harness.serve.prometheus import parse_metrics

    run = LoadRun(outcomes)
    pd = SimpleNamespace(
        load=PDLoad(run, 0.01, STATS0, after, {"decode": parse_metrics(pool)}), logs=logs or {}, attached=attached
    )
    base = LoadRun([o for o in outcomes if not o.request.abort])
    fakes = cast(RunContext, ctx), cast(BaselineResult, SimpleNamespace(load=base)), cast(PDResult, pd)
    checks, _ = evaluate_load(*fakes)
    return {c.name: c for c in checks}, {s["name"]: s["reason"] for s in report.skipped_checks}, report.load


def test_no_cancel_planned_skips_the_abort_check_with_its_reason():
    checks, skipped, _ = evaluate([outcome("a"), outcome("b")], attached=False)
    assert "load_aborts_fired" not in checks and "no client cancel planned" in skipped["load_aborts_fired"]


def test_attach_mode_skips_reuse_whatever_its_result_would_be():
    # one block of pool and two requests: reuse would be proven, and it is still not this run's to prove
    checks, skipped, _ = evaluate([outcome("a", length=40), outcome("b", length=40)], attached=True)
    assert "load_kv_blocks_reused" not in checks and "attach mode" in skipped["load_kv_blocks_reused"]
    checks, skipped, _ = evaluate([outcome("a", length=40), outcome("b", length=40)], attached=False)
    assert checks["load_kv_blocks_reused"].passed and "load_kv_blocks_reused" not in skipped


def test_cancels_are_counted_where_they_landed_not_by_plan():
    outs = [outcome("a"), outcome("p1", "prefill", "aborted"), outcome("d1", "decode", "aborted")]
    _, _, load = evaluate(outs, attached=True, after=stats(decode=["pd-p1", "pd-d1"]))
    assert load["aborted_by_client"] == {"prefill": 0, "decode": 2}
