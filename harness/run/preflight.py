"""Pre-launch validation (pure): the problems that make a P/D run impossible, before anything starts.

Each problem is one line. A pair vLLM rejects *by design* (regime D: a replicated prefill TP
larger than the decode TP) is not a problem here: the matrix runs it on purpose to observe the
refusal; ``Preflight.topology`` carries that prediction (``expected == "rejected"``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from harness.core.errors import ConfigError
from harness.models.rules import (
    CPU_BLOCK_MULTIPLE,
    VLLM_DEFAULT_BLOCK_SIZE,
    block_sizes_problem,
    tp_head_problems,
    tp_pair_problem,
)
from harness.models.topology import ModelShape, Topology, predict
from harness.run.config import E2EConfig

# vLLM's CPU MLA backend forces this block size whatever is asked (vllm/platforms/cpu.py, "CPU MLA backend
# requires block_size=16"): the topology prediction, and the KV pool is counted in it (RunContext.pool_block_size).
CPU_MLA_BLOCK = 16


@dataclass(frozen=True)
class Preflight:
    problems: tuple[str, ...]
    topology: Topology | None  # None when the model's heads are unknown

    @property
    def ok(self) -> bool:
        return not self.problems

    def message(self) -> str:
        """All problems on one line."""
        return "; ".join(self.problems)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def preflight(
    attention_heads: int | None,
    kv_heads: int | None,
    tp_p: int,
    tp_d: int,
    block_size_p: int | None = None,
    block_size_d: int | None = None,
    device: str = "cpu",
    cpu_cores: int | None = None,
    vllm_version: str | None = None,
    mla: bool = False,
    head_dim: int | None = None,
    pp_p: int = 1,
    dcp_d: int = 1,
) -> Preflight:
    """Problems and the predicted topology for a run. Heads ``None``: the model is unknown, head checks are skipped.
    ``mla``: the model uses MLA (no K rule; regime M); ``head_dim``: for the block lengths (default 64).

    Block sizes ``None`` mean the harness default (32 on CPU, vLLM's own on GPU); D's defaults to P's.
    ``cpu_cores`` (CPU only) defaults to the cores this process may use. ``pp_p``, ``dcp_d``: P's pipeline stages
    and D's decode context parallel size, for the topology.
    """
    problems: list[str] = []
    sides = (("prefill", tp_p), ("decode", tp_d))
    for side, tp in sides:
        if not isinstance(tp, int) or tp < 1:
            problems.append(f"{side} TP must be a positive integer, got {tp!r}")
    if problems:
        return Preflight(tuple(problems), None)

    known = attention_heads is not None and kv_heads is not None
    if attention_heads is not None and kv_heads is not None:  # known
        if attention_heads < 1 or kv_heads < 1 or (attention_heads % kv_heads and not mla):
            problems.append(
                f"the model's heads are inconsistent: {attention_heads} attention heads, {kv_heads} KV heads"
            )
            known = False
        else:
            for side, tp in sides:
                problems += tp_head_problems(attention_heads, kv_heads, side, tp, mla)
    pair = tp_pair_problem(tp_p, tp_d)
    if pair:
        problems.append(pair)

    default_bs = CPU_BLOCK_MULTIPLE if device == "cpu" else None
    bs_p = block_size_p or default_bs
    bs_d = block_size_d or bs_p
    for side, bs in (("prefill", block_size_p), ("decode", block_size_d)):
        if bs is not None and bs < 1:
            problems.append(f"{side} block size must be a positive integer, got {bs!r}")
    blocks = block_sizes_problem(bs_p, bs_d)
    if blocks:
        problems.append(blocks)

    if device == "cpu":
        cores = available_cores() if cpu_cores is None else cpu_cores
        for side, bs in (("prefill", bs_p), ("decode", bs_d)):
            if bs and bs >= 1 and bs % CPU_BLOCK_MULTIPLE:
                problems.append(
                    f"cannot run on this CPU machine: {side} block size {bs} is not a multiple of "
                    f"{CPU_BLOCK_MULTIPLE} (vLLM's CPU attention needs that)"
                )
        for side, tp in sides:
            if tp > cores:
                problems.append(
                    f"cannot run on this CPU machine: {side} TP {tp} needs {tp} CPU cores, this machine has {cores}"
                )

    topo = None
    if known and attention_heads is not None and kv_heads is not None:
        p = bs_p if bs_p and bs_p >= 1 else VLLM_DEFAULT_BLOCK_SIZE
        d = bs_d if bs_d and bs_d >= 1 else p
        if mla and device == "cpu":
            p = d = CPU_MLA_BLOCK
        shape = ModelShape(attention_heads, kv_heads, head_dim or 64, mla=mla)
        topo = predict(shape, tp_p, tp_d, p, d, vllm_version, pp_p=pp_p, dcp_d=dcp_d)
    return Preflight(tuple(problems), topo)


def config_heads(cfg: E2EConfig) -> tuple[int | None, int | None]:
    """(attention heads, KV heads) of the model ``cfg`` will serve, without building or downloading anything.

    No ``--model`` on CPU: the tiny local model's shape (the trained one for accuracy runs), from its spec.
    A local folder's config.json, or the hub id's in the local Hugging Face cache; else configs/models.yaml;
    (None, None) when unknown there.
    """
    if cfg.model is None:
        if cfg.accuracy is not None:
            from harness.models.trained import TrainedModelSpec

            arch = TrainedModelSpec().arch
        else:
            from harness.models.tiny import TinyModelSpec

            arch = TinyModelSpec()
        return arch.heads, arch.kv_heads
    from harness.models.heads import model_heads

    h = model_heads(cfg.model)
    return h["attention_heads"], h["kv_heads"]


def config_mla(cfg: E2EConfig) -> tuple[bool, int | None]:
    """(uses MLA, its latent width) of the model ``cfg`` will serve; the local tiny and trained models are Llamas.
    The width only for MLA: the other predictions keep their head_dim of 64."""
    if cfg.model is None:
        return False, None
    from harness.models.heads import model_heads

    h = model_heads(cfg.model)
    return (True, h.get("head_dim")) if h.get("mla") else (False, None)


def model_problem(model: str | None) -> str | None:
    """Why ``model`` cannot be served from this machine's files, one line naming how to fetch it (None: it can; no
    model: the local tiny or trained one, built here)."""
    if model is None:
        return None
    from harness.models.hub import availability

    return availability(model)


def require_model(model: str | None, why: str = "") -> None:
    """``model_problem`` as a ``ConfigError`` (``why`` goes first: what needs the model here)."""
    problem = model_problem(model)
    if problem:
        raise ConfigError(f"{why}{problem}")


def preflight_config(cfg: E2EConfig, cpu_cores: int | None = None, vllm_version: str | None = None) -> Preflight:
    heads, kv = config_heads(cfg)
    mla, head_dim = config_mla(cfg)
    pf = preflight(
        heads,
        kv,
        cfg.tp_p,
        cfg.tp_d,
        cfg.block_size_p,
        cfg.block_size_d,
        cfg.device,
        cpu_cores,
        vllm_version,
        mla,
        head_dim,
        cfg.axes.pp_p,
        cfg.axes.dcp_d,
    )
    missing = model_problem(cfg.model)  # first: without the model the head checks had nothing to check
    return Preflight((missing, *pf.problems), pf.topology) if missing else pf


def check_config(cfg: E2EConfig, cpu_cores: int | None = None, vllm_version: str | None = None) -> Preflight:
    """``preflight_config``, raising ``ConfigError`` (one line) on any problem."""
    pf = preflight_config(cfg, cpu_cores, vllm_version)
    if pf.problems:
        raise ConfigError(pf.message())
    return pf


def check_gpus(cfg: E2EConfig, nvml=None) -> None:
    """--device gpu: the GPUs can be read (NVML) and the P/D pair has a placement on them; ``ConfigError`` (one
    line) otherwise, so the run stops before it makes a run folder. ``nvml``: a stand-in module for tests."""
    from harness.gpu.run import GpuRun

    # raises ConfigError: unreadable, no GPU, no placement, or a hand-given share the colocation cannot hold
    GpuRun(cfg.tp_p, cfg.tp_d, cfg.model, nvml=nvml, gpu_memory_utilization=cfg.gpu_memory_utilization)


def attached_baseline_gpu(cfg: E2EConfig, model: str, nvml=None):
    """Attach mode on GPU, the baseline launched here: a GpuRun whose plan holds only it, at D's TP, alone on this
    host's GPUs (its free-memory and release checks apply; the P/D phase has nothing here to check). ConfigError: no
    placement on this host's GPUs."""
    from harness.gpu.run import GpuRun

    try:
        return GpuRun(
            cfg.tp_d, cfg.tp_d, model, nvml=nvml, gpu_memory_utilization=cfg.gpu_memory_utilization, baseline_only=True
        )
    except ConfigError as e:
        raise ConfigError(f"the baseline runs here (no --baseline-url): {e}") from None


def check_attached(cfg: E2EConfig, baseline_here: bool, nvml=None) -> None:
    """Attach mode, before the run: a baseline launched here needs the model on this machine and, on GPU, a place on
    this host's GPUs (ConfigError, one line). P and D run elsewhere with their own TP sizes: nothing of theirs here."""
    if not baseline_here:
        return
    require_model(cfg.model, "the baseline runs here (no --baseline-url), but ")
    if cfg.device == "gpu":
        attached_baseline_gpu(cfg, str(cfg.model), nvml)
