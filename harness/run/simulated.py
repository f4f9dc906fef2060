"""A run on a simulated GPU box (PD_HARNESS_SIMULATED_GPUS): what it can prove, and what it must not claim.

Stand-in servers (harness/simbox/standin.py) serve in vLLM's place: the run exercises the GPU plan, the NVML checks
before and after each phase, every server's CUDA_VISIBLE_DEVICES and memory share, staggered colocated starts, the
proxy and the request path, teardown. Nothing is computed and no KV moves, so every check whose truth needs a
real vLLM (comparison with the baseline, proof of transfer, logprobs, the leak, smoke and load checks, lm-eval)
is reported as skipped with the reason, never as passed; the report's blocks built from the stand-ins' answers
(comparison, load, prefix cache) are left out, and ``config.simulated_gpus`` says all of this.
"""

from __future__ import annotations

from harness.checks.usage_stats import CHECK_NAME as USAGE_CHECK
from harness.run.context import RunContext
from harness.simbox.box import SIMULATED_ENV

# Checks a stand-in cannot fake: they are about the harness's own path, not what vLLM computed.
PLUMBING_CHECKS = (
    "all_requests_answered",
    "load_requests_answered",
    "prefix_cache_answered",
    "no_process_left",
    USAGE_CHECK,
)
# lm-eval is not run on a simulated box (it would score the stand-ins' words): these are never made there.
ACCURACY_CHECKS = (
    "accuracy_through_pd",
    "accuracy_samples_paired",
    "accuracy_pd_within_tolerance",
    "accuracy_responses_agree",
    "accuracy_baseline_meaningful",
    "accuracy_matches_expected",
)
REASON = "simulated GPUs"
LEFT_OUT = ("comparison", "load", "prefix_cache", "accuracy")


def simulated(ctx: RunContext) -> str | None:
    """The simulated box this run is on (PD_HARNESS_SIMULATED_GPUS's value), None for a real one or a CPU run."""
    return ctx.gpu.simulated if ctx.gpu is not None else None


def skip_reason(spec: str) -> str:
    return (
        f"{REASON} ({SIMULATED_ENV}={spec}): stand-in servers answered, computing nothing and moving no KV; "
        "this check needs a real vLLM"
    )


def apply(ctx: RunContext) -> None:
    """After evaluation: keep the checks a simulated run really made (GPU checks, plumbing), move every other one to
    the skipped checks with the reason, drop the blocks built from the stand-ins' answers."""
    spec = simulated(ctx)
    if spec is None:
        return
    why = skip_reason(spec)
    rep = ctx.report
    kept, skipped = [], []
    for c in rep.checks:
        if c.name in PLUMBING_CHECKS or c.name.startswith("gpu_"):
            kept.append(c)
        else:
            skipped.append(c.name)
    if ctx.accuracy is not None:
        skipped += [n for n in ACCURACY_CHECKS if n not in skipped]
    rep.checks = kept
    rep.skipped_checks += [{"name": n, "reason": why} for n in skipped]
    for block in LEFT_OUT:
        setattr(rep, block, None)
    rep.config["simulated_gpus"] = {
        "box": spec,
        "servers": "stand-ins (harness/simbox/standin.py) in vLLM's place, with vLLM's arguments; "
        "report.commands shows vLLM's command lines",
        "checks_made": [c.name for c in kept],
        "checks_skipped": skipped,
        "left_out": [f"{b} (built from the stand-ins' answers)" for b in LEFT_OUT],
        "lm_eval": "not run" if ctx.accuracy is not None else None,
    }
