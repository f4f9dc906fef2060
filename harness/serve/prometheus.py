"""A small parser for the Prometheus text exposition format (what vLLM's /metrics serves)."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_ESCAPES = {"\\": "\\", '"': '"', "n": "\n"}


@dataclass(frozen=True)
class Sample:
    name: str
    labels: Mapping[str, str]
    value: float


def _parse_value(tok: str) -> float:
    t = tok.strip()
    low = t.lower()
    if low in ("nan",):
        return math.nan
    if low in ("+inf", "inf"):
        return math.inf
    if low == "-inf":
        return -math.inf
    return float(t)


def _parse_labels(s: str, i: int, lineno: int) -> tuple[dict[str, str], int]:
    labels: dict[str, str] = {}
    n = len(s)
    while True:
        while i < n and s[i] in " ,":
            i += 1
        if i < n and s[i] == "}":
            return labels, i + 1
        m = _NAME.match(s, i)
        if not m:
            raise ValueError(f"line {lineno}: bad label name")
        key = m.group(0)
        i = m.end()
        if i >= n or s[i] != "=" or i + 1 >= n or s[i + 1] != '"':
            raise ValueError(f'line {lineno}: expected =" after label {key}')
        i += 2
        buf = []
        while True:
            if i >= n:
                raise ValueError(f"line {lineno}: unterminated label value")
            c = s[i]
            if c == "\\" and i + 1 < n:
                buf.append(_ESCAPES.get(s[i + 1], s[i + 1]))
                i += 2
            elif c == '"':
                i += 1
                break
            else:
                buf.append(c)
                i += 1
        labels[key] = "".join(buf)


def parse_metrics(text: str) -> list[Sample]:
    out: list[Sample] = []
    for lineno, raw in enumerate(text.splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        m = _NAME.match(line)
        if not m:
            raise ValueError(f"line {lineno}: bad metric name: {raw[:80]!r}")
        name, i = m.group(0), m.end()
        labels: dict[str, str] = {}
        if i < len(line) and line[i] == "{":
            labels, i = _parse_labels(line, i + 1, lineno)
        rest = line[i:].split()
        if not rest or len(rest) > 2:
            raise ValueError(f"line {lineno}: expected a value (and optional timestamp): {raw[:80]!r}")
        try:
            value = _parse_value(rest[0])
        except ValueError:
            raise ValueError(f"line {lineno}: bad value {rest[0]!r}") from None
        out.append(Sample(name, labels, value))
    return out


def metric_sum(samples: Sequence[Sample], name: str, **labels: str) -> float | None:
    """Sum over samples of ``name`` whose labels include ``labels``; None if the name is absent."""
    found = False
    total = 0.0
    for s in samples:
        if s.name != name:
            continue
        found = True
        if all(s.labels.get(k) == v for k, v in labels.items()):
            total += s.value
    return total if found else None


@dataclass(frozen=True)
class MetricDelta:
    """A counter read before and after a phase: its growth, and whether the server exposes it at all."""

    before: float | None
    after: float | None

    @property
    def present(self) -> bool:
        return self.after is not None

    @property
    def delta(self) -> float:
        return (self.after or 0.0) - (self.before or 0.0)


def delta(before: Sequence[Sample], after: Sequence[Sample], name: str, **labels: str) -> MetricDelta:
    return MetricDelta(metric_sum(before, name, **labels), metric_sum(after, name, **labels))


def first_present(samples: Sequence[Sample], names: Sequence[str], **labels: str) -> tuple[str, float] | None:
    """Metric names move between vLLM releases: the first candidate present, with its sum."""
    for n in names:
        v = metric_sum(samples, n, **labels)
        if v is not None:
            return n, v
    return None
