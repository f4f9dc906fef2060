"""A check is one named, explained pass/fail entry of a report."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True)
class Check:
    name: str
    passed: bool
    detail: str
    data: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if d["data"] is None:
            del d["data"]
        return d


def failed_checks_reason(failed: Iterable[tuple[object, object]]) -> str:
    """A run's failure reason when its checks failed: each (name, detail) as "name: detail", joined by "; " (the
    report page tells such a reason from an exception's by this form)."""
    return "; ".join(f"{name}: {detail}" for name, detail in failed)
