"""python -m harness nightly [--dry-run]: the nightly GPU run.

Steps, each through an existing entry point with its own timeout and one JUnit testcase:
  doctor              `python -m harness doctor --before-prefetch`: the box proven first; a problem stops the night,
                      its lines printed as one screen (skipped on a simulated box)
  prefetch/<repo>     each model, and GSM8K, into the HF cache (servers run with HF_HUB_OFFLINE=1): one step each, so
                      a gated or missing model fails its own step only; the steps that need it are skipped, saying so
  calibrate/<run>     `python -m harness calibrate --store` when the box (GPU model, driver, vLLM, model) has no
                      calibrated logprob threshold yet (harness/run/thresholds.py), else skipped naming it; its failure
                      stops nothing: the later runs use the default threshold, and say so
  matrix/<id>         every GPU entry of configs/gqa_replication.yaml: `python -m harness matrix FILE --only <id>`
  edge/<id>           every GPU entry of configs/edge_cases.yaml (GPU-only axes: host buffer, fp8 KV, backends, ...)
  accuracy/<model>    real gsm8k through P/D against the baseline: `python -m harness e2e --accuracy`
  history             the night's matrix results drawn per release
With several vLLM versions (--vllm-version/VLLM_VERSION a,b) the matrix and accuracy steps repeat per version,
their ids ending in @<version>. The GPUs are NVML's, restricted to the caller's CUDA_VISIBLE_DEVICES; every GPU
step gets exactly those (physical ids, CUDA_DEVICE_ORDER=PCI_BUS_ID), so its servers land where the night planned.
`--dry-run` prints every step (command, GPU plan, server command lines, checks, timeout) and the night's worst case on
any machine; its server lines are built by the run's own code (server_lines), so they are the lines that run.
On a simulated GPU box (PD_HARNESS_SIMULATED_GPUS, docs/gpu.md) a real night runs its steps against stand-in servers:
no prefetch, no lm-eval, and a step passes when its runs got through (their data-path checks skipped, never passed).
Exit codes: 0 every step passed or was skipped, 1 a step failed, 2 the night cannot start (bad input, GPUs that
cannot be read, too few GPUs, a GPU_MEMORY_UTILIZATION that does not fit a step): one line on stderr.

The package, one concern a module: ``step`` (Step, StepResult), ``steps`` (planning), ``servers`` (server lines as a
run builds them), ``hardware`` (the night's GPUs), ``execute`` (running the steps, the GPU guard, the worst case),
``junit``, ``simulated`` (judging on a simulated box), ``dryrun`` and ``cli``; the names below are what other code
and the tests import from ``harness.nightly``.
"""

from __future__ import annotations

from harness.nightly.cli import add_parser, main
from harness.nightly.dryrun import render_dry_run
from harness.nightly.execute import (
    RELEASE_TIMEOUT_S,
    STEP_POLL_S,
    STOP_GRACE_S,
    WORST_CASE_NOTE,
    nvml_guard,
    run_step,
    run_steps,
    worst_case_s,
)
from harness.nightly.hardware import (
    DEFAULT_GPU_MEM_GIB,
    DEFAULT_GPUS,
    UTIL_ENV,
    Hardware,
    choose_hardware,
    given_util,
)
from harness.nightly.junit import junit_xml
from harness.nightly.servers import (
    PLAN_NOTE,
    PORTS_NOTE,
    FakePorts,
    PlannedGpus,
    e2e_config,
    server_lines,
    serving_python,
)
from harness.nightly.simulated import SIM_REASON, judge_simulated, simulated_runs
from harness.nightly.step import Step, StepResult
from harness.nightly.steps import (
    ACCURACY_CHECKS,
    ACCURACY_RUNS,
    ACCURACY_TASK,
    CALIBRATE_FALLBACK,
    CALIBRATE_RUN,
    E2E_CHECKS,
    PREFETCH_IGNORE,
    TIMEOUTS_S,
    Night,
    build_steps,
    calibrate_step,
    doctor_step,
    history_step,
    prefetch_id,
    scale_timeouts,
    select_steps,
)

__all__ = [
    "ACCURACY_CHECKS",
    "ACCURACY_RUNS",
    "ACCURACY_TASK",
    "CALIBRATE_FALLBACK",
    "CALIBRATE_RUN",
    "DEFAULT_GPUS",
    "DEFAULT_GPU_MEM_GIB",
    "E2E_CHECKS",
    "PLAN_NOTE",
    "PORTS_NOTE",
    "PREFETCH_IGNORE",
    "RELEASE_TIMEOUT_S",
    "SIM_REASON",
    "STEP_POLL_S",
    "STOP_GRACE_S",
    "TIMEOUTS_S",
    "UTIL_ENV",
    "WORST_CASE_NOTE",
    "FakePorts",
    "Hardware",
    "Night",
    "PlannedGpus",
    "Step",
    "StepResult",
    "add_parser",
    "build_steps",
    "calibrate_step",
    "choose_hardware",
    "doctor_step",
    "e2e_config",
    "given_util",
    "history_step",
    "judge_simulated",
    "junit_xml",
    "main",
    "nvml_guard",
    "prefetch_id",
    "render_dry_run",
    "run_step",
    "run_steps",
    "scale_timeouts",
    "select_steps",
    "server_lines",
    "serving_python",
    "simulated_runs",
    "worst_case_s",
]
