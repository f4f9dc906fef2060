"""python -m harness nightly [--dry-run]: the nightly GPU run.

Steps, each through an existing entry point with its own timeout and one JUnit testcase:
  doctor              `python -m harness doctor --before-prefetch`: the box proven first; a problem stops the night,
                      its lines printed as one screen (skipped on a simulated box)
  prefetch/<repo>     each model, and GSM8K, into the HF cache (servers run with HF_HUB_OFFLINE=1): one step each, so
                      a gated or missing model fails its own step only; the steps that need it are skipped, saying so
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
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import sys
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import cast

from harness.accuracy.settings import HUB_DATASET, HUB_TASK
from harness.core.argtypes import non_negative_int
from harness.core.errors import ConfigError
from harness.core.paths import REPO_ROOT
from harness.doctor.needs import ACCURACY_RUNS as NIGHT_ACCURACY_RUNS
from harness.gpu.nvml import Discovery
from harness.gpu.plan import (
    CUDA_DEVICE_ORDER,
    Gpu,
    GpuPlan,
    PlanError,
    UtilizationError,
    describe_gpus,
    model_memory,
    plan_gpus,
    render_plan,
    uniform_gpus,
)
from harness.gpu.run import GpuRun
from harness.gpu.simulate import SIMULATED_ENV, parse_box
from harness.run.config import E2EConfig, env_defaults
from harness.serve.ports import PortAllocator, PortBlock

# What a dry run assumes when NVML cannot be read (a real run then refuses): the nightly runner's box.
DEFAULT_GPUS = 8
DEFAULT_GPU_MEM_GIB = 80.0
UTIL_ENV = "GPU_MEMORY_UTILIZATION"  # upstream's name; the steps' e2e runs read it too (harness/run/config.py)
# Per-step timeouts (s). A matrix pair starts up to three servers (10 min ready timeout each) and
# sends 18 prompts; an accuracy run adds full GSM8K (1319 questions) twice, baseline and P/D.
TIMEOUTS_S = {"doctor": 10 * 60, "prefetch": 30 * 60, "matrix": 40 * 60, "accuracy": 90 * 60, "history": 10 * 60}
STOP_GRACE_S = 120.0  # a step's harness tears its servers down on SIGTERM; then SIGKILL and a sweep
SIM_REASON = "simulated GPUs"
STEP_POLL_S = 0.25  # how often a running step is looked at (a step that ended waits this long, at most)
RELEASE_TIMEOUT_S = 180.0  # after a step, until its GPUs have their memory back
# (hub id, P TP, D TP), in harness/doctor/needs.py, which checks what they need of the box
ACCURACY_RUNS = NIGHT_ACCURACY_RUNS
ACCURACY_TASK = HUB_TASK
# Weight formats vLLM does not load when safetensors are there (e.g. meta-llama's original/*.pth): not downloaded.
PREFETCH_IGNORE = ["*.pth", "*.bin", "*.gguf", "*.onnx", "*.msgpack", "*.h5", "original/*"]
# The checks of every e2e run (harness/run/pipeline.py, harness/checks/transfer.py) and of accuracy runs
# (harness/accuracy/lm_eval.py).
E2E_CHECKS = (
    "all_requests_answered",
    "outputs_match_baseline",
    "prefill_returned_kv_transfer_params",
    "nixl_transfers_counted",
    "no_failed_transfers",
    "prompt_tokens_from_transfer",
    "transfer_plan_logged",
    "kv_load_failure_policy_fail",
    "no_kv_lease_expiry",
    "no_process_left",
)
ACCURACY_CHECKS = (
    "accuracy_through_pd",
    "accuracy_samples_paired",
    "accuracy_pd_within_tolerance",
    "accuracy_responses_agree",
    "accuracy_matches_expected",
)
WORST_CASE_NOTE = "every step to run at its timeout, then its stop grace and, a GPU step, the GPU release wait"
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


@dataclass(frozen=True)
class Step:
    id: str
    kind: str  # doctor / prefetch / matrix / accuracy / history
    argv: tuple[str, ...]
    timeout_s: float
    checks: tuple[str, ...]
    gpus_needed: int = 0
    gpu_plan: GpuPlan | None = None
    servers: tuple[tuple[str, str], ...] = ()  # (name, shell command) as planned
    skip_reason: str | None = None
    note: str | None = None
    env: tuple[tuple[str, str], ...] = ()  # added to the step's environment (its GPUs)
    version: str | None = None  # the vLLM version it runs (None: the pinned one)
    needs: tuple[str, ...] = ()  # ids of the prefetch steps it needs: one of them failed, it is skipped

    @property
    def run_dir(self) -> Path | None:
        """Where the step's harness writes its run (its --run-dir), None for a step without one."""
        return Path(self.argv[self.argv.index("--run-dir") + 1]) if "--run-dir" in self.argv else None


