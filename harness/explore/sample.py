"""Drawing samples from the declared space (pure, deterministic for a seed).

Each value's weight is divided by one plus the times it has been drawn, so values not yet covered come first; a TP
size at the model's K or at twice it gets the space's boundary weight (where GQA replication starts). A block size
of P that does not divide D's is redrawn from the D sizes it divides (vLLM states that constraint; the planner
predicts the rest)."""

from __future__ import annotations

import hashlib
import json
import random
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from harness.explore.space import Choice, Space


@dataclass(frozen=True)
class Sample:
    model: str
    kv_heads: int | None
    values: Mapping[str, Any] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return "x-" + hashlib.sha256(self.key().encode()).hexdigest()[:10]

    def key(self) -> str:
        return json.dumps({"model": self.model, "kv_heads": self.kv_heads, **self.values}, sort_keys=True)

    def axis_values(self) -> dict[str, str]:
        """Every axis as ``name -> value`` words (the model and its K included): what coverage counts."""
        out = {"model": self.model, "kv_heads": _word(self.kv_heads)}
        out.update({k: _word(v) for k, v in self.values.items()})
        return out

    def describe(self) -> str:
        set_ = ", ".join(f"{k}={v}" for k, v in sorted(self.axis_values().items()) if v not in ("null", "false"))
        return f"{self.id}: {set_}"

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "model": self.model, "kv_heads": self.kv_heads, "values": dict(self.values)}


class Sampler:
    """Draws samples; ``covered`` counts (axis, value) words already drawn (a resumed explore passes its own)."""

    def __init__(self, space: Space, seed: int, k_of: Mapping[str, int] | None = None, covered: Counter | None = None):
        self.space, self.rng = space, random.Random(seed)
        self.k_of = dict(k_of or {})
        self.covered: Counter = covered if covered is not None else Counter()

    def _pick(self, axis: str, choice: Choice, k: int | None) -> Any:
        weights = []
        for i, v in enumerate(choice.values):
            w = choice.weight(i) / (1 + self.covered[(axis, _word(v))])
            if axis in ("tp_p", "tp_d") and k is not None and v in (k, 2 * k):
                w *= self.space.boundary_weight
            weights.append(w)
        return self.rng.choices(choice.values, weights)[0]

    def draw(self) -> Sample:
        models = self.space.models
        m = models[self.rng.choices(range(len(models)), [1 / (1 + self.covered[("model", x.id)]) for x in models])[0]]
        k = self._pick("kv_heads", Choice(values=m.kv_heads), None) if m.kv_heads else None
        known_k = k if k is not None else self.k_of.get(m.id)
        values = {axis: self._pick(axis, c, known_k) for axis, c in sorted(self.space.axes.items())}
        bp, bd = values.get("block_size_p"), values.get("block_size_d")
        if bp and bd and bd % bp:
            fits = [v for v in self.space.axes["block_size_d"].values if v and v % bp == 0]
            values["block_size_d"] = self.rng.choice(fits) if fits else bp
        s = Sample(m.id, k, values)
        self.covered.update(s.axis_values().items())
        return s


def _word(v: Any) -> str:
    return v if isinstance(v, str) else json.dumps(v)
