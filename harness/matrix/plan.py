"""The GQA-replication matrix plan: which entries run here, with their predictions (pure)."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.matrix.config import MatrixEntry, MatrixFile, shape_of
from harness.models.config import ModelEntry
from harness.models.topology import predict


@dataclass(frozen=True)
class PlannedPair:
    id: str
    model: str
    device: str
    tp_p: int
    tp_d: int
    kv_heads: int
    regime: str
    predicted: str  # what the topology math says of this version
    expected: str  # what the entry expects of this version (a recorded known failure included)
    version_family: str
    run: bool
    skip_reason: str | None
    tolerated: str | None = None  # a known intermittent failure class, accepted beside `expected`

    def to_dict(self) -> dict:
        return asdict(self)


def _selected(e: MatrixEntry, models: dict[str, ModelEntry], only: set[str] | None, model: str | None,
              tp_p: int | None, tp_d: int | None) -> bool:
    if only and e.id not in only:
        return False
    if model and model not in (e.model, models[e.model].hub_id):
        return False
    return (tp_p is None or e.tp_p == tp_p) and (tp_d is None or e.tp_d == tp_d)


def plan(matrix: MatrixFile, models: dict[str, ModelEntry], vllm_version: str | None, device: str, gpus_present: int,
         only: set[str] | None = None, model: str | None = None, tp_p: int | None = None, tp_d: int | None = None) -> list[PlannedPair]:
    """Entries passing the filters, each marked to run or skipped with a reason. Unknown ``only`` ids are an error."""
    if only:
        unknown = sorted(only - {e.id for e in matrix.entries})
        if unknown:
            raise ValueError(f"unknown matrix id(s): {', '.join(unknown)}")
    out = []
    for e in matrix.entries:
        if not _selected(e, models, only, model, tp_p, tp_d):
            continue
        shape = shape_of(e, models[e.model])
        t = predict(shape, e.tp_p, e.tp_d, vllm_version=vllm_version)
        skip = None
        if e.device != device:
            skip = f"a {e.device} entry; this run is on {device}"
        elif e.device == "gpu" and (e.gpus or 0) > gpus_present:
            skip = f"needs {e.gpus} GPUs, {gpus_present} present"
        out.append(PlannedPair(e.id, e.model, e.device, e.tp_p, e.tp_d, shape.kv_heads, t.regime, t.expected,
                               e.expected_for(t.version_family), t.version_family, skip is None, skip,
                               e.tolerated_for(t.version_family)))
    return out


def render_plan(pairs: list[PlannedPair], vllm_version: str | None) -> str:
    lines = [f"GQA-replication matrix on vLLM {vllm_version or '(fixed)'}: {sum(p.run for p in pairs)} to run, "
             f"{sum(not p.run for p in pairs)} skipped"]
    for p in pairs:
        state = "to run" if p.run else f"skip: {p.skip_reason}"
        also = f" (or, known intermittent: {p.tolerated})" if p.tolerated else ""
        lines.append(f"  {p.id:<20} K={p.kv_heads} P{p.tp_p}->D{p.tp_d} regime {p.regime}  predicted {p.predicted:<13} "
                     f"expected {p.expected:<13} [{state}]{also}")
    return "\n".join(lines)
