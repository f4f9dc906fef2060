"""Which requests a comparison bundle replays, and under which rule: the failing ones of a run whose failure has no
log line (wrong answers), with the run's top-k tolerance and Δlogprob threshold.

Pure: reads a run's report.json (as a dict) and its prompts (harness/run/prompts_file.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.core.errors import ConfigError
from harness.run.config import LOGPROB_THRESHOLD

# Failure classes with no log line: a bundle replays them by comparing D's answers with a plain server's.
COMPARED_CLASSES = ("output-mismatch", "logprob-mismatch")
MAX_REPLAYED = 3  # the failing prompts a bundle sends: enough to show it, few enough to read the answers


@dataclass(frozen=True)
class ReplayRule:
    top_k: int
    threshold: float


@dataclass(frozen=True)
class Replayed:
    prompt_id: str
    prompt: str | list[int]  # text (the sequential prompts) or token ids (load and prefix-cache prompts)
    why: str  # what the run saw for it


def rule_of(report: dict) -> ReplayRule:
    cfg = report.get("config") or {}
    checks = {c.get("name"): c for c in report.get("checks") or []}
    given = ((checks.get("logprobs_match_baseline") or {}).get("data") or {}).get("threshold")
    if given is None:
        given = cfg.get("logprob_threshold")
    threshold = float(given) if given is not None else LOGPROB_THRESHOLD.get(str(cfg.get("device") or "cpu"), 1e-3)
    top_k = int((report.get("comparison") or {}).get("top_k") or cfg.get("logprobs") or 5)
    return ReplayRule(top_k, threshold)


def _compared(report: dict) -> list[dict]:
    out = list((report.get("comparison") or {}).get("prompts") or [])
    out += ((report.get("load") or {}).get("comparison") or {}).get("prompts") or []
    return out


def failing(report: dict, rule: ReplayRule) -> list[tuple[str, str]]:
    """(prompt id, what the run saw) of every compared request that failed: token mismatches first, the earliest
    divergence first; then by Δlogprob."""
    rows = []
    for p in _compared(report):
        delta = p.get("max_logprob_delta")
        d = p.get("divergence") or {}
        if p.get("status") == "mismatch":
            why = (
                f"first divergence at token {d.get('position')} (D {d.get('pd_token')} vs baseline "
                f"{d.get('baseline_token')})"
            )
            rows.append((0, d.get("position") or 0, -(delta or 0.0), p["prompt_id"], why))
        elif delta is not None and delta > rule.threshold:
            rows.append((1, 0, -delta, p["prompt_id"], f"|Δlogprob| {delta:.3g} > {rule.threshold:g}"))
    return [(pid, why) for *_, pid, why in sorted(rows)]


def replayed(report: dict, prompts: dict[str, str | list[int]], rule: ReplayRule) -> list[Replayed]:
    """The failing requests a bundle sends (at most MAX_REPLAYED, each with its prompt); ConfigError when the run
    failed none, or none of them has a recorded prompt."""
    bad = failing(report, rule)
    if not bad:
        raise ConfigError(
            "the run has no request that failed the comparison (no token mismatch, no |Δlogprob| over "
            f"{rule.threshold:g}): nothing to replay for a wrong answer"
        )
    out = [Replayed(pid, prompts[pid], why) for pid, why in bad if pid in prompts][:MAX_REPLAYED]
    if not out:
        raise ConfigError(
            f"the run folder records none of its failing prompts ({', '.join(p for p, _ in bad[:5])}): "
            "it has no prompts.json (a run made before runs recorded their prompts); run it again"
        )
    return out