@dataclass(frozen=True)
class StepResult:
    step: Step
    status: str  # passed / failed / skipped / timeout
    seconds: float = 0.0
    message: str = ""
    log: str | None = None
    returncode: int | None = None  # the step's exit code (None: not run, or stopped at its timeout)


@dataclass(frozen=True)
class Hardware:
    """The GPUs the night plans and runs on, and where that inventory came from."""

    gpus: tuple[Gpu, ...]
    source: str  # one line
    assumed: bool = False  # not (all) read from NVML: a dry run's assumption or a flag's
    simulated: str | None = None  # read from a simulated box (PD_HARNESS_SIMULATED_GPUS's value)


@dataclass(frozen=True)
class Night:
    """What every matrix and accuracy step of one vLLM version shares."""

    gpus: tuple[Gpu, ...]
    python: str
    run_dir: Path
    version: str | None  # None: the pinned one
    tagged: bool  # several versions: step ids end in @<version>
    util: float | None  # GPU_MEMORY_UTILIZATION given by hand
    hub_models: list[str] = field(default_factory=list)  # what the prefetch downloads, shared across versions
    simulated: str | None = None  # a simulated box: its steps' servers are stand-ins
    load_requests: int | None = None  # each run's load phase (--load-requests); None: the runs' default

    def sid(self, kind: str, name: str) -> str:
        return f"{kind}/{name}" + (f"@{self.version}" if self.tagged else "")

    @property
    def run_args(self) -> tuple[str, ...]:
        return (("--vllm-version", self.version) if self.version else ()) + (
            ("--load-requests", str(self.load_requests)) if self.load_requests is not None else ()
        )

    @property
    def env(self) -> tuple[tuple[str, str], ...]:
        """A GPU step sees exactly the night's GPUs, by physical id, in NVML's order (harness/gpu/visible.py); on a
        simulated box, the same box read through those ids (visible= left out, as CUDA reads a child's list)."""
        ids = ",".join(str(g.id) for g in self.gpus)
        sim = ((SIMULATED_ENV, parse_box(self.simulated).for_child()),) if self.simulated else ()
        return (("CUDA_VISIBLE_DEVICES", ids), ("CUDA_DEVICE_ORDER", CUDA_DEVICE_ORDER), *sim)


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
    """The config an e2e step's run builds from its arguments and this environment (harness/cli.py config_from_args),
    served by ``python``: without installing its version's environment or claiming its run folder."""
    from harness.cli import build_parser, config_from_args

    a = build_parser().parse_args(list(argv))
    run_dir, a.run_dir, a.vllm_version = a.run_dir, None, None  # ensure_env and the folder's claim: the run's own
    env = {k: v for k, v in os.environ.items() if k != "VLLM_VERSION"}
    return replace(config_from_args(a, env), run_dir=run_dir, python=python)


def _matrix_checks(expected: str, version_label: str) -> tuple[str, ...]:
    what = {
        "ok": "handshake passes and P/D outputs match the baseline: " + ", ".join(E2E_CHECKS),
        "assert-45330": "D raises the #45330 handshake assertion (failure class assert-45330)",
        "rejected": "D rejects the replicated P>D handshake (failure class rejected-replicated-p-gt-d)",
        "invalid": "vLLM refuses the TP sizes (not launched)",
        "unsupported": "vLLM refuses a setting of the entry (failure class unsupported, with vLLM's message)",
    }[expected]
    return (f"pair behaves as its entry expects of vLLM {version_label}: {expected}", what, "matrix exit code 0")


def _plan(
    night: Night, sid: str, tp_p: int, tp_d: int, model: str, baseline_first: bool = True
) -> tuple[GpuPlan | None, str | None]:
    """The step's GPU plan, or why it is skipped; a GPU_MEMORY_UTILIZATION that does not fit stops the night
    (ConfigError): the step's own run would refuse it, so the night says so before it starts."""
    try:
        memory = model_memory(model)
        return plan_gpus(night.gpus, tp_p, tp_d, memory, baseline_first=baseline_first, util=night.util), None
    except UtilizationError as e:
        raise ConfigError(f"{UTIL_ENV}={night.util:g} does not fit {sid}: {e}") from None
    except PlanError as e:
        return None, str(e)


