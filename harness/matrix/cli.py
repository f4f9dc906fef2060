"""python -m harness matrix: list the plan of a matrix config (--list) or run it."""

from __future__ import annotations

import argparse
import os
import signal
import sys
from collections.abc import Mapping
from pathlib import Path

from harness.core.argtypes import non_negative_int, positive_int
from harness.core.cpuinfo import cpu_flags
from harness.core.errors import ConfigError
from harness.core.files import OVERWRITE_FLAG, claim_run_dir
from harness.core.interrupts import catch_interrupts
from harness.envs.vllm_env import versions_from
from harness.gpu.detect import count_gpus, default_device
from harness.models.rules import DEVICES, as_device
from harness.run.config import UPSTREAM_ENV, E2EConfig, env_defaults
from harness.workload.load import LoadSettings


def add_parser(sub) -> None:
    mx = sub.add_parser("matrix", help="the GQA-replication matrix: plan which pairs run here (--list)")
    mx.add_argument("file", nargs="?", type=Path, help="default: configs/gqa_replication.yaml")
    mx.add_argument(
        "--list", action="store_true", help="print the plan with predictions and skip reasons; launch nothing"
    )
    mx.add_argument(
        "--vllm-version",
        help="comma-separated versions to run, each from its own environment under .venvs/ "
        "(default: $VLLM_VERSION or the version requirements/ pins)",
    )
    mx.add_argument("--run-dir", type=Path, help="matrix folder, new or empty (default: runs/<timestamp>-matrix)")
    mx.add_argument(OVERWRITE_FLAG, action="store_true", help="--run-dir may hold an earlier matrix: emptied first")
    mx.add_argument("--only", help="comma-separated entry ids")
    mx.add_argument("--model", help="entries of this model (id in configs/models.yaml or hub id)")
    mx.add_argument("--tp-p", type=positive_int)
    mx.add_argument("--tp-d", type=positive_int)
    mx.add_argument("--device", choices=DEVICES, help="default: gpu if an NVIDIA GPU is present, else cpu")
    mx.add_argument("--gpus", type=int, help="GPUs present (default: counted from /proc/driver/nvidia/gpus)")
    mx.add_argument("--json", action="store_true")
    mx.add_argument(
        "--load-requests",
        type=non_negative_int,
        help=f"requests of each pair's load phase (default {LoadSettings.requests}; 0: none)",
    )
    mx.add_argument(
        "--fresh-baseline",
        action="store_true",
        help="compute each baseline again instead of reusing cached answers from earlier runs",
    )
    mx.add_argument(
        "--ray",
        metavar="ADDRESS",
        help="run the entries as tasks on this Ray cluster (ray://HEAD[:10001] from any machine, HEAD:PORT from a "
        "node), each with its GPUs (or CPUs); the matrix folder must be on storage every node shares "
        "(harness/cluster, docs/multi-host.md#ray)",
    )


def main(a: argparse.Namespace) -> int:
    import json

    from harness.matrix.config import MATRIX_YAML, load_matrix
    from harness.matrix.plan import plan, render_plan

    try:
        matrix, models = load_matrix(a.file or MATRIX_YAML)
        only = {x.strip() for x in a.only.split(",") if x.strip()} if a.only else None
        device = a.device or default_device()
        versions = versions_from(a.vllm_version, device)
        gpus = a.gpus if a.gpus is not None else count_gpus()
        flags = cpu_flags() if device == "cpu" else None
        plans = {v: plan(matrix, models, v, device, gpus, only, a.model, a.tp_p, a.tp_d, flags) for v in versions}
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not any(plans.values()):
        print("error: no matrix entry matches the filters", file=sys.stderr)
        return 2
    if a.list:
        if a.json:
            print(
                json.dumps([{**p.to_dict(), "vllm_version": v} for v, pairs in plans.items() for p in pairs], indent=2)
            )
        else:
            print("\n".join(render_plan(pairs, v) for v, pairs in plans.items()))
        return 0
    return run_matrix_main(a, plans, models, device)


def base_config(
    device: str, load_requests: int | None = None, fresh_baseline: bool = False, env: Mapping[str, str] | None = None
) -> E2EConfig:
    """What every pair of a matrix run shares (``config_for`` adds the pair's own): the load phase, the baseline cache
    and, on GPU, GPU_MEMORY_UTILIZATION read as e2e reads it (ConfigError naming the variable), so a night that plans
    with it runs with it. The nightly's dry run builds its server lines from this config too."""
    var = UPSTREAM_ENV["gpu_memory_utilization"]
    raw = (os.environ if env is None else env).get(var, "") if device == "gpu" else ""
    return E2EConfig(
        device=as_device(device),
        fresh_baseline=fresh_baseline,
        load=LoadSettings() if load_requests is None else LoadSettings(requests=load_requests),
        gpu_memory_utilization=env_defaults({var: raw}).get("gpu_memory_utilization"),  # type: ignore[arg-type]
    )


def run_matrix_main(a: argparse.Namespace, plans: dict, models: dict, device: str) -> int:
    from harness.envs.vllm_env import EnvSetupFailed, ensure_env
    from harness.matrix.run import new_matrix_dir, run_matrix, summary

    catch_interrupts()
    try:
        base = base_config(device, a.load_requests, a.fresh_baseline)
        if a.run_dir is not None:  # refused (or emptied, with the flag) before anything is installed or started
            claim_run_dir(Path(a.run_dir), a.overwrite_run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    try:
        # Every environment first: a failed install stops the matrix before any server starts.
        pythons = {v: str(ensure_env(device, v)) for v, pairs in plans.items() if any(p.run for p in pairs)}
    except EnvSetupFailed as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    pythons.update({v: "-" for v in plans if v not in pythons})
    run_dir = a.run_dir or new_matrix_dir(base.runs_root)
    print(f"matrix folder: {run_dir}", flush=True)
    try:
        results = run_matrix(plans, pythons, models, base, run_dir)
    except KeyboardInterrupt as e:  # the pair's own report says "interrupted"; the matrix report keeps the pairs done
        print(f"interrupted; partial report: {run_dir / 'report.md'}", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    print(summary(results, list(plans)))
    print(f"report: {run_dir / 'report.md'}")
    ran = [r for r in results if r.as_expected is not None]
    return 0 if ran and all(r.as_expected for r in ran) else 1
