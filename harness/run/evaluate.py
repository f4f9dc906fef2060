"""The evaluation phase (pure over what the phases returned): every check of a run, the comparison block."""

from __future__ import annotations

from harness.accuracy.checks import accuracy_checks
from harness.checks import kv_digest, spec_decode, transfer
from harness.checks.check import Check
from harness.checks.compare import ComparisonResult, compare_completions
from harness.checks.expert_parallel import CHECK_NAME as EP_CHECK
from harness.checks.expert_parallel import check_d_expert_parallel
from harness.checks.leak import check_no_leak
from harness.checks.load import (
    Pool,
    blocks_needed,
    check_aborts,
    check_answers,
    check_d_preempted,
    check_logprobs,
    check_match,
    check_reuse,
    compare_load,
    landed_stages,
    latency_summary,
    logprob_coverage,
    pool_blocks_from_log,
    pool_from_metrics,
)
from harness.checks.prefix_cache import check_sources
from harness.checks.transport import CHECK_NAME as KV_NETWORK_CHECK
from harness.checks.transport import check_kv_over_network, kv_transports
from harness.checks.usage_stats import CHECK_NAME as USAGE_CHECK
from harness.checks.usage_stats import check_no_usage_reporting
from harness.run import simulated
from harness.run.baseline import BaselineResult
from harness.run.context import RunContext
from harness.run.pd import PDResult
from harness.run.prefix import PDPrefix
from harness.workload.client import CompletionRun

MIN_PROMPTS = 16
KV_FAULT_FIRED = "[pd-harness fault] scaled the received KV"  # harness/serve/inject/pd_kv_fault.py


NO_BASELINE = "no baseline (--no-baseline): outputs are not compared; kv_digest_match judges D's KV"


def evaluate(ctx: RunContext, baseline: BaselineResult | None, pd: PDResult) -> None:
    """Fill the report's checks, comparison, skipped checks and accuracy block."""
    if baseline is None:
        evaluate_digest_only(ctx, pd)
        return
    n = len(ctx.prompts)
    checks = [answered_check(baseline.completions, pd.completions, n)]
    result = compare_completions(baseline.completions.completions, pd.completions.completions, top_k=ctx.gen.logprobs)
    checks.append(match_check(result, min(MIN_PROMPTS, len(ctx.prompts))))
    ctx.report.comparison = comparison_block(result, baseline.completions, pd.completions)
    checks += transfer_checks(ctx, pd, n)
    checks += digest_checks(ctx, pd)
    checks += server_checks(ctx, pd)
    checks += spec_decode_checks(ctx, baseline, pd)
    compared = [result]
    if pd.load is not None and baseline.load is not None:
        load_checks, load_cmp = evaluate_load(ctx, baseline, pd)
        checks += load_checks
        compared.append(load_cmp)
    if pd.prefix is not None and baseline.prefix is not None:
        prefix_checks, prefix_cmp = evaluate_prefix(ctx, baseline.prefix, pd.prefix)
        checks += prefix_checks
        compared.append(prefix_cmp)
    if logprob_coverage(compared)[0]:
        checks.append(check_logprobs(compared, ctx.cfg.logprob_limit))
    else:  # decided before its result: every answer left the baseline's at its first token
        ctx.report.skipped_checks.append(
            {
                "name": "logprobs_match_baseline",
                "reason": "no request had a position to compare: every answer diverged at its first token, to a "
                "token the other side did not list (see the comparison)",
            }
        )
    checks += closing_checks(ctx, pd)
    if ctx.accuracy is not None and pd.eval is not None and baseline.eval is not None and pd.through is not None:
        acc_checks, ctx.report.accuracy = accuracy_checks(baseline.eval, pd.eval, ctx.accuracy)
        checks += [pd.through, *acc_checks]
    if ctx.gpu is not None:  # NVML's free memory before each phase and its release after (harness/gpu/run.py)
        checks += ctx.gpu.checks
    ctx.report.checks = checks
    ctx.report.config["cpu_tuning"] = ctx.cfg.cpu_tuning.to_dict() if ctx.cfg.device == "cpu" else None
    simulated.apply(ctx)  # a simulated GPU box: the data-path checks become skipped ones (harness/run/simulated.py)