def build_steps(
    gpus: Sequence[Gpu],
    python: str,
    run_dir: Path,
    versions: Sequence[str] = (),
    matrix_file: Path | None = None,
    util: float | None = None,
    simulated: str | None = None,
    load_requests: int | None = None,
) -> list[Step]:
    """Every step of the nightly run on ``gpus`` (physical ids, memory, names), for each of ``versions`` (none: the
    pinned one); pure apart from reading the configs. ``util``: GPU_MEMORY_UTILIZATION given by hand; ``simulated``:
    the simulated box the GPUs are on (nothing to prefetch, the history kept in the night's folder);
    ``load_requests``: each run's load phase (None: the runs' default)."""
    steps: list[Step] = []
    hub_models: list[str] = []
    matrix_ids: list[str] = []
    for version in list(versions) if versions else [None]:
        night = Night(
            tuple(gpus), python, run_dir, version, len(versions) > 1, util, hub_models, simulated, load_requests
        )
        steps += _matrix_steps(night, matrix_file, matrix_ids)
        steps += [_accuracy_step(night, *run) for run in ACCURACY_RUNS]
    history = history_step(python, run_dir, versions, matrix_ids)
    prefetch = _prefetch_steps(python, hub_models)
    doctor = doctor_step(python, len(gpus), versions, hub_models, run_dir)
    if simulated:
        prefetch = [
            replace(
                p,
                skip_reason=f"{SIM_REASON}: the stand-in servers load no weights and lm-eval "
                "does not run, so nothing is downloaded",
            )
            for p in prefetch
        ]
        doctor = replace(
            doctor, skip_reason=f"{SIM_REASON}: the box is the simulation's; `python -m harness doctor` checks one"
        )
        # simulated outcomes stay in the night's folder, never in the results store real runs are drawn from
        history = replace(
            history,
            env=(("PD_HARNESS_RESULTS_DIR", str(run_dir / "history" / "results-simulated")),),
            note=f"{history.note}; {SIM_REASON}: the stand-ins' outcomes, kept in the night's folder",
        )
    return [doctor, *prefetch, *steps, history]


def select_steps(steps: Sequence[Step], patterns: Sequence[str]) -> list[Step]:
    """``--only``: the steps whose id matches one of ``patterns`` (shell-style, e.g. ``accuracy/*``); the others are
    skipped with the reason. No pattern: every step. A pattern that matches no step is a mistake (ConfigError): a
    night that runs nothing would pass."""
    from fnmatch import fnmatchcase

    if not patterns:
        return list(steps)
    unmatched = [p for p in patterns if not any(fnmatchcase(s.id, p) for s in steps)]
    if unmatched:
        raise ConfigError(
            f"--only {','.join(unmatched)} matches no step of this night (ids as doctor, prefetch/<repo>, "
            "matrix/<entry>, edge/<entry>, accuracy/<run>, history; --dry-run lists them)"
        )
    return [
        s
        if s.skip_reason is not None or any(fnmatchcase(s.id, p) for p in patterns)
        else replace(s, skip_reason=f"not selected by --only {','.join(patterns)}")
        for s in steps
    ]


def scale_timeouts(steps: Sequence[Step], factor: float) -> list[Step]:
    """``--timeout-scale``: every step's timeout times ``factor``."""
    return [replace(s, timeout_s=s.timeout_s * factor) for s in steps]


def worst_case_s(steps: Sequence[Step]) -> float:
    """The longest a night of ``steps`` can take: every step that runs reaches its timeout and is stopped (its grace)
    and, a GPU step, waits for its GPUs' memory to come back. What a CI job's timeout must hold
    (ci/nightly-gpu.yml)."""
    return sum(
        s.timeout_s + STOP_GRACE_S + (RELEASE_TIMEOUT_S if s.gpu_plan is not None else 0.0)
        for s in steps
        if s.skip_reason is None
    )


