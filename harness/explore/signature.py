"""What a failed sample shows, and whether it is new (pure).

A signature is the run's outcome (its failure class in the matrix's words) and the checks that failed: two samples
with one signature are one finding, counted, not two. Checks that only run with an axis or a phase (D's prefix-cache
scenarios, the load phase, spec decode's acceptance, DP, preemption, EP) count only when no check of every run
failed: a wrong KV block fails the prefix-cache scenarios too where they run, and is still one finding. A finding
is *expected* when the topology predicted that outcome, *known* when configs/known_issues.yaml matches its class (and
log signature) or an edge-matrix entry records a known failure of that class on settings the sample also has, and
*new* otherwise. The axis values that matter are those every failing sample of a signature has and no passing sample
has: a planted fault that one axis value triggers is found as that value.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from harness.checks import expert_parallel, spec_decode
from harness.matrix.config import MatrixFile
from harness.upstream.known import KnownIssues

PASS, EXPECTED, KNOWN, NEW = "pass", "expected", "known", "new"


@dataclass(frozen=True)
class Signature:
    outcome: str
    checks: tuple[str, ...]  # the failed checks, sorted

    def text(self) -> str:
        return self.outcome + (f" ({', '.join(self.checks)})" if self.checks else "")


# Checks a run makes only with an axis or a phase (the rest every run makes)
AXIS_CHECK_PREFIXES = ("prefix_cache_", "load_")
AXIS_CHECKS = frozenset({spec_decode.CHECK_NAME, expert_parallel.CHECK_NAME, "dp_engines_each_received", "d_preempted"})


def is_axis_check(name: str) -> bool:
    return name in AXIS_CHECKS or name.startswith(AXIS_CHECK_PREFIXES)


def signature_of(observed: str, report: Mapping[str, Any]) -> Signature | None:
    """The signature of a run's outcome (None: it passed): its failed checks that every run makes, or, when only
    an axis's checks failed, those."""
    if observed == "ok":
        return None
    failed = sorted(str(c.get("name")) for c in report.get("checks") or [] if not c.get("passed"))
    core = [name for name in failed if not is_axis_check(name)]
    return Signature(observed, tuple(core or failed))


def known_edge_failure(
    edge: MatrixFile, outcome: str, settings: Mapping[str, Any], model: str | None = None, kv_heads: int | None = None
) -> str | None:
    """The edge entry that records a known failure of ``outcome`` on settings the sample also has: the same model
    family (its K where both name one) with a subset of its settings, or, for an entry of another model, settings
    of its own that the sample has, unless the failure is the entry's model's own (``model_only``) (None: none)."""
    for e in edge.entries:
        kf = e.known_failure
        if kf is None or kf.cls != outcome:
            continue
        mine = e.settings()
        if not all(settings.get(k) == v for k, v in mine.items()):
            continue
        same_model = e.model == model and (e.kv_heads is None or kv_heads is None or e.kv_heads == kv_heads)
        if same_model or (mine and not kf.model_only):
            return e.id
    return None


def classify(
    observed: str,
    predicted: str,
    signature: Signature | None,
    settings: Mapping[str, Any],
    known: KnownIssues,
    edge: MatrixFile,
    text: str = "",
    version: str | None = None,
    model: str | None = None,
    kv_heads: int | None = None,
) -> tuple[str, str]:
    """(pass | expected | known | new, why)."""
    if signature is None:
        return PASS, ""
    if observed == predicted:
        return EXPECTED, f"the topology predicted {predicted}"
    reports = known.for_failure(observed, text, version)
    if reports:
        return KNOWN, known.line(reports)
    entry = known_edge_failure(edge, observed, settings, model, kv_heads)
    if entry:
        return KNOWN, f"the known failure of edge entry {entry} (configs/edge_cases.yaml)"
    return NEW, "no known upstream report or edge entry matches"


def values_that_matter(failing: Sequence[Mapping[str, str]], passing: Iterable[Mapping[str, str]]) -> dict[str, str]:
    """The axis values every failing sample has and no passing sample has."""
    if not failing:
        return {}
    common = set(failing[0].items())
    for f in failing[1:]:
        common &= set(f.items())
    seen_passing = {kv for p in passing for kv in p.items()}
    return dict(sorted(kv for kv in common if kv not in seen_passing))
