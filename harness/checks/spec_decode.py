"""Speculative decoding through P/D: D's acceptance against the baseline's on the same prompts (pure).

Greedy speculative decoding keeps the target's tokens whatever the draft proposes, so outputs cannot show a draft
that lost its KV on the way from P to D; its acceptance can: fewer accepted draft tokens per draft on D than on a
baseline that decodes the same prompts the same way is the symptom of draft KV that did not travel. vLLM counts
drafts, draft tokens and accepted tokens on /metrics (the same counters upstream's P/D spec-decode test reads).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from harness.checks.check import Check
from harness.serve.prometheus import Sample, delta

CHECK_NAME = "spec_decode_acceptance_matches_baseline"
DRAFTS = "vllm:spec_decode_num_drafts_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
# Upstream's acceptance test allows 5 % between P/D and its reference (mean acceptance length).
TOLERANCE = 0.05


@dataclass(frozen=True)
class Acceptance:
    drafts: float
    draft_tokens: float
    accepted: float

    @property
    def mean_length(self) -> float | None:
        """Tokens per verification step, the drafted ones accepted plus the target's own (None: nothing drafted)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    def text(self) -> str:
        rate = f"{self.accepted / self.draft_tokens:.1%}" if self.draft_tokens else "n/a"
        mean = self.mean_length
        return (
            f"{self.drafts:g} drafts, {self.accepted:g} of {self.draft_tokens:g} draft tokens accepted ({rate}), "
            f"mean acceptance length {mean:.3f}"
            if mean is not None
            else "no draft"
        )


def acceptance(before: Sequence[Sample], after: Sequence[Sample]) -> Acceptance | None:
    """The counters' growth between two /metrics reads (None: the server exports no spec-decode counters)."""
    grown = [delta(before, after, name) for name in (DRAFTS, DRAFT_TOKENS, ACCEPTED)]
    if not all(g.present for g in grown):
        return None
    return Acceptance(*(g.delta for g in grown))


def padded_first_steps(prompt_tokens: Sequence[int | None]) -> int:
    """How many of D's requests (one at a time, by their prompt lengths) start with a padded step: vLLM's scheduler
    (v1/core/sched/scheduler.py, ``pad_spec_decode``) schedules a new request that has computed tokens and one token
    left to compute as ``1 + num_spec_tokens`` tokens with ``-1`` placeholder drafts, and counts them as a draft with
    none accepted. On D that is every request whose prompt KV came from P (all but its last token); a one-token prompt
    takes nothing from P (D computes it whole) and is not padded."""
    return sum(1 for n in prompt_tokens if (n or 0) >= 2)


def without_placeholders(d: Acceptance, padded: int, spec_tokens: int) -> Acceptance:
    """D's counters less ``padded`` placeholder drafts of ``spec_tokens`` tokens each (none of them accepted)."""
    return Acceptance(d.drafts - padded, d.draft_tokens - padded * spec_tokens, d.accepted)


def acceptance_check(
    pd: Acceptance, baseline: Acceptance, tolerance: float = TOLERANCE, padded: int = 0, spec_tokens: int = 0
) -> Check | str:
    """The check, or why it cannot be judged (a reason for the report's skipped checks). ``padded`` placeholder
    drafts of ``spec_tokens`` tokens (padded_first_steps) are taken out of D's counters first: they are vLLM's
    bookkeeping of the step D takes a request over from P, not drafts of D's drafter."""
    if baseline.mean_length is None:
        return "the baseline drafted nothing on these prompts: there is no acceptance to compare"
    counted = pd
    if padded and spec_tokens and pd.drafts >= padded and pd.draft_tokens >= padded * spec_tokens:
        pd = without_placeholders(pd, padded, spec_tokens)
    if pd.mean_length is None:
        return Check(CHECK_NAME, False, f"D drafted nothing while the baseline did: baseline {baseline.text()}")
    rel = abs(pd.mean_length - baseline.mean_length) / baseline.mean_length
    less = (
        f" (D's counters, {counted.text()}, less {padded} placeholder drafts of {spec_tokens} tokens: vLLM pads the "
        "first step of each request whose prompt KV came from P and counts it as a rejected draft)"
        if pd is not counted
        else ""
    )
    data = {"d_counted": asdict(counted), "d": asdict(pd), "baseline": asdict(baseline), "placeholder_drafts": padded}
    return Check(
        CHECK_NAME,
        rel <= tolerance,
        f"D {pd.text()}{less}; baseline {baseline.text()}; mean acceptance length differs by {rel:.1%} "
        f"(tolerance {tolerance:.0%})",
        data,
    )
