"""``python -m harness doctor``: one line per check, ok or problem with the one thing to do.

Exit codes: 0 no problem, 1 a problem, 2 bad input (one line on stderr). On a machine without an NVIDIA GPU it says
so in one line and checks what it can (environments, caches, disk).
"""

from __future__ import annotations

import argparse
import os
import sys

from harness.core.argtypes import positive_int
from harness.core.errors import ConfigError
from harness.doctor.checks import diagnose, problems
from harness.doctor.inventory import Inventory, gather
from harness.doctor.needs import NIGHT_GPUS, NightNeeds, night_models
from harness.gpu.plan import uniform_gpus


def add_parser(sub) -> None:
    p = sub.add_parser("doctor", help="is this box ready for the nightly GPU run? one line per check, ok or problem")
    p.add_argument("--gpus", type=positive_int, default=NIGHT_GPUS, help=f"GPUs the night uses (default {NIGHT_GPUS})")
    p.add_argument(
        "--vllm-version",
        help="comma-separated versions the night runs (default: $VLLM_VERSION, else the pinned one); "
        "each one's environment is checked",
    )
    p.add_argument(
        "--models",
        help="comma-separated hub ids the night serves (default: those of the matrices and the accuracy runs "
        "that have a place on the GPUs)",
    )
    p.add_argument("--no-accuracy", action="store_true", help="the night runs no accuracy step: lm-eval not needed")
    p.add_argument(
        "--before-prefetch",
        action="store_true",
        help="the night's step 0: a model or dataset not cached yet is fetched by its prefetch step (a gated one "
        "without a token is still a problem)",
    )


def needs_from(a: argparse.Namespace, inventory_gpus) -> NightNeeds:
    from harness.envs.vllm_env import requested_versions

    versions = tuple(requested_versions(a.vllm_version)) or (None,)
    if a.models is not None:
        models = [m.strip() for m in a.models.split(",") if m.strip()]
    else:
        models = night_models(inventory_gpus or uniform_gpus(a.gpus, 80.0))
    return NightNeeds(tuple(models), versions, a.gpus, accuracy=not a.no_accuracy, before_prefetch=a.before_prefetch)


def render(inv: Inventory, lines) -> str:
    bad = problems(lines)
    head = f"doctor: {inv.nvml.describe() if inv.gpu_present else 'no NVIDIA GPU on this machine'}"
    tail = f"doctor: {len(bad)} problem(s)" if bad else "doctor: no problem"
    return "\n".join([head, *(line.render() for line in lines), tail])


def main(a: argparse.Namespace) -> int:
    from harness.gpu.nvml import discover

    try:
        gpus = discover().plan_gpus()[: a.gpus]
        needs = needs_from(a, gpus if len(gpus) >= a.gpus else None)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    inv = gather(needs, os.environ)
    lines = diagnose(inv)
    print(render(inv, lines), flush=True)
    return 1 if problems(lines) else 0