def _matrix_steps(night: Night, matrix_file: Path | None, matrix_ids: list[str]) -> list[Step]:
    """Every GPU entry of the matrices, with this version's predictions."""
    from harness.matrix.config import EDGE_YAML, MATRIX_YAML, load_matrix
    from harness.matrix.plan import plan as matrix_plan

    steps = []
    for file in [matrix_file] if matrix_file else [MATRIX_YAML, EDGE_YAML]:
        matrix, models = load_matrix(file)
        kind = "edge" if file == EDGE_YAML else "matrix"
        for p in (p for p in matrix_plan(matrix, models, night.version, "gpu", len(night.gpus)) if p.device == "gpu"):
            if kind == "matrix" and p.id not in matrix_ids:  # the history step draws the GQA matrix (its default)
                matrix_ids.append(p.id)
            steps.append(_matrix_step(night, p, matrix.get(p.id), models, file, kind))
    return steps


def _accuracy_step(night: Night, hub_id: str, tp_p: int, tp_d: int) -> Step:
    from harness.models.config import load_models

    entry = load_models().find(hub_id)
    sid = night.sid("accuracy", f"{entry.id if entry else hub_id.split('/')[-1].lower()}-p{tp_p}-d{tp_d}")
    gplan, skip = _plan(night, sid, tp_p, tp_d, hub_id)
    argv = (
        night.python,
        "-m",
        "harness",
        "e2e",
        "--device",
        "gpu",
        "--model",
        hub_id,
        "--tp-p",
        str(tp_p),
        "--tp-d",
        str(tp_d),
        "--accuracy",
        "--accuracy-task",
        ACCURACY_TASK,
        "--run-dir",
        str(night.run_dir / sid),
        *night.run_args,
    )
    expected = entry.gsm8k_expected if entry else None
    checks = E2E_CHECKS + (ACCURACY_CHECKS if expected is not None else ACCURACY_CHECKS[:-1])
    if skip is None and hub_id not in night.hub_models:
        night.hub_models.append(hub_id)
    checks += ("e2e exit code 0 (verdict pass)",)
    cfg = e2e_config(argv[3:], serving_python(night.version, night.python)) if gplan else None
    servers = server_lines(cfg, gplan) if cfg and gplan else ()
    note = f"full {ACCURACY_TASK} through P/D vs baseline" + (f"; expected score {expected}" if expected else "")
    return Step(
        sid,
        "accuracy",
        argv,
        TIMEOUTS_S["accuracy"],
        checks,
        tp_p + tp_d,
        gplan,
        servers,
        skip,
        note,
        night.env,
        night.version,
        needs=(prefetch_id(hub_id), prefetch_id(HUB_DATASET)) if skip is None else (),
    )


def doctor_step(python: str, gpus: int, versions: Sequence[str], models: list[str], run_dir: Path) -> Step:
    """Step 0: `python -m harness doctor` on the night's GPUs, versions and models; before the prefetch, so a model
    not cached yet is no problem unless it is gated and no token is set. Its failure stops the night (run_steps)."""
    argv = (python, "-m", "harness", "doctor", "--before-prefetch", "--gpus", str(gpus), "--models", ",".join(models))
    return Step(
        "doctor",
        "doctor",
        argv + (("--vllm-version", ",".join(versions)) if versions else ()),
        TIMEOUTS_S["doctor"],
        ("doctor exit code 0: NVML, GPUs, driver, environments (lm-eval), gated models, disk",),
        note="the box proven before the night spends it; a problem stops the night",
    )


def prefetch_id(repo: str) -> str:
    """The id of the step that fetches ``repo`` (a model, or the dataset)."""
    return f"prefetch/{repo}"


def _prefetch_steps(python: str, hub_models: list[str]) -> list[Step]:
    """One step per model and one for GSM8K, each its own JUnit case: a gated (401) or missing repo fails its own step
    only, and the steps that need it are skipped with that reason (run_steps)."""
    import json

    q = json.dumps  # double quotes, so the shell rendering stays readable
    calls = [(m, f"d({q(m)}, ignore_patterns={q(PREFETCH_IGNORE)})") for m in hub_models]
    calls.append((HUB_DATASET, f"d({q(HUB_DATASET)}, repo_type={q('dataset')})"))
    return [
        Step(
            prefetch_id(repo),
            "prefetch",
            (python, "-c", f"from huggingface_hub import snapshot_download as d; {call}"),
            TIMEOUTS_S["prefetch"],
            (f"{repo} is in $HF_HOME (servers run with HF_HUB_OFFLINE=1)",),
        )
        for repo, call in calls
    ]


