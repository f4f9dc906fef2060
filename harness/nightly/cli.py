"""`python -m harness nightly`: its flags and the night from them (exit codes in the package's docstring)."""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
from pathlib import Path

from harness.core.argtypes import non_negative_int
from harness.core.errors import ConfigError
from harness.core.paths import REPO_ROOT
from harness.nightly.dryrun import render_dry_run
from harness.nightly.execute import WORST_CASE_NOTE, nvml_guard, run_steps, worst_case_s
from harness.nightly.hardware import DEFAULT_GPU_MEM_GIB, DEFAULT_GPUS, choose_hardware, given_util
from harness.nightly.simulated import SIM_REASON
from harness.nightly.steps import build_steps, scale_timeouts, select_steps
from harness.run.thresholds import ThresholdStore


def add_parser(sub) -> None:
    p = sub.add_parser(
        "nightly", help="the nightly GPU run: GPU matrix entries + GSM8K accuracy; --dry-run prints every step"
    )
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print every step, server command, GPU plan, check and timeout; run nothing",
    )
    p.add_argument(
        "--gpus",
        type=int,
        help="use the first N of the GPUs NVML shows (default: all the caller's, "
        f"CUDA_VISIBLE_DEVICES applied; a dry run without NVML assumes {DEFAULT_GPUS})",
    )
    p.add_argument(
        "--gpu-mem-gib",
        type=float,
        help=f"dry run only: plan for GPUs of this size (default: NVML's; without NVML {DEFAULT_GPU_MEM_GIB:g})",
    )
    p.add_argument(
        "--vllm-version",
        help="comma-separated: the matrix and accuracy steps run once per version "
        "(default: $VLLM_VERSION, else the pinned version)",
    )
    p.add_argument("--run-dir", type=Path, help="default: runs/<timestamp>-nightly")
    p.add_argument("--python", default=sys.executable, help="interpreter that runs the harness steps")
    p.add_argument(
        "--only",
        help="comma-separated step ids or shell patterns (e.g. 'accuracy/*'); the other steps are "
        "skipped with the reason",
    )
    p.add_argument(
        "--load-requests",
        type=non_negative_int,
        help="requests of each run's load phase (default: the runs' own; 0: none)",
    )
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiply every step's timeout (default 1)")


def main(a: argparse.Namespace) -> int:
    from harness.envs.vllm_env import requested_versions
    from harness.gpu.nvml import discover

    if (
        (a.gpus is not None and a.gpus < 1)
        or (a.gpu_mem_gib is not None and a.gpu_mem_gib <= 0)
        or a.timeout_scale <= 0
    ):
        print("error: --gpus, --gpu-mem-gib and --timeout-scale must be > 0", file=sys.stderr)
        return 2
    run_dir = a.run_dir or REPO_ROOT / "runs" / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-nightly-{os.getpid()}"
    try:
        versions = requested_versions(a.vllm_version)
        util = given_util(os.environ)
        hw = choose_hardware(discover(), a.gpus, a.gpu_mem_gib, a.dry_run)
        steps = build_steps(
            hw.gpus,
            a.python,
            run_dir,
            versions,
            util=util,
            simulated=hw.simulated,
            load_requests=a.load_requests,
            driver=hw.driver,
            thresholds=ThresholdStore(),
        )
        steps = select_steps(steps, [p.strip() for p in (a.only or "").split(",") if p.strip()])
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    steps = scale_timeouts(steps, a.timeout_scale)
    if a.dry_run:
        print(render_dry_run(steps, hw))
        return 0
    if hw.simulated:  # one box for the whole night: every step's stand-ins register in the same state folder
        from harness.simbox.claims import box_state

        box_state()
    print(f"nightly: run folder {run_dir}; GPUs: {hw.source}", flush=True)
    print(f"nightly: worst case {worst_case_s(steps) / 60:.0f} min ({WORST_CASE_NOTE})", flush=True)
    results = run_steps(steps, run_dir, gpu_guard=nvml_guard, simulated=hw.simulated)
    bad = [r for r in results if r.status in ("failed", "timeout")]
    sim = f" [{SIM_REASON}: stand-in servers; data-path checks skipped, not passed]" if hw.simulated else ""
    print(
        f"nightly: {len(results) - len(bad)} of {len(results)} steps passed or skipped{sim}; "
        f"junit {run_dir / 'junit.xml'}"
    )
    return 1 if bad else 0
