"""GPU placement for a P/D run (pure): which GPUs each server sees and how much of them it may take.

Servers are laid out in order (prefill instances, then decode instances), their TP ranks on
consecutive GPU ids wrapping modulo the GPU count, as upstream's accuracy script does. When the
ranks fit, every server gets its own GPUs; when they do not, servers share GPUs (colocation) and
split the memory budget of each shared GPU. The baseline (D's TP, D's GPUs) always runs alone.

Memory rule (per TP rank, in GiB):
    need = weights / tp * WEIGHT_OVERHEAD + HEADROOM_GIB
``WEIGHT_OVERHEAD`` covers the parts TP does not shard (norms, KV projections replicated when
tp > K); ``HEADROOM_GIB`` covers the CUDA context, vLLM's profiling activation peak, CUDA graphs,
NCCL buffers, and a KV cache of at least a few full-length sequences of these small models.
A server's ``gpu_memory_utilization`` is its share of each of its GPUs; vLLM refuses to start when
a GPU's free memory is below that share, so the shares on one GPU add up to at most ``max_util``
(0.9: what is left holds the other processes' CUDA contexts).

A utilization given by hand (--gpu-memory-utilization, GPU_MEMORY_UTILIZATION) keeps vLLM's meaning:
each server's own share of each of its GPUs. Every server takes it as given, never scaled (a maintainer
who asks for 0.4 gets 0.4 in every server's command line); where P/D servers share a GPU their shares
must still add up to at most ``max_util``, else the plan is refused (``UtilizationError``) with the
largest value that fits. A server alone on its GPUs may take any value vLLM accepts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "half": 2, "auto": 2, "float32": 4, "float": 4}
WEIGHT_OVERHEAD = 1.1
HEADROOM_GIB = 4.0
MAX_UTIL = 0.9
UTIL_STEP = 0.01  # shares are rounded down to this
GIB = 2**30
# NVML (nvidia-smi, harness/gpu/nvml.py) numbers GPUs by PCI bus id; CUDA by default puts the fastest
# first. Without this, CUDA_VISIBLE_DEVICES=2 may not be the GPU that NVML calls 2.
CUDA_DEVICE_ORDER = "PCI_BUS_ID"


class PlanError(ValueError):
    """The requested layout cannot run here; the message says what would."""


class UtilizationError(PlanError):
    """The gpu_memory_utilization given by hand does not fit the layout (shared GPUs, or short of a rank's need)."""


@dataclass(frozen=True)
class Gpu:
    id: int  # NVML's index (PCI bus order, absolute on the host): what the server's CUDA_VISIBLE_DEVICES names
    total_gib: float
    name: str = ""  # model name as NVML gives it ("" when the inventory is assumed)


def uniform_gpus(count: int, mem_gib: float) -> tuple[Gpu, ...]:
    return tuple(Gpu(i, mem_gib) for i in range(count))


@dataclass(frozen=True)
class ModelMemory:
    weights_gib: float
    source: str  # how the size was found, for the report

    def need_per_rank_gib(self, tp: int) -> float:
        return self.weights_gib / tp * WEIGHT_OVERHEAD + HEADROOM_GIB


def model_memory(
    model: str | None, dtype: str = "bfloat16", weights_gib: float | None = None, models=None
) -> ModelMemory:
    """The weights' size: given, else a local folder's weight files, else params_b of configs/models.yaml, else of the
    model's safetensors headers in the local Hugging Face cache; its source says which."""
    if weights_gib is not None:
        if weights_gib < 0:
            raise PlanError(f"weights size must be >= 0 GiB, got {weights_gib}")
        return ModelMemory(weights_gib, "given")
    if model is None:
        return ModelMemory(0.0, "no model given: headroom only")
    if dtype not in DTYPE_BYTES:
        raise PlanError(f"unknown dtype {dtype!r} (known: {', '.join(DTYPE_BYTES)})")
    folder = Path(model)
    if folder.is_dir():
        files = [f for pat in ("*.safetensors", "*.bin") for f in folder.glob(pat)]
        if files:
            return ModelMemory(sum(f.stat().st_size for f in files) / GIB, f"weight files in {folder}")
    if models is None:
        from harness.models.config import load_models

        models = load_models()
    listed = models.find(model, files=False)
    entry = listed or models.find(model)  # not listed: this machine's copy (models/config.py entry_from_files)
    if entry is None or entry.params_b is None:
        what = "unknown model" if entry is None else "no params_b for model"
        raise PlanError(f"{what} {model!r}: add params_b to configs/models.yaml or give the weights size in GiB")
    b = DTYPE_BYTES[dtype]
    where = "configs/models.yaml" if listed is not None else f"its safetensors headers ({entry.description})"
    return ModelMemory(entry.params_b * 1e9 * b / GIB, f"params_b {entry.params_b:g} x {b} B ({dtype}) from {where}")


@dataclass(frozen=True)
class ServerPlacement:
    role: str  # prefill / decode / baseline
    index: int
    tp: int
    gpus: tuple[int, ...]  # CUDA_VISIBLE_DEVICES, rank i on gpus[i]
    gpu_memory_utilization: float
    need_gib_per_gpu: float  # what one rank needs (memory rule above)
    phase: str  # "baseline" or "pd": servers of one phase run at the same time

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def cuda_visible_devices(self) -> str:
        return ",".join(str(g) for g in self.gpus)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["gpus"] = list(self.gpus)
        d["cuda_visible_devices"] = self.cuda_visible_devices
        return d


@dataclass(frozen=True)
class GpuPlan:
    gpus: tuple[Gpu, ...]
    servers: tuple[ServerPlacement, ...]
    colocated: bool
    model: ModelMemory
    order: tuple[str, ...]  # phases in launch order
    stagger_start: bool  # start the P/D servers one after another (see notes)
    notes: tuple[str, ...] = ()
    max_util: float = MAX_UTIL
    baseline_alone: bool = True  # the harness never runs the baseline beside P/D
    util_given: float | None = None  # a gpu_memory_utilization given by hand, taken by every server
    simulated: str | None = None  # planned on a simulated box (PD_HARNESS_SIMULATED_GPUS's value): stand-ins serve

    def server(self, role: str, index: int = 0) -> ServerPlacement:
        for s in self.servers:
            if (s.role, s.index) == (role, index):
                return s
        raise KeyError(f"{role}{index}")

    def phase(self, phase: str) -> tuple[ServerPlacement, ...]:
        return tuple(s for s in self.servers if s.phase == phase)

    def required_free_gib(self, phase: str | None = None) -> dict[int, float]:
        """GiB each GPU must have free before launch: the sum of its servers' shares (the larger phase, unless one is
        named)."""
        totals = {g.id: g.total_gib for g in self.gpus}
        phases = [phase] if phase else list(self.order)
        out: dict[int, float] = {}
        for ph in phases:
            per_gpu: dict[int, float] = {}
            for s in self.phase(ph):
                for g in s.gpus:
                    per_gpu[g] = per_gpu.get(g, 0.0) + s.gpu_memory_utilization * totals[g]
            for g, v in per_gpu.items():
                out[g] = max(out.get(g, 0.0), v)
        return dict(sorted(out.items()))

    def to_dict(self) -> dict:
        return {
            "servers": [s.to_dict() for s in self.servers],
            "colocated": self.colocated,
            "baseline_alone": self.baseline_alone,
            "order": list(self.order),
            "stagger_start": self.stagger_start,
            "cuda_device_order": CUDA_DEVICE_ORDER,
            "gpus": [asdict(g) for g in self.gpus],
            "max_util_per_gpu": self.max_util,
            "gpu_memory_utilization_given": self.util_given,
            "model_memory": {
                **asdict(self.model),
                "rule": f"per rank: weights/tp x {WEIGHT_OVERHEAD} + {HEADROOM_GIB} GiB headroom",
            },
            "required_free_gib": {str(k): round(v, 2) for k, v in self.required_free_gib().items()},
            "notes": list(self.notes),
            **({"simulated": self.simulated} if self.simulated else {}),
        }


def floor_util(x: float) -> float:
    return round(math.floor(x / UTIL_STEP + 1e-9) * UTIL_STEP, 4)


def _check_inputs(gpus: Sequence[Gpu], tp_p: int, tp_d: int, num_p: int, num_d: int, max_util: float) -> None:
    if not gpus:
        raise PlanError("no GPUs: P/D on GPU needs at least one")
    ids = [g.id for g in gpus]
    if len(set(ids)) != len(ids):
        raise PlanError(f"GPU ids repeat: {ids}")
    if any(g.id < 0 or g.total_gib <= 0 for g in gpus):
        raise PlanError("GPU ids must be >= 0 and memory > 0 GiB")
    for name, v in (
        ("prefill TP", tp_p),
        ("decode TP", tp_d),
        ("prefill instances", num_p),
        ("decode instances", num_d),
    ):
        if not isinstance(v, int) or v < 1:
            raise PlanError(f"{name} must be a positive integer, got {v!r}")
    if not 0 < max_util <= 1:
        raise PlanError(f"max utilization per GPU must be in (0, 1], got {max_util}")
    n = len(gpus)
    for role, tp in (("prefill", tp_p), ("decode", tp_d)):
        if tp > n:
            # Two ranks of one TP group cannot share a device (NCCL refuses duplicate GPUs).
            raise PlanError(f"{role} TP {tp} needs {tp} GPUs (one per rank), {n} present: the largest TP here is {n}")


def plan_gpus(
    gpus: Sequence[Gpu],
    tp_p: int,
    tp_d: int,
    memory: ModelMemory,
    num_p: int = 1,
    num_d: int = 1,
    max_util: float = MAX_UTIL,
    baseline_first: bool = True,
    util: float | None = None,
) -> GpuPlan:
    """Placement of ``num_p`` prefill and ``num_d`` decode servers and the baseline; PlanError if it cannot run here.
    ``util``: a gpu_memory_utilization given by hand, every server's share (UtilizationError where it cannot be)."""
    _check_inputs(gpus, tp_p, tp_d, num_p, num_d, max_util)
    if util is not None and not 0 < util <= 1:
        raise UtilizationError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    n = len(gpus)
    by_id = {g.id: g for g in gpus}
    wanted = [("prefill", i, tp_p) for i in range(num_p)] + [("decode", i, tp_d) for i in range(num_d)]
    ranks = sum(tp for _, _, tp in wanted)
    colocated = ranks > n

    cursor = 0
    layout: list[tuple[str, int, int, tuple[int, ...]]] = []
    for role, idx, tp in wanted:
        layout.append((role, idx, tp, tuple(gpus[(cursor + r) % n].id for r in range(tp))))
        cursor += tp
    load = {g.id: 0 for g in gpus}
    for *_, ids in layout:
        for g in ids:
            load[g] += 1

    if util is not None:
        _check_given_sum(util, layout, load, max_util)
    servers = []
    for role, idx, tp, ids in layout:
        share = floor_util(max_util / max(load[g] for g in ids)) if util is None else util
        servers.append(_placed(role, idx, tp, ids, share, memory, by_id, n, ranks, max_util, load, util is not None))
    dec0 = next(s for s in servers if s.role == "decode")
    # Alone on D's GPUs at D's TP, so both sides compute on the same devices and rank layout.
    baseline = _placed(
        "baseline",
        0,
        tp_d,
        dec0.gpus,
        floor_util(max_util) if util is None else util,
        memory,
        by_id,
        n,
        ranks,
        max_util,
        None,
        util is not None,
    )
    servers = [baseline, *servers] if baseline_first else [*servers, baseline]
    order = ("baseline", "pd") if baseline_first else ("pd", "baseline")

    notes = []
    if colocated:
        shared = sorted(g for g, c in load.items() if c > 1)
        notes.append(
            f"{ranks} ranks on {n} GPUs: GPUs {','.join(map(str, shared))} are shared, each server's share is "
            f"{max_util} / (servers on its busiest GPU)"
        )
        notes.append(
            "start colocated servers one after another: vLLM sizes its KV cache from the drop in free device "
            "memory during its profile run, which a neighbour loading at the same time would inflate"
        )
    if util is not None:
        notes.append(f"gpu_memory_utilization {util:g} given: every server takes it as its share of each of its GPUs")
    return GpuPlan(
        tuple(gpus),
        tuple(servers),
        colocated,
        memory,
        order,
        stagger_start=colocated,
        notes=tuple(notes),
        max_util=max_util,
        util_given=util,
    )


def plan_baseline(
    gpus: Sequence[Gpu], tp: int, memory: ModelMemory, max_util: float = MAX_UTIL, util: float | None = None
) -> GpuPlan:
    """The baseline alone on the first ``tp`` GPUs (attach mode: P and D run elsewhere, so nothing shares them);
    its share is ``max_util`` or the ``util`` given by hand. PlanError / UtilizationError where it cannot run here."""
    _check_inputs(gpus, tp, tp, 1, 1, max_util)
    if util is not None and not 0 < util <= 1:
        raise UtilizationError(f"gpu_memory_utilization must be in (0, 1], got {util}")
    ids = tuple(g.id for g in gpus[:tp])
    share = floor_util(max_util) if util is None else util
    base = _placed(
        "baseline", 0, tp, ids, share, memory, {g.id: g for g in gpus}, len(gpus), tp, max_util, None, util is not None
    )
    notes = ["attach mode: only the baseline runs on this host (P and D run elsewhere)"]
    if util is not None:
        notes.append(f"gpu_memory_utilization {util:g} given: the baseline takes it as its share of each of its GPUs")
    return GpuPlan(
        tuple(gpus),
        (base,),
        False,
        memory,
        ("baseline",),
        stagger_start=False,
        notes=tuple(notes),
        max_util=max_util,
        util_given=util,
    )


def _check_given_sum(
    util: float, layout: list[tuple[str, int, int, tuple[int, ...]]], load: dict[int, int], max_util: float
) -> None:
    """A given share, taken by every P/D server, must fit the GPUs they share (the plan's per-GPU cap)."""
    busiest = max(load.values())
    if busiest < 2 or util * busiest <= max_util + 1e-9:
        return
    shared = sorted(g for g, c in load.items() if c == busiest)
    names = [f"{role}{idx}" for role, idx, _, ids in layout if set(ids) & set(shared)]
    gpus = f"GPUs {','.join(map(str, shared))} are" if len(shared) > 1 else f"GPU {shared[0]} is"
    raise UtilizationError(
        f"{gpus} shared by {' and '.join(names)}: {busiest} x {util:g} = {util * busiest:.2f} > {max_util:g} per GPU; "
        f"give at most {floor_util(max_util / busiest):g}, or leave it unset "
        f"(the plan then splits {max_util:g} between them)"
    )


def _placed(
    role: str,
    idx: int,
    tp: int,
    ids: tuple[int, ...],
    util: float,
    memory: ModelMemory,
    by_id: dict[int, Gpu],
    n: int,
    ranks: int,
    max_util: float,
    load: dict[int, int] | None,
    given: bool = False,
) -> ServerPlacement:
    need = memory.need_per_rank_gib(tp)
    smallest = min(by_id[g].total_gib for g in ids)
    if util * smallest < need:
        if given:  # the user's value is short, not the GPUs: say which value would do
            least = math.ceil(need / smallest / UTIL_STEP) * UTIL_STEP
            raise UtilizationError(
                f"{role}{idx} (TP {tp}) needs {need:.1f} GiB per GPU, {util:g} x {smallest:g} GiB = "
                f"{util * smallest:.1f} GiB; give at least {least:.2f}, or leave it unset"
            )
        raise PlanError(_too_small(role, idx, tp, need, util, smallest, n, ranks, max_util, load, ids))
    return ServerPlacement(role, idx, tp, ids, util, round(need, 2), "baseline" if role == "baseline" else "pd")


def _too_small(
    role: str,
    idx: int,
    tp: int,
    need: float,
    util: float,
    smallest: float,
    n: int,
    ranks: int,
    max_util: float,
    load: dict[int, int] | None,
    ids: tuple[int, ...],
) -> str:
    head = (
        f"{role}{idx} (TP {tp}) needs {need:.1f} GiB per GPU, "
        f"its share is {util:.2f} x {smallest:g} GiB = {util * smallest:.1f} GiB"
    )
    alone_gib = least_gib(need, max_util)
    busiest = max(load[g] for g in ids) if load is not None else 1
    if busiest < 2:
        return f"{head}: it needs GPUs of >= {alone_gib} GiB, or a larger TP"
    # Shared GPUs: GPUs of `alone_gib` would still be shared, so both ways out are named with their own size.
    shared_gib = least_gib(need, floor_util(max_util / busiest))
    colocated = f"colocated on {n} GPUs of >= {shared_gib} GiB"
    if max_util * smallest >= need:
        return f"{head} (GPUs shared); it fits with {ranks} GPUs (P and D apart), or {colocated}"
    return (
        f"{head} (GPUs shared by {busiest} servers): it needs {ranks} GPUs of >= {alone_gib} GiB (P and D apart), "
        f"or {colocated}, or a larger TP"
    )


def least_gib(need: float, share: float) -> int:
    """The smallest whole GiB of which ``share`` holds ``need`` (what a refusal advises)."""
    gib = math.ceil(need / share)
    return gib if share * gib >= need else gib + 1


def describe_gpus(gpus: Sequence[Gpu]) -> str:
    """``8 GPUs x 40 GiB (NVIDIA A100-SXM4-40GB)``, with the ids when they are not 0..n-1 (CUDA_VISIBLE_DEVICES)."""
    mems = sorted({g.total_gib for g in gpus})
    mem = f"{mems[0]:g} GiB" if len(mems) == 1 else f"{mems[0]:g}-{mems[-1]:g} GiB"
    ids = [g.id for g in gpus]
    at = f" (ids {','.join(map(str, ids))})" if ids != list(range(len(ids))) else ""
    names = sorted({g.name for g in gpus if g.name})
    return f"{len(gpus)} GPUs{at} x {mem}" + (f" ({', '.join(names)})" if names else "")


def render_plan(plan: GpuPlan) -> str:
    """A readable table with each server's CUDA_VISIBLE_DEVICES."""
    pd = plan.phase("pd")
    how = (
        f"P/D colocated ({sum(s.tp for s in pd)} ranks on {len(plan.gpus)} GPUs)"
        if plan.colocated
        else "P/D on disjoint GPUs"
    )
    lines = [
        f"GPU plan: {describe_gpus(plan.gpus)}; {how}",
        f"model weights {plan.model.weights_gib:.2f} GiB ({plan.model.source}); "
        f"per rank: weights/TP x {WEIGHT_OVERHEAD} + {HEADROOM_GIB:g} GiB headroom",
        "order: "
        + ", then ".join(
            "baseline alone"
            if p == "baseline"
            else "prefill + decode" + (" (started one after another)" if plan.stagger_start else "")
            for p in plan.order
        ),
        f"{'server':<10} {'TP':>3}  {'CUDA_VISIBLE_DEVICES':<24} {'gpu_memory_utilization':>22}  {'need/GPU':>9}",
    ]
    for s in plan.servers:
        lines.append(
            f"{s.name:<10} {s.tp:>3}  {s.cuda_visible_devices:<24} "
            f"{s.gpu_memory_utilization:>22.2f}  {s.need_gib_per_gpu:>6.1f} GiB"
        )
    lines.append(f"(with CUDA_DEVICE_ORDER={CUDA_DEVICE_ORDER}, so the ids are nvidia-smi's)")
    if plan.colocated:
        for g in plan.gpus:
            on = [s for s in pd if g.id in s.gpus]
            if len(on) > 1:
                parts = " + ".join(f"{s.name} {s.gpu_memory_utilization:.2f}" for s in on)
                lines.append(f"GPU {g.id}: {parts} = {sum(s.gpu_memory_utilization for s in on):.2f}")
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)