def _matrix_step(night: Night, p, entry, models, file: Path, kind: str) -> Step:
    """One GPU matrix entry as a nightly step: `python -m harness matrix FILE --only ID`, its plan and server
    commands."""
    from harness.matrix.run import model_for

    model = model_for(p, models)
    sid = night.sid(kind, p.id)
    argv = (
        night.python,
        "-m",
        "harness",
        "matrix",
        str(file),
        "--only",
        p.id,
        "--device",
        "gpu",
        "--gpus",
        str(len(night.gpus)),
        "--run-dir",
        str(night.run_dir / sid),
        *night.run_args,
    )
    gplan, skip = None, p.skip_reason
    if skip is None:  # the matrix runs its baseline after P/D
        gplan, skip = _plan(night, sid, p.tp_p, p.tp_d, model, baseline_first=False)
    if skip is None and model not in night.hub_models:
        night.hub_models.append(model)
    axes = " ".join(f"{k}={v}" for k, v in p.settings.items())
    label = night.version or "(pinned)"
    return Step(
        sid,
        "matrix",
        argv,
        TIMEOUTS_S["matrix"],
        _matrix_checks(p.expected, label),
        entry.gpus or 0,
        gplan,
        _matrix_servers(night, p, model, night.run_dir / sid, gplan) if gplan else (),
        skip,
        f"K={p.kv_heads} P{p.tp_p}->D{p.tp_d} regime {p.regime}"
        + (f"; {axes}" if axes else "")
        + (f"; {entry.note}" if entry.note else ""),
        night.env,
        night.version,
        needs=(prefetch_id(model),) if skip is None else (),
    )


def _matrix_servers(night: Night, p, model: str, folder: Path, plan: GpuPlan) -> tuple[tuple[str, str], ...]:
    """The servers of the pair's run as `python -m harness matrix --run-dir FOLDER` builds it (matrix/cli.py
    base_config, matrix/run.py config_for, the pair's folder), served by its version's environment."""
    from harness.envs.vllm_env import main_version
    from harness.matrix.cli import base_config
    from harness.matrix.run import config_for

    version = night.version or main_version("gpu")  # the matrix runs the pinned version from its environment too
    python = serving_python(version, night.python)
    cfg = config_for(base_config("gpu", night.load_requests), p, model, python, folder / f"vllm-{version}" / p.id)
    return server_lines(cfg, plan)


def history_step(python: str, run_dir: Path, versions: Sequence[str], ids: list[str]) -> Step:
    """The release history attached to the night: its matrix results (and any stored earlier at the same harness
    revision) as history.md + history.png, one row per version; it runs nothing itself."""
    from harness.envs.vllm_env import main_version

    argv = (
        python,
        "-m",
        "harness",
        "history",
        "--device",
        "gpu",
        "--versions",
        ",".join(versions) or main_version("gpu"),
        "--only",
        ",".join(ids),
        "--import-runs",
        str(run_dir / "matrix"),
        "--no-run",
        "--out",
        str(run_dir / "history"),
    )
    return Step(
        "history",
        "history",
        argv,
        TIMEOUTS_S["history"],
        (
            "history.md and history.png: each GPU entry's outcome on the night's release(s), from the matrix steps' "
            "reports and the results store (same harness revision)",
        ),
        note="runs nothing: draws what the matrix steps measured",
    )


def render_dry_run(steps: Sequence[Step], hw: Hardware) -> str:
    import shlex

    run = [s for s in steps if s.skip_reason is None]
    out = [
        f"nightly GPU run (dry run) on {describe_gpus(hw.gpus)}: {len(run)} steps to run, "
        f"{len(steps) - len(run)} skipped",
        f"GPUs: {hw.source}",
        f"worst case: {worst_case_s(steps) / 60:.0f} min ({WORST_CASE_NOTE})",
        f"note: {PORTS_NOTE}",
        f"note: {PLAN_NOTE}",
        "",
    ]
    for i, s in enumerate(steps, 1):
        state = "to run" if s.skip_reason is None else f"SKIPPED: {s.skip_reason}"
        out.append(f"[{i}/{len(steps)}] {s.id} ({s.kind}) timeout {s.timeout_s / 60:g} min [{state}]")
        if s.note:
            out.append(f"  about: {s.note}")
        if s.env:
            out.append(f"  env: {' '.join(f'{k}={v}' for k, v in s.env)}")
        out.append(f"  command: {shlex.join(s.argv)}")
        for c in s.checks:
            out.append(f"  check: {c}")
        if s.gpu_plan is not None:
            out += [f"  {line}" for line in render_plan(s.gpu_plan).splitlines()]
        for name, cmd in s.servers:
            out.append(f"  server {name}: {cmd}")
        out.append("")
    return "\n".join(out)