def evaluate_digest_only(ctx: RunContext, pd: PDResult) -> None:
    """A run without a baseline (``--no-baseline``, refused with anything that compares outputs): P/D answered,
    KV moved, and D holds P's bytes. A digest that could not be made fails the run: nothing else judged D's KV."""
    n = len(ctx.prompts)
    failed = pd.completions.failures
    checks = [
        Check(
            "all_requests_answered",
            not failed and len(pd.completions.completions) == n,
            f"P/D {len(pd.completions.completions)}/{n} (no baseline)"
            + (f"; first failure: {failed[0]}" if failed else ""),
        )
    ]
    checks += transfer_checks(ctx, pd, n)
    digest = digest_checks(ctx, pd)
    if not digest:
        why = next(s["reason"] for s in ctx.report.skipped_checks if s["name"] == kv_digest.CHECK_NAME)
        digest = [Check("kv_digest_judged", False, f"--no-baseline, and the KV digest could not be made ({why})")]
    checks += digest + server_checks(ctx, pd)
    ctx.report.skipped_checks += [{"name": name, "reason": NO_BASELINE} for name in COMPARED]
    checks += closing_checks(ctx, pd)
    ctx.report.checks = checks
    ctx.report.config["cpu_tuning"] = ctx.cfg.cpu_tuning.to_dict() if ctx.cfg.device == "cpu" else None
    simulated.apply(ctx)


COMPARED = ("outputs_match_baseline", "logprobs_match_baseline")  # what only a baseline can judge


def spec_decode_checks(ctx: RunContext, baseline: BaselineResult, pd: PDResult) -> list[Check]:
    """With speculative decoding: D's acceptance against the baseline's (checks/spec_decode.py), or why not."""
    if ctx.cfg.axes.speculative_config is None:
        return []
    got: Check | str
    if baseline.acceptance is None:
        got = baseline.acceptance_note or (
            "the baseline's acceptance was not measured (its answers came from another run, or from a server started "
            "elsewhere)"
        )
    else:
        pd_acceptance = spec_decode.acceptance(pd.metrics_before, pd.metrics_after)
        padded = spec_decode.padded_first_steps([c.prompt_tokens for c in pd.completions.completions])
        got = (
            "D exports no spec-decode counters"
            if pd_acceptance is None
            else spec_decode.acceptance_check(
                pd_acceptance,
                baseline.acceptance,
                padded=padded,
                spec_tokens=ctx.cfg.axes.spec_tokens,
            )
        )
    if isinstance(got, Check):
        return [got]
    ctx.report.skipped_checks.append({"name": spec_decode.CHECK_NAME, "reason": got})
    return []


def closing_checks(ctx: RunContext, pd: PDResult) -> list[Check]:
    """That a fault fired, that nothing was left running, and the smoke check."""
    checks = fault_checks(ctx, pd)
    left = ctx.leftovers
    checks.append(
        Check("no_process_left", not left, "every harness process exited" if not left else f"still running: {left}")
    )
    if pd.smoke is not None:
        checks.append(pd.smoke)
    return checks


def transfer_checks(ctx: RunContext, pd: PDResult, n: int) -> list[Check]:
    """Proof that KV moved: P's answers, D's NIXL counters, D's log and P's lease (logs only where ours)."""
    prompt_tokens = sum(c.prompt_tokens or 0 for c in pd.completions.completions)
    checks = [transfer.check_prefill_params(n, pd.proxy_stats)]
    checks += transfer.check_nixl_metrics(pd.metrics_before, pd.metrics_after, n, prompt_tokens)
    if ctx.cfg.axes.dp_d > 1:
        checks.append(transfer.check_dp_engines_received(pd.metrics_before, pd.metrics_after, ctx.cfg.axes.dp_d))
    if pd.attached:  # servers started elsewhere: their logs are not ours to read; /metrics carries the proof
        why = "attach mode: the server logs are not available to the harness"
        ctx.report.skipped_checks += [
            {"name": name, "reason": why} for name in (*transfer.LOG_CHECKS, "no_kv_lease_expiry")
        ]
        return checks
    checks += transfer.check_decode_log("\n".join(t for name, t in pd.logs.items() if name.startswith("decode")))
    checks.append(
        transfer.check_lease(
            pd.logs,
            pd.idle.cancels if pd.idle is not None else None,
            pd.idle.faulted if pd.idle is not None else (),
        )
    )
    return checks


