"""Where the |Δ logprob| threshold must sit (pure): above the largest delta a correct P/D run shows against its
baseline (another TP, another batch: float rounding), below what a small decode-side KV fault moves.

A correct run fails the logprob check when the threshold is at or below its noise; a quietly wrong KV passes it
when the threshold is at or above the fault's largest effect (the check fails a run when any request is over)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Literal

Verdict = Literal["ok", "too-tight", "too-loose", "not-separable"]
# Noise measured on one pair of runs is a sample: the threshold keeps this factor above it where it can.
NOISE_MARGIN = 3.0


@dataclass(frozen=True)
class Calibration:
    device: str
    noise_max: float  # the largest |Δ logprob| of a chosen token, correct run against its baseline
    noise_requests: int
    fault_factor: float  # the decode-side KV fault (D scales one layer's received KV by this)
    fault_max: float  # the fault run's largest per-request |Δ logprob|: what the check must exceed to catch it
    fault_median: float
    fault_requests: int
    threshold: float  # the one the harness uses now on this device
    suggested: float | None  # a threshold between noise and fault, None when they do not separate
    verdict: Verdict
    why: str

    def to_dict(self) -> dict:
        return asdict(self)


def calibrate(
    device: str, noise: Sequence[float], fault: Sequence[float], fault_factor: float, threshold: float
) -> Calibration:
    """``noise``/``fault``: the per-request largest |Δ logprob| of the correct run and of the fault run."""
    if not noise or not fault:
        raise ValueError("calibration needs per-request logprob deltas from both runs (logprobs were not returned?)")
    n_max, f_max = max(noise), max(fault)
    f_med = sorted(fault)[len(fault) // 2]
    suggested = None
    if f_max > n_max:
        low = n_max * NOISE_MARGIN if n_max * NOISE_MARGIN < f_max else n_max
        suggested = math.sqrt(max(low, 1e-12) * f_max)  # the geometric middle: both are spread over decades
    if suggested is None:
        verdict: Verdict = "not-separable"
        why = (
            f"a {fault_factor:g} KV fault moves logprobs at most {f_max:.3g}, no more than a correct run's noise "
            f"{n_max:.3g}: no threshold tells them apart on this device; only token mismatches can catch it"
        )
    elif threshold <= n_max:
        verdict = "too-tight"
        why = f"the threshold {threshold:g} is at or below a correct run's noise {n_max:.3g}: correct runs fail"
    elif threshold >= f_max:
        verdict = "too-loose"
        why = (
            f"the threshold {threshold:g} is at or above the largest effect {f_max:.3g} of a {fault_factor:g} KV "
            f"fault: the logprob check cannot catch that fault"
        )
    else:
        verdict = "ok"
        why = f"noise {n_max:.3g} < threshold {threshold:g} < the {fault_factor:g} fault's largest effect {f_max:.3g}"
    return Calibration(
        device, n_max, len(noise), fault_factor, f_max, f_med, len(fault), threshold, suggested, verdict, why
    )


def per_request_deltas(report: dict) -> list[float]:
    """Every compared request's largest |Δ logprob| in a run's report.json: the sequential prompts and the load."""
    prompts = list((report.get("comparison") or {}).get("prompts") or [])
    prompts += ((report.get("load") or {}).get("comparison") or {}).get("prompts") or []
    return [float(p["max_logprob_delta"]) for p in prompts if p.get("max_logprob_delta") is not None]


def markdown(c: Calibration) -> str:
    sug = "-" if c.suggested is None else f"{c.suggested:.3g}"
    return "\n".join(
        [
            f"# Logprob threshold calibration ({c.device})",
            "",
            "| correct run: max |Δ logprob| | requests | KV fault | fault: max / median |Δ logprob| | requests | "
            "threshold now | suggested | verdict |",
            "|---|---|---|---|---|---|---|---|",
            f"| {c.noise_max:.3g} | {c.noise_requests} | ×{c.fault_factor:g} | "
            f"{c.fault_max:.3g} / {c.fault_median:.3g} | "
            f"{c.fault_requests} | {c.threshold:g} | {sug} | **{c.verdict}** |",
            "",
            c.why,
            "",
        ]
    )