def junit_xml(results: Sequence[StepResult], name: str = "nightly-gpu", simulated: str | None = None) -> str:
    """One testcase per step: failure for failed/timed-out steps, skipped with its reason; a passed step's note (a
    simulated box's) in its output. ``simulated``: the box, as a property of the suite."""
    suite = ET.Element(
        "testsuite",
        name=name,
        tests=str(len(results)),
        failures=str(sum(r.status in ("failed", "timeout") for r in results)),
        skipped=str(sum(r.status == "skipped" for r in results)),
        errors="0",
        time=f"{sum(r.seconds for r in results):.1f}",
    )
    if simulated:
        props = ET.SubElement(suite, "properties")
        ET.SubElement(props, "property", name="simulated_gpus", value=f"{SIMULATED_ENV}={simulated}")
    for r in results:
        case = ET.SubElement(
            suite, "testcase", classname=f"nightly.{r.step.kind}", name=r.step.id, time=f"{r.seconds:.1f}"
        )
        if r.status == "skipped":
            ET.SubElement(case, "skipped", message=r.message)
        elif r.status in ("failed", "timeout"):
            ET.SubElement(case, "failure", message=r.message, type=r.status).text = r.message
        out = [r.message] if r.status == "passed" and r.message else []
        if r.log:
            out.append(f"log: {r.log}")
        if out:
            ET.SubElement(case, "system-out").text = "\n".join(out)
    return ET.tostring(suite, encoding="unicode", xml_declaration=True)


def run_step(step: Step, log_path: Path) -> StepResult:
    """Run one step as its own process group; on timeout SIGTERM it (its harness tears down its servers), then
    SIGKILL."""
    from harness.serve.procs import ManagedProcess, ProcessSpec, tail

    t0 = time.monotonic()
    proc = ManagedProcess(
        ProcessSpec(
            name=step.id.replace("/", "-"),
            argv=step.argv,
            log_path=log_path,
            cwd=REPO_ROOT,
            env=dict(step.env),
            stop_grace_s=STOP_GRACE_S,
        )
    )
    with proc:
        while proc.returncode is None and time.monotonic() - t0 < step.timeout_s:
            time.sleep(STEP_POLL_S)
        rc = proc.returncode
    secs = time.monotonic() - t0
    if rc is None:
        return StepResult(step, "timeout", secs, f"no result within {step.timeout_s:g} s; stopped", str(log_path))
    if rc != 0:
        return StepResult(step, "failed", secs, f"exit code {rc}; last lines:\n{tail(log_path, 15)}", str(log_path), rc)
    return StepResult(step, "passed", secs, "", str(log_path), rc)


def _nothing_to_import(s: Step, results: list[StepResult]) -> str:
    """The history step imports the night's GQA-matrix runs (``matrix/<pair>``): where none ran (a box too small for
    every pair), there is no folder to import and the step is skipped, saying so."""
    ran = any(r.step.id.startswith("matrix/") and r.status in ("passed", "failed") for r in results)
    return "" if s.kind != "history" or ran else "no GQA-matrix step ran this night: no runs to import into the history"


def run_steps(
    steps: Sequence[Step],
    run_dir: Path,
    runner: Callable[[Step, Path], StepResult] = run_step,
    gpu_guard: Callable[[Step], Callable[[], str | None] | str] | None = None,
    out=sys.stdout,
    simulated: str | None = None,
) -> list[StepResult]:
    """Every step in order; JUnit XML rewritten after each, so an interrupted night keeps what ran.

    ``gpu_guard(step)`` checks the GPUs before a step (an error string fails the step unrun) and returns a
    callable that checks after it that they were released (an error string fails the step). ``simulated``: the
    simulated box the night runs on; each step's result is then judged by ``judge_simulated``.
    """
    results: list[StepResult] = []
    junit = run_dir / "junit.xml"
    judge = (lambda r: judge_simulated(r, simulated)) if simulated else (lambda r: r)
    for s in steps:
        missing = _missing(s, results) or _stopped(results) or _nothing_to_import(s, results)
        if s.skip_reason is not None or missing:
            results.append(StepResult(s, "skipped", 0.0, s.skip_reason or missing))
        else:
            print(f"nightly: {s.id} (timeout {s.timeout_s / 60:g} min)", file=out, flush=True)
            after = None
            if gpu_guard is not None and s.gpu_plan is not None:
                check = gpu_guard(s)
                if isinstance(check, str):
                    results.append(StepResult(s, "failed", 0.0, f"GPUs not ready: {check}"))
                    _write(junit, results, out, s, simulated)
                    continue
                after = check
            r = judge(runner(s, run_dir / "steps" / f"{s.id.replace('/', '-')}.log"))
            leak = after() if after else None
            if leak and r.status == "passed":
                r = StepResult(s, "failed", r.seconds, f"GPUs not released: {leak}", r.log)
            results.append(r)
            if s.kind == "doctor" and r.status != "passed":
                _show_log(r, out)
        _write(junit, results, out, s, simulated)
    return results