def digest_checks(ctx: RunContext, pd: PDResult) -> list[Check]:
    """Exact proof that D holds the bytes P computed (checks/kv_digest.py), or why it could not be made."""
    why = None
    if not ctx.cfg.kv_digest:
        why = "turned off (--no-kv-digest)"
    elif pd.attached and pd.digests is None:
        why = (
            "attach mode: no --attached-kv-digest folder given (servers started with the digest hook write one: "
            "docs/kv-digest.md#attach-mode)"
        )
    elif simulated.simulated(ctx):
        why = "stand-in servers compute no KV"
    records, unavailable = pd.digests if why is None and pd.digests is not None else ([], [])
    if why is None and unavailable:
        why = "the hook could not digest on this vLLM: " + "; ".join(unavailable)
    elif why is None and not records and pd.attached:
        why = "attach mode: the attached servers wrote no digest record during this run (started with the hook?)"
    elif why is None and not records:  # the hook never armed: this vLLM's NIXL worker is not the one it patches
        vllm = (ctx.report.versions or {}).get("vllm") or "?"
        why = f"no server wrote a digest record: the hook knows no NIXL worker in vLLM {vllm} to patch"
    if why is not None:
        ctx.report.skipped_checks.append({"name": kv_digest.CHECK_NAME, "reason": why})
        return []
    return [kv_digest.check(kv_digest.compare(records))]


def record_kv_transport(ctx: RunContext, pd: PDResult) -> str:
    """On one host: what UCX chose to carry D's KV reads, per D log and rank, from its protocol tables, kept in the
    report (``config.kv_transport``); the words to add to the skipped network check's reason."""
    used = kv_transports({k: v for k, v in (pd.logs or {}).items() if k.startswith("decode")})
    every = sorted({t for per in used.values() for ts in per.values() for t in ts})
    ctx.report.config["kv_transport"] = {"transports": every, "per_rank": used}
    return f"; UCX carried D's KV reads over {', '.join(every)}" if every else "; UCX printed no KV read table"


def server_checks(ctx: RunContext, pd: PDResult) -> list[Check]:
    """What the servers did besides the transfer: KV over the network between hosts, no usage reporting, nothing
    held after the run (each skipped with why where it cannot be made)."""
    checks = []
    if ctx.cfg.hosts.spans_hosts and not pd.attached:
        decode_logs = {k: v for k, v in pd.logs.items() if k.startswith("decode")}
        checks.append(check_kv_over_network(decode_logs, ctx.cfg.tp_d))
    else:
        why = (
            "attach mode: the server logs (UCX's protocol tables) are not available to the harness"
            if pd.attached
            else "P and D on one host, where a same-host transport is what UCX should use"
        )
        if not pd.attached:
            why += record_kv_transport(ctx, pd)
        ctx.report.skipped_checks.append({"name": KV_NETWORK_CHECK, "reason": why})
    if pd.environs is not None:
        checks.append(check_no_usage_reporting(pd.environs))
    else:
        ctx.report.skipped_checks.append(
            {
                "name": USAGE_CHECK,
                "reason": "attach mode: the servers' environment is "
                "whoever started them; set VLLM_NO_USAGE_STATS=1 there (docs/running.md)",
            }
        )
    if pd.idle is not None:
        checks.append(check_no_leak(pd.idle, None if pd.attached else pd.logs))
    if ctx.cfg.axes.expert_parallel_d:
        if pd.attached:
            ctx.report.skipped_checks.append(
                {"name": EP_CHECK, "reason": "attach mode: D's logs (where each rank says its experts) are not ours"}
            )
        else:
            decode_logs = {k: v for k, v in pd.logs.items() if k.startswith("decode")}
            checks.append(check_d_expert_parallel(decode_logs, ctx.cfg.ranks("decode")))
    return checks


