"""python -m harness plan: where each server of a P/D run goes on the GPUs (launches nothing)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import replace

from harness.core.errors import ConfigError
from harness.gpu.plan import MAX_UTIL, Gpu, PlanError, model_memory, plan_gpus, render_plan, uniform_gpus

DEFAULT_GPU_MEM_GIB = 80.0
UTIL_ENV = "GPU_MEMORY_UTILIZATION"  # upstream's name, as e2e reads it (harness/run/config.py UPSTREAM_ENV)


def add_parser(sub) -> None:
    # Values are parsed in main(), so a bad one is a single error line (argparse would print its usage too).
    p = sub.add_parser(
        "plan", help="GPU placement of a P/D run: CUDA_VISIBLE_DEVICES and gpu_memory_utilization per server"
    )
    p.add_argument("--gpus", help="GPUs present (default: counted through NVML)")
    p.add_argument(
        "--gpu-mem-gib",
        help=f"memory of each GPU in GiB (default: NVML's; where it cannot be read {DEFAULT_GPU_MEM_GIB:g}, said so)",
    )
    p.add_argument("--tp-p", default="1", help="prefill TP size (default 1)")
    p.add_argument("--tp-d", default="1", help="decode TP size (default 1)")
    p.add_argument("--num-p", default="1", help="prefill instances (default 1)")
    p.add_argument("--num-d", default="1", help="decode instances (default 1)")
    p.add_argument("--model", help="hub id, id in configs/models.yaml, or local folder (sizes the weights)")
    p.add_argument("--weights-gib", help="weights size in GiB instead of --model's")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-util", default=str(MAX_UTIL), help="sum of gpu_memory_utilization allowed on one GPU")
    p.add_argument(
        "--gpu-memory-utilization",
        help=f"every server's share, given by hand as e2e takes it (default: ${UTIL_ENV}; unset: the plan's split)",
    )
    p.add_argument("--json", action="store_true")


def _number(flag: str, raw: str | None, kind=int, positive: bool = True):
    """``raw`` (from ``flag``: an option or a variable's name) as ``kind``; None stays None; PlanError, one line."""
    if raw is None:
        return None
    try:
        v = kind(raw)
    except ValueError:
        raise PlanError(f"{flag} {raw!r} is not {'an integer' if kind is int else 'a number'}") from None
    if positive and not v > 0:
        raise PlanError(f"{flag} must be > 0, got {raw}")
    return v


def _gpus(a: argparse.Namespace) -> tuple[tuple[Gpu, ...], str | None]:
    """The GPUs to plan on and, where their memory is assumed, a note saying so and how to change it. ``--gpus N``
    without ``--gpu-mem-gib`` takes NVML's memory (the first N of its GPUs, or N of its smallest size)."""
    count = _number("--gpus", a.gpus)
    mem = _number("--gpu-mem-gib", a.gpu_mem_gib, float)
    if count is not None and mem is not None:
        return uniform_gpus(count, mem), None
    from harness.gpu.nvml import discover

    d = discover()  # the caller's GPUs: CUDA_VISIBLE_DEVICES applied, physical NVML ids
    seen = d.plan_gpus() if d.available else ()
    if count is None:
        if not seen:
            raise PlanError(f"no GPUs found ({d.reason or 'NVML lists none'}): give --gpus N")
        return tuple(replace(g, total_gib=mem) if mem else g for g in seen), None
    if not seen:
        why = d.reason or "NVML lists no GPU"
        return uniform_gpus(count, DEFAULT_GPU_MEM_GIB), (
            f"{DEFAULT_GPU_MEM_GIB:g} GiB per GPU assumed ({why}); give --gpu-mem-gib to plan for another size"
        )
    if count <= len(seen):
        return tuple(seen[:count]), None
    least = min(g.total_gib for g in seen)
    return uniform_gpus(count, least), f"{count} GPUs planned, {len(seen)} present: each as the smallest, {least:g} GiB"


def _util(a: argparse.Namespace) -> float | None:
    given = a.gpu_memory_utilization is not None
    name, raw = (
        ("--gpu-memory-utilization", a.gpu_memory_utilization) if given else (UTIL_ENV, os.environ.get(UTIL_ENV))
    )
    v = _number(name, raw or None, float, positive=False)
    if v is not None and not 0 < v <= 1:
        raise PlanError(f"{name} must be in (0, 1], got {raw}")
    return v


def build(a: argparse.Namespace):
    gpus, assumed = _gpus(a)
    memory = model_memory(a.model, a.dtype, _number("--weights-gib", a.weights_gib, float, positive=False))
    plan = plan_gpus(
        gpus,
        _number("--tp-p", a.tp_p),
        _number("--tp-d", a.tp_d),
        memory,
        num_p=_number("--num-p", a.num_p),
        num_d=_number("--num-d", a.num_d),
        max_util=_number("--max-util", a.max_util, float),
        util=_util(a),
    )
    return replace(plan, notes=(*plan.notes, assumed)) if assumed else plan


def main(a: argparse.Namespace) -> int:
    try:
        plan = build(a)
    except (PlanError, ConfigError) as e:  # ConfigError: configs/models.yaml is broken
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps(plan.to_dict(), indent=2))
    else:
        print(render_plan(plan))
    return 0