def _stopped(results: Sequence[StepResult]) -> str:
    """Why the night stops before a step: its doctor step found a problem ("" when it goes on)."""
    bad = [r for r in results if r.step.kind == "doctor" and r.status in ("failed", "timeout")]
    return f"the night stopped: step {bad[0].step.id} {bad[0].status} (its lines say what to do)" if bad else ""


def _show_log(r: StepResult, out) -> None:
    """The doctor's lines, as it printed them: the one screen that says why the night stopped."""
    try:
        text = Path(r.log).read_text() if r.log else r.message
    except OSError:
        text = r.message
    print(text.rstrip(), file=out, flush=True)


def _missing(step: Step, results: Sequence[StepResult]) -> str:
    """Why ``step`` cannot run for want of what an earlier step failed to fetch ("" when nothing is missing)."""
    failed = {r.step.id: r for r in results if r.status in ("failed", "timeout")}
    bad = [failed[n] for n in step.needs if n in failed]
    if not bad:
        return ""
    what = ", ".join(r.step.id.removeprefix("prefetch/") for r in bad)
    return f"{what} missing from the local Hugging Face cache: {', '.join(r.step.id for r in bad)} {bad[0].status}"


def judge_simulated(r: StepResult, box: str) -> StepResult:
    """A matrix or accuracy step on a simulated box passes when every run it made got through with the stand-ins: each
    run's report marked simulated, verdict pass (its data-path checks skipped). What vLLM would have done cannot be
    shown by stand-ins and is not judged: a matrix entry that expects vLLM to refuse the pair makes the matrix exit 1
    when the stand-ins serve it, which is accepted here. Timeouts and the other steps stay as they ran."""
    if r.status not in ("passed", "failed") or r.step.kind not in ("matrix", "accuracy"):
        return r
    runs = simulated_runs(r.step)
    bad = [f"{name}: {why}" for name, why in runs if why]
    rc_ok = r.returncode == 0 or (r.step.kind == "matrix" and r.returncode == 1)
    if not runs or bad or not rc_ok:
        why = "; ".join(bad) or ("no run report" if not runs else f"exit code {r.returncode}")
        return replace(r, status="failed", message=f"{SIM_REASON}: {why}\n{r.message}".strip())
    note = (
        f"{SIM_REASON} ({SIMULATED_ENV}={box}): {len(runs)} run(s) got through with stand-in servers; their "
        "data-path checks were skipped, not passed"
    )
    if r.returncode:
        note += "; the matrix's expected outcomes of vLLM were not judged (exit code 1: stand-ins cannot show them)"
    return replace(r, status="passed", message=note)


def simulated_runs(step: Step) -> list[tuple[str, str | None]]:
    """Each run a step made (its e2e run, or each pair its matrix ran) and what is wrong with it on a simulated box."""
    import json

    folder = step.run_dir
    if folder is None:
        return []
    if step.kind == "accuracy":
        return [(step.id, _simulated_problem(folder / "report.json"))]
    try:
        pairs = json.loads((folder / "report.json").read_text()).get("pairs") or []
    except (OSError, ValueError):
        return []
    return [(p["id"], _simulated_problem(Path(p["run_dir"]) / "report.json")) for p in pairs if p.get("run_dir")]


def _simulated_problem(report: Path) -> str | None:
    import json

    try:
        d = json.loads(report.read_text())
    except (OSError, ValueError):
        return f"no run report ({report})"
    if not d.get("simulated"):
        return f"{report} is not marked simulated"
    if d.get("verdict") != "pass":
        return f"verdict {d.get('verdict')}: {str(d.get('reason'))[:300]}"
    return None


