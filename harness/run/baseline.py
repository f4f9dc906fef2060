"""The baseline phase: a plain (non-disaggregated) server at D's TP answers the prompts (and lm-eval), alone."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

from harness.accuracy.lm_eval import EvalRun
from harness.run.context import RunContext
from harness.run.load import baseline_load
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
from harness.serve.servers import AttachedServers
from harness.workload.client import CompletionRun, run_completions
from harness.workload.load_client import LoadRun


@dataclass
class BaselineResult:
    completions: CompletionRun
    eval: EvalRun | None = None
    load: LoadRun | None = None  # the load phase's prompts, at the same concurrency, without the cancelled ones


def run_baseline(ctx: RunContext, alloc: PortAllocator, block_size: int | None, cpu_bind: str | None,
                 attached_url: str | None = None, cache: dict[tuple, BaselineResult] | None = None) -> BaselineResult:
    """The baseline's answers: from ``cache`` (shared by the pairs of one matrix) when it has them, from a server
    started elsewhere (``attached_url``), or from one launched here on D's cores."""
    cfg = ctx.cfg
    key = (ctx.model, cfg.tp_d, block_size, cfg.python, cfg.max_tokens, cfg.seed, cfg.device, ctx.accuracy, cfg.load,
           cfg.pool_blocks(block_size), cfg.model_len)
    if cache is not None and key in cache:
        ctx.report.config["baseline_reused"] = True
        return cache[key]
    t0 = time.monotonic()
    if attached_url:
        return _attached(ctx, attached_url, t0)
    result = _launched(ctx, alloc, block_size, cpu_bind, t0)
    if cache is not None and not result.completions.failures:
        cache[key] = result
    return result


def _launched(ctx: RunContext, alloc: PortAllocator, block_size: int | None, cpu_bind: str | None, t0: float) -> BaselineResult:
    base = ctx.server(alloc, "baseline", ctx.cfg.tp_d, block_size, cpu_bind)
    if ctx.gpu is not None:
        ctx.gpu.before("baseline")
    with contextlib.ExitStack() as stack:
        ready = start_all([base.proc], stack, ctx.cfg.ready_timeout_s)
        ctx.report.timings_s["baseline_launch_to_ready"] = ready["baseline"]
        t1 = time.monotonic()
        result = BaselineResult(run_completions(base.url, ctx.served_name, ctx.prompts, ctx.gen, "baseline-"))
        ctx.timed("baseline_requests", t1)
        result.load = baseline_load(ctx, base.url)
        if ctx.accuracy is not None:
            result.eval = ctx.lm_eval(base.url, "baseline", [base.proc])
        t_stop = time.monotonic()
    ctx.report.timings_s["baseline_teardown"] = time.monotonic() - t_stop
    if ctx.gpu is not None:
        ctx.gpu.after("baseline", base.proc.seen_pids())
    ctx.timed("baseline_phase", t0)
    ctx.leftovers += base.proc.leftover_pids()
    return result


def _attached(ctx: RunContext, url: str, t0: float) -> BaselineResult:
    """A baseline server started elsewhere: the same requests (and lm-eval run), nothing launched."""
    base = AttachedServers([], [url])
    base.start(contextlib.ExitStack())
    result = BaselineResult(run_completions(url, ctx.served_name, ctx.prompts, ctx.gen, "baseline-"))
    ctx.timed("baseline_requests", t0)
    result.load = baseline_load(ctx, url)
    if ctx.accuracy is not None:
        result.eval = ctx.lm_eval(url, "baseline", [base])
    ctx.timed("baseline_phase", t0)
    return result
