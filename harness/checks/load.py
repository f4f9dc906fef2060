"""The load phase's checks (pure): every answer against the baseline's, the cancellations really happened
(client, proxy and server agree), and the KV pool really was reused."""

from __future__ import annotations

import re
import statistics
from dataclasses import dataclass

from harness.checks.check import Check
from harness.checks.compare import ComparisonResult, compare_completions
from harness.serve.prometheus import Sample, delta
from harness.workload.load import LoadRequest
from harness.workload.load_client import LoadRun

POOL_LOG = re.compile(r"KV cache size: ([\d,]+) tokens")


@dataclass(frozen=True)
class Pool:
    server: str
    blocks: int | None  # what the server reported (/metrics or its log), in blocks of its block size
    block_size: int
    needed: int  # blocks the requests it served needed, counted once per request

    @property
    def reused(self) -> bool:
        # More blocks were needed than the pool holds: some blocks served several requests (pigeonhole).
        return self.blocks is not None and self.needed > self.blocks


def pool_from_metrics(samples: list[Sample]) -> tuple[int, int] | None:
    """(blocks, block size) from vllm:cache_config_info, which carries the engine's cache config as labels."""
    for s in samples:
        if s.name == "vllm:cache_config_info":
            try:
                return int(s.labels["num_gpu_blocks"]), int(s.labels["block_size"])
            except (KeyError, ValueError):
                return None
    return None


def pool_blocks_from_log(log: str, block_size: int) -> int | None:
    """The KV pool a vLLM server reported at start-up ("CPU/GPU KV cache size: N tokens"), in blocks."""
    m = POOL_LOG.findall(log)
    return int(m[-1].replace(",", "")) // block_size if m else None