def _write(junit: Path, results: list[StepResult], out, s: Step, simulated: str | None = None) -> None:
    junit.parent.mkdir(parents=True, exist_ok=True)
    tmp = junit.with_suffix(".xml.tmp")
    tmp.write_text(junit_xml(results, simulated=simulated))
    tmp.replace(junit)
    r = results[-1]
    print(
        f"nightly: {s.id}: {r.status}" + (f" ({r.message.splitlines()[0]})" if r.message else ""), file=out, flush=True
    )


def nvml_guard(step: Step) -> Callable[[], str | None] | str:
    """Before a step: the plan's GPUs (physical NVML ids, within the caller's CUDA_VISIBLE_DEVICES) have the free
    memory its servers will be given. After: our memory came back."""
    from harness.gpu.nvml import GpuCheckFailed, check_free, discover, wait_released

    d = discover()
    if not d.available:
        return d.reason or "NVML unavailable"
    try:
        check_free(step.gpu_plan, d.gpus)  # type: ignore[arg-type]
    except GpuCheckFailed as e:
        return str(e)
    before = {g.index: g.free_gib for g in d.gpus}
    used = sorted({g for s in step.gpu_plan.servers for g in s.gpus})  # type: ignore[union-attr]

    def after() -> str | None:
        try:
            wait_released([], used, RELEASE_TIMEOUT_S, free_before=before)
        except GpuCheckFailed as e:
            return str(e)
        return None

    return after


def choose_hardware(d: Discovery, count: int | None, mem_gib: float | None, dry_run: bool) -> Hardware:
    """The night's GPUs: NVML's (the caller's CUDA_VISIBLE_DEVICES applied), the first ``count`` of them when given.
    A dry run may plan for a box it is not on (flags, else 8 x 80 GiB where NVML cannot be read); a real run
    refuses (ConfigError, one line) GPUs it cannot read, too few GPUs, or a memory size NVML does not report."""
    if not d.available or not d.gpus:
        why = d.describe() if not d.available else f"{d.describe()}: no GPU to run on"
        if not dry_run:
            raise ConfigError(f"the nightly run cannot use the GPUs: {why}; --dry-run prints the plan anywhere")
        n, mem = count or DEFAULT_GPUS, mem_gib or DEFAULT_GPU_MEM_GIB
        given = "--gpus/--gpu-mem-gib" if count or mem_gib else "default"
        return Hardware(uniform_gpus(n, mem), f"{n} x {mem:g} GiB assumed ({given}); {why}", assumed=True)
    seen, sim = d.plan_gpus(), d.simulated
    if count is not None and count > len(seen):
        if not dry_run:
            raise ConfigError(
                f"the nightly run needs {count} GPUs, {len(seen)} present ({d.describe()}); "
                "--dry-run prints the plan anywhere"
            )
        mem = mem_gib or min(g.total_gib for g in seen)
        return Hardware(
            uniform_gpus(count, mem),
            f"{count} x {mem:g} GiB assumed (--gpus {count}); {d.describe()}",
            assumed=True,
            simulated=sim,
        )
    if mem_gib is not None and not dry_run:
        # The steps' own runs plan with NVML's memory; a night planned otherwise would check the wrong shares.
        raise ConfigError(
            "--gpu-mem-gib only plans a dry run: a real run takes each GPU's memory from NVML, as its steps do"
        )
    chosen = seen[:count] if count else seen
    how = d.describe() + (f"; the first {count} by --gpus" if count and count < len(seen) else "")
    if mem_gib:
        return Hardware(
            tuple(replace(g, total_gib=mem_gib) for g in chosen),
            f"{how}; planned as {mem_gib:g} GiB each (--gpu-mem-gib)",
            assumed=True,
            simulated=sim,
        )
    return Hardware(chosen, how, simulated=sim)


def given_util(env: Mapping[str, str]) -> float | None:
    """GPU_MEMORY_UTILIZATION as an e2e run reads it (ConfigError naming the variable when it is not a share)."""
    return env_defaults({UTIL_ENV: env.get(UTIL_ENV, "")}).get("gpu_memory_utilization")  # type: ignore[return-value]


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
            hw.gpus, a.python, run_dir, versions, util=util, simulated=hw.simulated, load_requests=a.load_requests
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
        from harness.gpu.claims import box_state

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
