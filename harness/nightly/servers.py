"""A step's server command lines as its run builds them (the run's own code over the step's config), for the dry run;
pure: nothing is started, reserved or installed."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import cast

from harness.gpu.plan import GpuPlan
from harness.gpu.run import GpuRun
from harness.run.config import E2EConfig
from harness.serve.ports import PortAllocator, PortBlock

PORTS_NOTE = (
    "ports are placeholders (a fixed fake allocator, taken in the run's order); a real run takes them from "
    "harness/serve/ports.py"
)
PLAN_NOTE = (
    "server lines are what a run launches, built by the run's own code (harness/run/context.py RunContext.server) "
    "from the step's config: each server's GPUs (CUDA_VISIBLE_DEVICES) and memory share (--gpu-memory-utilization) "
    "come from the GPU plan, the interpreter from the step's vLLM environment; colocated servers start one after "
    "another"
)


class FakePorts:
    """Deterministic stand-in for PortAllocator in dry runs: same interface, nothing reserved."""

    def __init__(self, base: int = 40000):
        self.next = base

    def block(self, count: int) -> PortBlock:
        b = PortBlock(self.next, count)
        self.next += count
        return b

    def port(self) -> int:
        return self.block(1).base


class PlannedGpus(GpuRun):
    """The run's GPU interface over a plan made here: what RunContext.server asks of it (each server's placement),
    without reading NVML (a dry run plans for a box it may not be on)."""

    def __init__(self, plan: GpuPlan):  # no GpuRun.__init__: it discovers the GPUs and plans again
        self.plan = plan


def server_lines(cfg: E2EConfig, plan: GpuPlan) -> tuple[tuple[str, str], ...]:
    """Each server of a step's run and its proxy as that run builds them: RunContext.server (run/launch.py
    make_server: the KV pool, request logging, the serving interpreter) and RunContext.proxy over the run's own
    ``cfg`` and the plan's placements, in the order the run starts them; ports are placeholders, taken in that
    order. Pure: nothing is started or installed."""
    from harness.models.heads import model_heads
    from harness.run.context import RunContext
    from harness.run.launch import resolve_model
    from harness.run.report import Report
    from harness.workload.client import GenerationSettings

    model, served = resolve_model(cfg)
    report = Report(config={"model_heads": model_heads(model)})  # what the run reads before it builds its servers
    run_dir = cfg.run_dir or Path("run")
    ctx = RunContext(cfg, run_dir, report, [], GenerationSettings(), model, served, gpu=PlannedGpus(plan))
    alloc = cast(PortAllocator, FakePorts())  # the allocator's interface (port, block), nothing reserved
    bs_p, bs_d = cfg.block_sizes()
    out: list[tuple[str, str]] = []
    for phase in plan.order:  # run/pipeline.py: the baseline alone, before P/D or (a matrix's) after
        if phase == "baseline":
            out.append(("baseline0", ctx.server(alloc, "baseline", cfg.tp_d, bs_d, None).command))
            continue
        pre = ctx.server(alloc, "prefill", cfg.tp_p, bs_p, None)
        dec = ctx.server(alloc, "decode", cfg.tp_d, bs_d, None, cfg.kv_layout_d)
        ctx.proxy(alloc, [pre.url], [dec.url])
        out += [("prefill0", pre.command), ("decode0", dec.command), ("proxy", report.commands["proxy"])]
    return tuple(out)


def serving_python(version: str | None, default: str) -> str:
    """The interpreter a step's servers run with: its vLLM version's environment, as envs/vllm_env.py ensure_env
    returns it (nothing is installed here), else ``default``."""
    from harness.envs.vllm_env import env_dir

    return str(env_dir("gpu", version) / "bin" / "python") if version else default


def e2e_config(argv: Sequence[str], python: str) -> E2EConfig:
    """The config an e2e step's run builds from its arguments and this environment (harness/e2e/args.py
    config_from_args, what `python -m harness e2e` runs), served by ``python``: without installing its version's
    environment or claiming its run folder."""
    from harness.e2e.args import config_from_args, e2e_parser

    a = e2e_parser().parse_args(list(argv))
    run_dir, a.run_dir, a.vllm_version = a.run_dir, None, None  # ensure_env and the folder's claim: the run's own
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VERSION"}
    return replace(config_from_args(a, env), run_dir=run_dir, python=python)