def fault_checks(ctx: RunContext, pd: PDResult) -> list[Check]:
    """A fault run must show that its fault really fired; the proxy's faulted requests go into the report."""
    checks = []
    if ctx.cfg.proxy_fault != "none" and pd.final_stats is not None:  # which requests the proxy changed: the mismatches
        faulted = list(pd.final_stats.get("faulted_ids", []))
        ctx.report.faults = {
            "proxy": {"fault": ctx.cfg.proxy_fault, "every": ctx.cfg.proxy_fault_every, "requests": faulted}
        }
        checks.append(
            Check(
                "proxy_fault_fired",
                bool(faulted),
                f"the proxy applied {ctx.cfg.proxy_fault} to {len(faulted)} "
                f"request(s) (every {ctx.cfg.proxy_fault_every}); this run must fail on what that changed",
            )
        )
    if ctx.cfg.decode_kv_fault is not None:
        fired = sum(text.count(KV_FAULT_FIRED) for name, text in pd.logs.items() if name.startswith("decode"))
        checks.append(
            Check(
                "decode_kv_fault_fired",
                fired > 0,
                f"D logged {fired} perturbed receive(s) "
                f"(factor {ctx.cfg.decode_kv_fault}); this run must fail on what the perturbation changed",
            )
        )
    return checks


def answered_check(baseline: CompletionRun, pd: CompletionRun, n: int) -> Check:
    failed = baseline.failures + pd.failures
    return Check(
        "all_requests_answered",
        not failed and len(baseline.completions) == n and len(pd.completions) == n,
        f"baseline {len(baseline.completions)}/{n}, P/D {len(pd.completions)}/{n}"
        + (f"; first failure: {failed[0]}" if failed else ""),
        {"failures": [str(f) for f in failed[:10]]} if failed else None,
    )


def match_check(result: ComparisonResult, wanted: int = MIN_PROMPTS) -> Check:
    """Every compared prompt matches, and at least ``wanted`` were compared (MIN_PROMPTS, or all of those --prompts
    selected: a narrowed run compares only them)."""
    enough = len(result.prompts) >= wanted
    return Check(
        "outputs_match_baseline",
        result.passed and enough,
        result.summary() + ("" if enough else f"; fewer than {wanted} prompts compared"),
    )


def comparison_block(result: ComparisonResult, baseline: CompletionRun, pd: CompletionRun) -> dict:
    comp = result.to_dict()
    comp["summary"] = result.summary()
    comp["prompt_tokens"] = {c.prompt_id: c.prompt_tokens for c in baseline.completions}
    comp["texts"] = {c.prompt_id: {"baseline": c.text} for c in baseline.completions}
    for c in pd.completions:
        comp["texts"].setdefault(c.prompt_id, {})["pd"] = c.text
    return comp


