"""The evaluation phase (pure over what the phases returned): every check of a run, the comparison block."""

from __future__ import annotations

from harness.accuracy.checks import accuracy_checks
from harness.checks import transfer
from harness.checks.check import Check
from harness.checks.compare import ComparisonResult, compare_completions
from harness.run.baseline import BaselineResult
from harness.run.context import RunContext
from harness.run.pd import PDResult
from harness.workload.client import CompletionRun

MIN_PROMPTS = 16


def evaluate(ctx: RunContext, baseline: BaselineResult, pd: PDResult) -> None:
    """Fill the report's checks, comparison, skipped checks and accuracy block."""
    n = len(ctx.prompts)
    checks = [answered_check(baseline.completions, pd.completions, n)]
    result = compare_completions(baseline.completions.completions, pd.completions.completions, top_k=ctx.gen.logprobs)
    checks.append(match_check(result))
    ctx.report.comparison = comparison_block(result, baseline.completions, pd.completions)

    prompt_tokens = sum(c.prompt_tokens or 0 for c in pd.completions.completions)
    checks.append(transfer.check_prefill_params(n, pd.proxy_stats))
    checks += transfer.check_nixl_metrics(pd.metrics_before, pd.metrics_after, n, prompt_tokens)
    if pd.attached:  # servers started elsewhere: their logs are not ours to read; /metrics carries the proof
        why = "attach mode: the server logs are not available to the harness"
        ctx.report.skipped_checks += [{"name": name, "reason": why} for name in (*transfer.LOG_CHECKS, "no_kv_lease_expiry")]
    else:
        checks += transfer.check_decode_log("\n".join(t for name, t in pd.logs.items() if name.startswith("decode")))
        checks.append(transfer.check_lease(pd.logs))
    left = ctx.leftovers
    checks.append(Check("no_process_left", not left, "every harness process exited" if not left else f"still running: {left}"))
    if pd.smoke is not None:
        checks.append(pd.smoke)
    if ctx.accuracy is not None and pd.eval is not None and baseline.eval is not None and pd.through is not None:
        acc_checks, ctx.report.accuracy = accuracy_checks(baseline.eval, pd.eval, ctx.accuracy)
        checks += [pd.through, *acc_checks]
    ctx.report.checks = checks
    ctx.report.config["cpu_tuning"] = ctx.cfg.cpu_tuning.to_dict() if ctx.cfg.device == "cpu" else None


def answered_check(baseline: CompletionRun, pd: CompletionRun, n: int) -> Check:
    failed = baseline.failures + pd.failures
    return Check(
        "all_requests_answered",
        not failed and len(baseline.completions) == n and len(pd.completions) == n,
        f"baseline {len(baseline.completions)}/{n}, P/D {len(pd.completions)}/{n}" + (f"; first failure: {failed[0]}" if failed else ""),
        {"failures": [str(f) for f in failed[:10]]} if failed else None,
    )


def match_check(result: ComparisonResult) -> Check:
    enough = len(result.prompts) >= MIN_PROMPTS
    return Check("outputs_match_baseline", result.passed and enough,
                 result.summary() + ("" if enough else f"; fewer than {MIN_PROMPTS} prompts compared"))


def comparison_block(result: ComparisonResult, baseline: CompletionRun, pd: CompletionRun) -> dict:
    comp = result.to_dict()
    comp["summary"] = result.summary()
    comp["prompt_tokens"] = {c.prompt_id: c.prompt_tokens for c in baseline.completions}
    comp["texts"] = {c.prompt_id: {"baseline": c.text} for c in baseline.completions}
    for c in pd.completions:
        comp["texts"].setdefault(c.prompt_id, {})["pd"] = c.text
    return comp
