"""The night's steps, planned: doctor, prefetch per repo, per vLLM version the calibration (when the box has none) and
each GPU matrix and edge entry and accuracy per model, history, each with its GPU plan (or why it is skipped); --only
and --timeout-scale over them."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.accuracy.settings import HUB_DATASET, HUB_TASK
from harness.core.errors import ConfigError
from harness.doctor.needs import ACCURACY_RUNS as NIGHT_ACCURACY_RUNS
from harness.gpu.plan import CUDA_DEVICE_ORDER, Gpu, GpuPlan, PlanError, UtilizationError, model_memory, plan_gpus
from harness.nightly.hardware import UTIL_ENV
from harness.nightly.servers import e2e_config, server_lines, serving_python
from harness.nightly.simulated import SIM_REASON
from harness.nightly.step import Step
from harness.run.config import GPU_DEFAULT_MODEL
from harness.run.thresholds import ThresholdKey, ThresholdStore, threshold_key
from harness.simbox.box import SIMULATED_ENV, parse_box

# Per-step timeouts (s). A matrix pair starts up to three servers (10 min ready timeout each) and
# sends 18 prompts; an accuracy run adds full GSM8K (1319 questions) twice, baseline and P/D.
# A calibration is two e2e runs (a correct one, one with a decode-KV fault): up to six server starts, 1.5 pairs.
TIMEOUTS_S = {
    "doctor": 10 * 60,
    "prefetch": 30 * 60,
    "calibrate": 60 * 60,
    "matrix": 40 * 60,
    "accuracy": 90 * 60,
    "history": 10 * 60,
}
CALIBRATE_RUN_TIMEOUT_S = 30 * 60  # each of its runs (calibrate --timeout)
# What the night calibrates: the GPU default model, which its matrix and accuracy steps serve too, at P1->D2 (P and
# the baseline at different TPs: the rounding noise most of the night's pairs show).
CALIBRATE_RUN = (GPU_DEFAULT_MODEL, 1, 2)
CALIBRATE_FALLBACK = "the night goes on: later runs use the default logprob threshold (their reports say so)"
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
    driver: str | None = None  # NVML's driver version: with the GPUs' model names, the box's calibration key
    thresholds: ThresholdStore | None = None  # the calibrated thresholds (None: not read, every calibration planned)

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
    driver: str | None = None,
    thresholds: ThresholdStore | None = None,
) -> list[Step]:
    """Every step of the nightly run on ``gpus`` (physical ids, memory, names), for each of ``versions`` (none: the
    pinned one); pure apart from reading the configs and ``thresholds``. ``util``: GPU_MEMORY_UTILIZATION given by
    hand; ``simulated``: the simulated box the GPUs are on (nothing to prefetch, the history kept in the night's
    folder); ``load_requests``: each run's load phase (None: the runs' default); ``driver`` and ``thresholds``: NVML's
    driver version and the calibrated thresholds, which decide whether a version's calibrate step runs."""
    steps: list[Step] = []
    hub_models: list[str] = []
    matrix_ids: list[str] = []
    for version in list(versions) if versions else [None]:
        night = Night(
            tuple(gpus),
            python,
            run_dir,
            version,
            len(versions) > 1,
            util,
            hub_models,
            simulated,
            load_requests,
            driver,
            thresholds,
        )
        steps.append(calibrate_step(night))
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
            "calibrate/<run>, matrix/<entry>, edge/<entry>, accuracy/<run>, history; --dry-run lists them)"
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


def calibrate_step(night: Night) -> Step:
    """Before a version's matrix and accuracy steps: `python -m harness calibrate --store` (harness/calibrate/) when
    the store has no threshold for the box's key (the night's GPU model and driver, the version's vLLM, the calibrated
    model); skipped, naming the stored threshold, when it has one. Its failure stops nothing (run_steps)."""
    from harness.envs.vllm_env import main_version
    from harness.models.config import load_models

    model, tp_p, tp_d = CALIBRATE_RUN
    entry = load_models().find(model)
    sid = night.sid("calibrate", f"{entry.id if entry else model.split('/')[-1].lower()}-p{tp_p}-d{tp_d}")
    key = threshold_key((g.name for g in night.gpus), night.driver, night.version or main_version("gpu"), model)
    gplan, skip = _plan(night, sid, tp_p, tp_d, model)
    stored = None
    if night.thresholds is not None and isinstance(key, ThresholdKey) and not night.simulated:
        stored = night.thresholds.lookup(key)
    if night.simulated:
        skip = f"{SIM_REASON}: the stand-in servers' answers measure no box"
    elif stored is not None:
        skip = f"threshold {stored.threshold:.3g} already calibrated for {stored.key.describe()}: {stored.source}"
    if skip is None and model not in night.hub_models:
        night.hub_models.append(model)
    why = f"not looked up ({key}; its runs read theirs)" if isinstance(key, str) else f"none for {key.describe()}"
    about = (
        f"a correct P{tp_p}->D{tp_d} run and a decode-KV-fault run place the logprob threshold; a stored one: {why}; "
        f"if it fails, {CALIBRATE_FALLBACK}"
    )
    argv = (night.python, "-m", "harness", "calibrate", "--out", str(night.run_dir / sid), "--store", "--timeout")
    e2e = ("--device", "gpu", "--model", model, "--tp-p", str(tp_p), "--tp-d", str(tp_d), *night.run_args)
    return Step(
        sid,
        "calibrate",
        (*argv, f"{CALIBRATE_RUN_TIMEOUT_S:g}", "--", *e2e),
        TIMEOUTS_S["calibrate"],
        ("calibrate exit code 0: a threshold between a correct run's noise and a KV fault's effect, kept for the box",),
        tp_p + tp_d,
        gplan,
        skip_reason=skip,
        note=about if stored is None else "the night's runs of the model use the stored threshold",
        env=night.env,
        version=night.version,
        needs=(prefetch_id(model),) if skip is None else (),
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