def evaluate_load(ctx: RunContext, baseline: BaselineResult, pd: PDResult) -> tuple[list[Check], ComparisonResult]:
    """The load phase's checks and the report's ``load`` block."""
    load, base = pd.load, baseline.load
    assert load is not None and base is not None
    cmp = compare_load(load.run, base, ctx.gen.logprobs)
    bs_p, bs_d = ctx.cfg.block_sizes()
    pools = []
    for name, samples in load.metrics_after.items():
        role = "prefill" if name.startswith("prefill") else "decode"
        bs = (bs_p if role == "prefill" else bs_d) or 16
        from_metrics = pool_from_metrics(samples)
        blocks, bs = from_metrics if from_metrics else (pool_blocks_from_log(pd.logs.get(name, ""), bs), bs)
        pools.append(Pool(name, blocks, bs, blocks_needed(ctx.load_requests, load.run, bs, generated=role == "decode")))
    checks = [check_answers(load.run, base), check_match(cmp)]
    aborts = check_aborts(load.run, load.stats_before, load.stats_after, pd.logs, not pd.attached)
    if aborts is None:
        ctx.report.skipped_checks.append(
            {
                "name": "load_aborts_fired",
                "reason": "no client cancel planned (--load-abort-every 0, or too few load requests)",
            }
        )
    else:
        checks.append(aborts)
    reuse = check_reuse(pools)
    if pd.attached:  # decided before the result: the pool is whoever started the servers' choice, not this run's
        ctx.report.skipped_checks.append(
            {
                "name": reuse.name,
                "reason": "attach mode: the servers' KV pool is not this "
                f"run's to size, so reuse is not this run's to prove ({reuse.detail}); start "
                "them with --num-gpu-blocks-override to test reuse",
            }
        )
    else:
        checks.append(reuse)
    if ctx.cfg.axes.kv_pool_blocks_d is not None:  # the run was made to preempt on D: show that it did
        d_after = [x for name, samples in load.metrics_after.items() if name.startswith("decode") for x in samples]
        checks.append(check_d_preempted(pd.metrics_before, d_after))
    s = ctx.cfg.load
    run = load.run
    # by where the cancel landed (the proxy's stage), not by plan: a planned prefill cancel may land in the decode hop
    landed = landed_stages(run, load.stats_after)
    aborted = {"prefill": 0, "decode": 0}
    for stage in landed.values():
        aborted[stage] = aborted.get(stage, 0) + 1
    ctx.report.load = {
        "settings": s.to_dict(),
        "requests": len(run.outcomes),
        "concurrency": run.concurrency,
        "baseline_answered": (
            f"the same prompts at the same concurrency ({base.concurrency}), without the cancelled ones"
        ),
        "why_noise_cannot_fail": (
            "different batching changes float rounding, which can only flip a near tie: the comparison "
            "tolerates a divergence where each side's token is in the other's top-k and stops there, "
            "and the logprob threshold is set above the measured baseline-vs-baseline noise"
        ),
        "aborted_by_client": aborted,
        "prefill_abort_after_s": load.prefill_abort_s,
        "cancelled_by_proxy": {
            k: int(load.stats_after.get("cancelled", {}).get(k, 0))
            - int(load.stats_before.get("cancelled", {}).get(k, 0))
            for k in load.stats_after.get("cancelled", {})
        },
        "matched": cmp.n_exact + cmp.n_tolerated,
        "mismatched": [p.prompt_id for p in cmp.prompts if p.status == "mismatch"],
        "max_logprob_delta": cmp.max_logprob_delta,
        "latency": {"pd": latency_summary(run), "baseline": latency_summary(base)},
        "pools": [
            {
                "server": p.server,
                "blocks": p.blocks,
                "block_size": p.block_size,
                "blocks_needed": p.needed,
                "reused": p.reused,
            }
            for p in pools
        ],
        "comparison": cmp.to_dict(),
        "outcomes": [o.to_dict() for o in run.outcomes],
    }
    return checks, cmp


def evaluate_prefix(ctx: RunContext, baseline: CompletionRun, pd: PDPrefix) -> tuple[list[Check], ComparisonResult]:
    """The prefix-cache scenarios: answered, the same answers as the baseline, D's sources exactly as predicted."""
    n = len(ctx.prefix_cases)
    cmp = compare_completions(baseline.completions, pd.run.completions, top_k=ctx.gen.logprobs)
    answered = answered_check(baseline, pd.run, n)
    checks = [
        Check("prefix_cache_answered", answered.passed, answered.detail, answered.data),
        Check("prefix_cache_outputs_match", cmp.passed and len(cmp.prompts) == n, cmp.summary()),
        check_sources(pd.sourced),
    ]
    ctx.report.prefix_cache = {
        "block_size_d": ctx.cfg.block_sizes()[1],
        "rule": "local_cache_hit = the longest cached block-aligned prefix, at most floor((N-1)/B)*B; "
        "external_kv_transfer = N - local_cache_hit; local_compute = 0",
        "requests": [r.to_dict() for r in pd.sourced],
        "comparison": cmp.to_dict(),
    }
    return checks, cmp
