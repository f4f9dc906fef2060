"""D's prefix cache under P/D (pure): each scenario request's prompt tokens split between D's own cache and the
transfer from P exactly as predicted, and every answer the same as the baseline's."""

from __future__ import annotations

from dataclasses import dataclass

from harness.checks.check import Check
from harness.workload.prefix import SOURCES, Expected, PrefixCase


@dataclass(frozen=True)
class Sourced:
    """What D's ``vllm:prompt_tokens_by_source_total`` grew by around one request (None: not exported)."""

    case: PrefixCase
    expected: Expected
    measured: dict[str, float] | None

    @property
    def exact(self) -> bool:
        return self.measured is not None and all(
            self.measured.get(s, 0.0) == v for s, v in self.expected.as_dict().items()
        )

    def to_dict(self) -> dict:
        return {
            **self.case.to_dict(),
            "expected": self.expected.as_dict(),
            "measured": self.measured,
            "exact": self.exact,
        }


def check_sources(rows: list[Sourced]) -> Check:
    """Every request's split is the predicted one; a scenario set without a single local hit proves nothing."""
    bad = [r for r in rows if not r.exact]
    hits = sum(1 for r in rows if r.measured and r.measured.get("local_cache_hit", 0) > 0)
    missing = [r.case.id for r in rows if r.measured is None]
    if missing:
        detail = f"D's /metrics has no prompt_tokens_by_source for {', '.join(missing)}"
    elif bad:
        first = bad[0]
        detail = (
            f"{len(bad)} of {len(rows)} requests split otherwise than predicted; first {first.case.id} "
            f"({first.case.scenario}, {first.case.length} tokens): expected {first.expected.as_dict()}, "
            f"measured {_ints(first.measured)}"
        )
    else:
        detail = f"{len(rows)} requests split exactly as predicted ({hits} with a local prefix hit)"
    return Check(
        "prefix_cache_sources_exact",
        bool(rows) and not bad and not missing and hits > 0,
        detail + ("" if hits or missing or bad else "; no request hit D's prefix cache, so nothing was tested"),
        {"requests": [r.to_dict() for r in rows]},
    )


def _ints(d: dict[str, float] | None) -> dict[str, int]:
    return {s: int((d or {}).get(s, 0)) for s in SOURCES}
