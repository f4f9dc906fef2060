"""The declared space explore samples (configs/explore_space.yaml), validated when read."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from harness.core.paths import REPO_ROOT
from harness.matrix.config import Axes, Expected, MatrixEntry
from harness.models.config import load_yaml

SPACE_YAML = REPO_ROOT / "configs" / "explore_space.yaml"
# The fields of a sample that are the entry's own; every other axis is one of MatrixEntry.axes.
ENTRY_FIELDS = frozenset({"tp_p", "tp_d", "block_size_p", "block_size_d", "kv_layout_d"})


class Choice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    values: list[Any] = Field(min_length=1)
    weights: list[float] | None = None

    @model_validator(mode="after")
    def _weights(self) -> Choice:
        if self.weights is not None and (len(self.weights) != len(self.values) or min(self.weights) <= 0):
            raise ValueError("weights: one positive weight per value")
        return self

    def weight(self, i: int) -> float:
        return 1.0 if self.weights is None else self.weights[i]


class SpaceModel(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)  # an id of configs/models.yaml
    kv_heads: list[int] | None = None  # the tiny Llama's K, built locally; None: the model's own

    @model_validator(mode="after")
    def _k(self) -> SpaceModel:
        if self.kv_heads is not None and (not self.kv_heads or min(self.kv_heads) < 1):
            raise ValueError("kv_heads: one or more positive K")
        return self


class Space(BaseModel):
    model_config = ConfigDict(extra="forbid")
    boundary_weight: float = Field(default=2.0, ge=1.0)
    models: list[SpaceModel] = Field(min_length=1)
    axes: dict[str, Choice] = Field(min_length=1)

    @model_validator(mode="after")
    def _known_axes(self) -> Space:
        unknown = sorted(set(self.axes) - ENTRY_FIELDS - set(Axes.model_fields))
        if unknown:
            raise ValueError(f"unknown axis {', '.join(unknown)} (entry fields and configs/edge_cases.yaml's axes)")
        return self


def load_space(path: Path = SPACE_YAML) -> Space:
    """The space; any problem is one line naming the file and field."""
    return load_yaml(Path(path), Space)


def entry_of(sample_id: str, model: str, kv_heads: int | None, values: dict[str, Any]) -> MatrixEntry:
    """A sample as an edge-matrix entry (validated as one); its expectation is left to the planner's prediction."""
    fields = {k: v for k, v in values.items() if k in ENTRY_FIELDS and v is not None}
    axes = {k: v for k, v in values.items() if k not in ENTRY_FIELDS and v is not None}
    return MatrixEntry(
        id=sample_id,
        model=model,
        kv_heads=kv_heads,
        device="cpu",
        expected=Expected.model_validate({"pre-fix": "ok", "fixed": "ok"}),
        axes=Axes(**axes),
        **fields,
    )
