"""The accuracy checks (pure): per-sample diff of two lm-eval runs, the score tolerance, the P/D path proof."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from harness.accuracy.lm_eval import EvalRun
from harness.accuracy.settings import AccuracySettings
from harness.checks.check import Check

# Upstream compares full GSM8K scores with a model's published value at this tolerance.
EXPECTED_SCORE_TOLERANCE = 0.05


# Greedy P/D and baseline should agree almost everywhere: at most this share of responses may differ.
MAX_DIFFERING_SHARE = 0.05


@dataclass(frozen=True)
class SampleDiff:
    compared: int
    differing: list[int] = field(default_factory=list)  # doc ids whose response text differs
    flips: list[tuple[int, bool, bool]] = field(default_factory=list)  # (doc id, baseline correct, P/D correct)
    unpaired: list[int] = field(default_factory=list)  # in one run only, or with a different prompt

    def to_dict(self) -> dict:
        return {
            "compared": self.compared,
            "differing_responses": len(self.differing),
            "differing_doc_ids": self.differing[:50],
            "score_flips": len(self.flips),
            "flips": [{"doc_id": d, "baseline": b, "pd": p} for d, b, p in self.flips[:50]],
            "unpaired": self.unpaired[:50],
        }


def diff_samples(baseline: EvalRun, pd: EvalRun) -> SampleDiff:
    """Per doc: did P/D answer with other text than the baseline, and did its score flip?"""
    differing, flips, unpaired = [], [], []
    compared = 0
    for doc_id in sorted(set(baseline.samples) | set(pd.samples)):
        b, p = baseline.samples.get(doc_id), pd.samples.get(doc_id)
        if b is None or p is None or b.prompt_hash != p.prompt_hash:
            unpaired.append(doc_id)
            continue
        compared += 1
        if b.response != p.response:
            differing.append(doc_id)
        if b.correct != p.correct:
            flips.append((doc_id, b.correct, p.correct))
    return SampleDiff(compared, differing, flips, unpaired)


def score_tolerance(n: int, baseline_score: float) -> float:
    """How far the P/D score may sit from the baseline's in the same run.

    Three binomial standard errors of the baseline score over ``n`` samples, and never less than
    one sample (1/n): more samples, tighter tolerance. Greedy P/D should agree with the baseline
    almost everywhere, so this only absorbs a few near-tie flips; a corrupted transfer moves the
    score far more (the per-sample check catches smaller damage).
    """
    if n <= 0:
        return 0.0
    p = min(max(baseline_score, 0.0), 1.0)
    return max(1.0 / n, 3.0 * math.sqrt(p * (1.0 - p) / n))


def max_differing(n: int) -> int:
    return max(1, math.floor(MAX_DIFFERING_SHARE * n))


def check_through_pd(samples: int, stats_before: dict, stats_after: dict, xfers: float) -> Check:
    """lm-eval's requests really took the P/D path: P answered each with kv_transfer_params and D read over NIXL."""

    def grew(key: str) -> int:
        return int(stats_after.get(key, 0)) - int(stats_before.get(key, 0))

    with_params, missing = grew("prefill_with_kv_transfer_params"), grew("prefill_missing_kv_transfer_params")
    ok = samples > 0 and with_params >= samples and missing == 0 and xfers >= samples
    return Check(
        "accuracy_through_pd",
        ok,
        f"{with_params} prefill answers with kv_transfer_params ({missing} without) and "
        f"{xfers:.0f} NIXL transfers for {samples} lm-eval samples",
    )


def accuracy_checks(baseline: EvalRun, pd: EvalRun, s: AccuracySettings) -> tuple[list[Check], dict]:
    """The named accuracy checks and the report's ``accuracy`` block."""
    diff = diff_samples(baseline, pd)
    n = diff.compared
    tol = score_tolerance(n, baseline.score)
    delta = pd.score - baseline.score
    checks = [
        Check(
            "accuracy_samples_paired",
            n > 0 and not diff.unpaired,
            f"{n} samples paired"
            + (f"; {len(diff.unpaired)} unpaired (doc ids {diff.unpaired[:10]})" if diff.unpaired else ""),
        ),
        Check(
            "accuracy_pd_within_tolerance",
            n > 0 and abs(delta) <= tol,
            f"P/D {pd.score:.3f} vs baseline {baseline.score:.3f} (delta {delta:+.3f}, "
            f"tolerance {tol:.3f} for {n} samples)",
        ),
        Check(
            "accuracy_responses_agree",
            n > 0 and len(diff.differing) <= max_differing(n),
            f"{len(diff.differing)}/{n} responses differ (at most {max_differing(n)}), {len(diff.flips)} score flips"
            + _examples(baseline, pd, diff.differing),
        ),
    ]
    if s.min_baseline_score is not None:
        checks.append(
            Check(
                "accuracy_baseline_meaningful",
                baseline.score >= s.min_baseline_score,
                f"baseline {baseline.score:.3f} (at least {s.min_baseline_score} so that a broken transfer shows)",
            )
        )
    if s.expected_score is not None:
        off = max(abs(baseline.score - s.expected_score), abs(pd.score - s.expected_score))
        checks.append(
            Check(
                "accuracy_matches_expected",
                off <= EXPECTED_SCORE_TOLERANCE,
                f"baseline {baseline.score:.3f}, P/D {pd.score:.3f}, "
                f"expected {s.expected_score} ± {EXPECTED_SCORE_TOLERANCE}",
            )
        )
    block = {
        "task": s.task,
        "samples": n,
        "metric": s.metric_key,
        "baseline_score": baseline.score,
        "pd_score": pd.score,
        "delta": delta,
        "tolerance": tol,
        **diff.to_dict(),
        "lm_eval": pd.lm_eval_version or baseline.lm_eval_version,
        "settings": s.to_dict(),
        "output": {"baseline": baseline.output_dir, "pd": pd.output_dir},
    }
    return checks, block


def _examples(baseline: EvalRun, pd: EvalRun, doc_ids: list[int], k: int = 2) -> str:
    parts = [
        f"doc {d}: baseline {baseline.samples[d].response[:60]!r} vs P/D {pd.samples[d].response[:60]!r}"
        for d in doc_ids[:k]
    ]
    return ("; " + "; ".join(parts)) if parts else ""