def blocks_needed(requests: list[LoadRequest], run: LoadRun, block_size: int, generated: bool) -> int:
    """A lower bound of the blocks the requests a server served needed: the prompts of the answered and the
    decode-aborted requests (and, on D, what they generated). Prefill aborts and failures are left out: they may
    never have reached the server."""
    total = 0
    for o in run.outcomes:
        if o.status == "ok" or (o.status == "aborted" and o.request.abort == "decode"):
            tokens = o.request.length
            if generated:
                tokens += len(o.completion.token_ids) if o.completion is not None else o.tokens_before_abort
            total += -(-tokens // block_size)
    return total


def aborted_in_log(log: str, request_id: str) -> bool:
    """vLLM (--enable-log-requests) logs "Request <id> aborted." with its own id built around ours."""
    return re.search(rf"Request (?:\S*-)?{re.escape(request_id)}(?:-\S*)? aborted", log) is not None


def check_answers(pd: LoadRun, baseline: LoadRun) -> Check:
    bad = [o for o in pd.outcomes + baseline.outcomes if o.request.abort is None and o.status != "ok"]
    n = sum(r.request.abort is None for r in pd.outcomes)
    return Check(
        "load_requests_answered",
        not bad and n > 0,
        f"{n - len({o.request.id for o in bad})}/{n} load requests answered on both sides"
        + (f"; first failure: {bad[0].request.id}: {bad[0].detail}" if bad else ""),
        {"failed": [{"id": o.request.id, "detail": o.detail} for o in bad[:20]]} if bad else None,
    )


def compare_load(pd: LoadRun, baseline: LoadRun, top_k: int) -> ComparisonResult:
    return compare_completions(baseline.completions(), pd.completions(), top_k=top_k)


def check_match(result: ComparisonResult) -> Check:
    bad = [p.prompt_id for p in result.prompts if p.status == "mismatch"]
    return Check(
        "load_outputs_match_baseline",
        result.passed,
        result.summary() + (f"; mismatched: {', '.join(bad)}" if bad else ""),
        {"mismatched": bad} if bad else None,
    )


def logprob_coverage(results: list[ComparisonResult]) -> tuple[int, int]:
    """(requests with at least one position to compare, requests compared): a request that diverged at its first
    token, with a token the other side did not list there, gives the logprob check nothing to look at."""
    prompts = [p for r in results for p in r.prompts]
    return sum(p.max_logprob_delta is not None for p in prompts), len(prompts)


def check_logprobs(results: list[ComparisonResult], threshold: float) -> Check:
    """Per compared request, the largest |Δ logprob| of the chosen tokens must stay within measured noise. Make it
    only where ``logprob_coverage`` finds a request with a position to compare (else it is skipped, said why)."""
    over = [(p.prompt_id, p.max_logprob_delta) for r in results for p in r.over_logprob_threshold(threshold)]
    deltas = [r.max_logprob_delta for r in results if r.max_logprob_delta is not None]
    worst = max(deltas) if deltas else None
    looked, total = logprob_coverage(results)
    skipped = (
        f"; {total - looked} diverged at their first token to a token the other side did not list: nothing to compare"
        if looked < total
        else ""
    )
    detail = (
        f"largest |Δ logprob| {worst:.2e} (threshold {threshold:g}) over {looked} of {total} requests{skipped}"
        if worst is not None
        else "no position to compare"
    )
    if over:
        detail += f"; over it: {', '.join(f'{i} ({d:.3g})' for i, d in over[:10])}"
    data: dict = {"threshold": threshold, "largest": worst, "requests_with_positions": looked, "requests": total}
    if over:
        data["over_threshold"] = [i for i, _ in over]
    return Check("logprobs_match_baseline", not over and worst is not None, detail, data)


def landed_stages(run: LoadRun, stats_after: dict) -> dict[str, str]:
    """Where each client cancel of the run landed, by the proxy's stage (request id -> stage; "unseen" when the
    proxy never saw it)."""
    where = {
        i.removeprefix("pd-"): stage
        for stage, ids in (stats_after.get("cancelled_ids") or {}).items()
        for i in ids
        if i.startswith("pd-")
    }
    return {o.request.id: where.get(o.request.id, "unseen") for o in run.outcomes if o.status == "aborted"}


def check_aborts(
    run: LoadRun, stats_before: dict, stats_after: dict, logs: dict[str, str], logs_available: bool
) -> Check | None:
    """Each planned cancel happened where it was meant to: the client cancelled it, the proxy passed it on at that
    stage (a planned prefill cancel must land while P prefills at least once), a server aborted it. None when no
    cancel was planned: the caller reports the check as skipped, never as passed."""
    planned = [o for o in run.outcomes if o.request.abort]
    if not planned:
        return None
    never = [o.request.id for o in planned if o.status != "aborted"]
    cancelled = {
        s: int(stats_after.get("cancelled", {}).get(s, 0)) - int(stats_before.get("cancelled", {}).get(s, 0))
        for s in stats_after.get("cancelled", {})
    }
    by_stage = {
        s: [i for i in stats_after.get("cancelled_ids", {}).get(s, []) if i.startswith("pd-")] for s in cancelled
    }
    landed = landed_stages(run, stats_after)
    unseen = [i for i, stage in landed.items() if stage == "unseen"]
    server_log = {
        "prefill": "\n".join(t for n, t in logs.items() if n.startswith("prefill")),
        "decode": "\n".join(t for n, t in logs.items() if n.startswith("decode")),
    }
    confirmed = {
        hop: [i for i in by_stage.get(hop, []) if aborted_in_log(server_log[hop], i)] for hop in ("prefill", "decode")
    }
    problems = []
    if never:
        problems.append(f"planned aborts that never happened: {', '.join(never)}")
    if unseen:
        problems.append(f"cancelled by the client but not seen by the proxy: {', '.join(unseen)}")
    for hop, stages in (("prefill", ("before_prefill", "prefill")), ("decode", ("decode",))):
        mine = [o.request.id for o in planned if o.request.abort == hop and o.status == "aborted"]
        if mine and not any(landed.get(i) in stages for i in mine):
            where = ", ".join(f"{i} {landed.get(i)}" for i in mine[:6])
            problems.append(f"none of the {len(mine)} planned {hop}-hop cancels landed in the {hop} hop ({where})")
    if logs_available:
        for hop in ("prefill", "decode"):
            if by_stage.get(hop) and not confirmed[hop]:
                problems.append(
                    f"the proxy cancelled {len(by_stage[hop])} {hop} hop(s) but no {hop} server logged an abort"
                )
        if not confirmed["prefill"] and not confirmed["decode"]:
            problems.append("no server logged an aborted request")
    detail = (
        f"{len(planned)} planned ({sum(o.request.abort == 'prefill' for o in planned)} while P prefills, "
        f"{sum(o.request.abort == 'decode' for o in planned)} mid-decode); landed by the proxy's stage: "
        + ", ".join(f"{s} {n}" for s, n in cancelled.items())
        + (
            f"; aborted in the server logs: P {len(confirmed['prefill'])}, D {len(confirmed['decode'])}"
            if logs_available
            else "; server logs not available (attach mode)"
        )
    )
    if problems:
        detail += "; " + "; ".join(problems)
    return Check(
        "load_aborts_fired",
        not problems,
        detail,
        {"cancelled_by_stage": cancelled, "landed": landed, "confirmed_by_server": confirmed, "never": never},
    )


def check_reuse(pools: list[Pool]) -> Check:
    missing = [p.server for p in pools if p.blocks is None]
    ok = bool(pools) and not missing and all(p.reused for p in pools)
    detail = "; ".join(
        f"{p.server}: {p.needed} blocks needed by the requests it served, pool {p.blocks} blocks of {p.block_size}"
        + ("" if p.reused else " (no reuse)")
        for p in pools
        if p.blocks is not None
    )
    if missing:
        detail += (
            f"; pool size unknown for {', '.join(missing)} "
            "(neither vllm:cache_config_info nor a 'KV cache size' log line)"
        )
    return Check("load_kv_blocks_reused", ok, detail or "no server")


def latency_summary(run: LoadRun) -> dict:
    ok = run.by_status("ok")

    def pct(xs: list[float], q: float) -> float | None:
        if not xs:
            return None
        xs = sorted(xs)
        return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]

    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    e2e = [o.latency_s for o in ok if o.latency_s is not None]
    return {
        "ttft_p50_s": pct(ttft, 0.5),
        "ttft_p99_s": pct(ttft, 0.99),
        "e2e_p50_s": pct(e2e, 0.5),
        "e2e_p99_s": pct(e2e, 0.99),
        "mean_e2e_s": statistics.fmean(e2e) if e2e else None,
        "wall_s": run.wall_s,
    }


PREEMPTIONS = "vllm:num_preemptions_total"


def check_d_preempted(before: list[Sample], after: list[Sample]) -> Check:
    """A run whose D pool was made small to preempt (the axis kv_pool_blocks_d) must show that D preempted: outputs
    that match prove nothing about preemption unless it happened."""
    counted = delta(before, after, PREEMPTIONS)
    grew, seen = counted.delta, counted.present
    return Check(
        "d_preempted",
        seen and grew > 0,
        f"D preempted {grew:g} times over the run ({PREEMPTIONS})"
        if seen
        else f"D's /metrics has no {PREEMPTIONS}: whether D preempted is unknown",
        {"preemptions": grew if seen else None},
    )
