"""Compare greedy completions of a P/D run with a baseline, token by token.

Convention of vLLM's ``check_logprobs_close``: at the first position where the
tokens differ, the divergence is tolerated only if each side's token is in the
other side's top-k logprobs there (a near tie decided differently by numerics);
comparison of that prompt then stops, since greedy continuations legitimately
differ after it. Anything else is a mismatch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass

from harness.workload.completion import Completion

# Part of every cached baseline's key (harness/run/baseline_key.py): bump it when what a comparison needs from the
# baseline, or how it reads it, changes, so that no baseline recorded under the old rules is compared under the new.
COMPARISON_VERSION = 1


def _top(d: dict[int, float], k: int) -> tuple[int, ...]:
    return tuple(t for t, _ in sorted(d.items(), key=lambda kv: -kv[1])[:k])


@dataclass(frozen=True)
class Divergence:
    position: int
    baseline_token: int | None
    pd_token: int | None
    baseline_top: tuple[int, ...]
    pd_top: tuple[int, ...]
    tolerated: bool
    reason: str


@dataclass(frozen=True)
class PromptComparison:
    prompt_id: str
    status: str  # exact | tolerated | mismatch
    compared_tokens: int
    divergence: Divergence | None = None
    # Largest |logprob difference| of the chosen token over the positions where both sides chose the same token, and
    # of the two tokens at a divergence where both sides list both (``logprob_delta``): a slightly wrong KV that
    # flips no greedy token, or only swaps a near tie, still moves these (None: no position had both logprobs).
    max_logprob_delta: float | None = None

    def to_dict(self) -> dict:
        return asdict(self)


def logprob_delta(b: Completion, p: Completion, upto: int) -> float | None:
    """max |Δ logprob| over positions < ``upto``: of the chosen token where both chose the same, and, at the
    position where they diverged, of each of the two tokens that both sides list there. A near tie decided
    differently by numerics moves those by noise only; a wrong KV that swaps two top-k tokens moves them far, and
    without this a request diverging at its first token would give the logprob check nothing to look at."""
    deltas = []
    for i in range(min(upto, len(b.token_ids), len(p.token_ids))):
        tokens = {b.token_ids[i], p.token_ids[i]}
        for tok in tokens:
            lb, lp = b.top_logprobs[i].get(tok), p.top_logprobs[i].get(tok)
            if lb is not None and lp is not None:
                deltas.append(abs(lb - lp))
        if len(tokens) > 1:
            break
    return max(deltas) if deltas else None


def compare_one(b: Completion, p: Completion, top_k: int) -> PromptComparison:
    n = min(len(b.token_ids), len(p.token_ids))
    for i in range(n):
        bt, pt = b.token_ids[i], p.token_ids[i]
        if bt == pt:
            continue
        btop, ptop = _top(b.top_logprobs[i], top_k), _top(p.top_logprobs[i], top_k)
        ok = bt in ptop and pt in btop
        reason = (
            "each token in the other's top-k"
            if ok
            else (
                f"baseline token {'in' if bt in ptop else 'not in'} P/D top-{top_k}, "
                f"P/D token {'in' if pt in btop else 'not in'} baseline top-{top_k}"
            )
        )
        return PromptComparison(
            b.prompt_id,
            "tolerated" if ok else "mismatch",
            i + 1,
            Divergence(i, bt, pt, btop, ptop, ok, reason),
            logprob_delta(b, p, i + 1),
        )
    delta = logprob_delta(b, p, n)
    if len(b.token_ids) != len(p.token_ids):
        reason = (
            f"length differs: baseline {len(b.token_ids)} tokens ({b.finish_reason}), "
            f"P/D {len(p.token_ids)} tokens ({p.finish_reason})"
        )
        b_next = b.token_ids[n] if n < len(b.token_ids) else None
        p_next = p.token_ids[n] if n < len(p.token_ids) else None
        return PromptComparison(b.prompt_id, "mismatch", n, Divergence(n, b_next, p_next, (), (), False, reason), delta)
    return PromptComparison(b.prompt_id, "exact", n, None, delta)


@dataclass(frozen=True)
class ComparisonResult:
    prompts: tuple[PromptComparison, ...]
    top_k: int

    @property
    def n_exact(self) -> int:
        return sum(p.status == "exact" for p in self.prompts)

    @property
    def n_tolerated(self) -> int:
        return sum(p.status == "tolerated" for p in self.prompts)

    @property
    def n_mismatch(self) -> int:
        return sum(p.status == "mismatch" for p in self.prompts)

    @property
    def passed(self) -> bool:
        return bool(self.prompts) and self.n_mismatch == 0

    @property
    def max_logprob_delta(self) -> float | None:
        deltas = [p.max_logprob_delta for p in self.prompts if p.max_logprob_delta is not None]
        return max(deltas) if deltas else None

    def over_logprob_threshold(self, threshold: float) -> list[PromptComparison]:
        return [p for p in self.prompts if p.max_logprob_delta is not None and p.max_logprob_delta > threshold]

    @property
    def first_divergence(self) -> PromptComparison | None:
        for status in ("mismatch", "tolerated"):
            for p in self.prompts:
                if p.status == status:
                    return p
        return None

    def summary(self) -> str:
        s = (
            f"{len(self.prompts)} prompts: {self.n_exact} exact, {self.n_tolerated} tolerated (top-{self.top_k}), "
            f"{self.n_mismatch} mismatched"
        )
        fd = self.first_divergence
        if fd and fd.divergence:
            d = fd.divergence
            s += (
                f"; first divergence {fd.prompt_id} at token {d.position}: "
                f"baseline {d.baseline_token} vs P/D {d.pd_token} ({d.reason})"
            )
        return s

    def to_dict(self) -> dict:
        return {
            "top_k": self.top_k,
            "passed": self.passed,
            "exact": self.n_exact,
            "tolerated": self.n_tolerated,
            "mismatch": self.n_mismatch,
            "max_logprob_delta": self.max_logprob_delta,
            "prompts": [p.to_dict() for p in self.prompts],
        }


def compare_completions(baseline: Sequence[Completion], pd: Sequence[Completion], top_k: int = 5) -> ComparisonResult:
    if top_k < 1:
        raise ValueError("top_k must be >= 1")
    b_by = {c.prompt_id: c for c in baseline}
    p_by = {c.prompt_id: c for c in pd}
    out = []
    for pid in list(b_by) + [x for x in p_by if x not in b_by]:
        if pid not in p_by or pid not in b_by:
            side = "P/D" if pid not in p_by else "baseline"
            out.append(
                PromptComparison(pid, "mismatch", 0, Divergence(0, None, None, (), (), False, f"missing on {side}"))
            )
            continue
        out.append(compare_one(b_by[pid], p_by[pid], top_k))
    return ComparisonResult(tuple(out), top_k)
