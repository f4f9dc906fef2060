"""The control without P/D: a failing run's model and prompts served by one plain vLLM server, compared with the
baseline by the run's own rules. A failure that shows here needs no P/D, and is no P/D finding.

The control server is D's recorded command without what makes it a P/D server (its KV connector, the NIXL side
channel, the harness's KV digest and fault hooks) and with P's chunked prefill, so it carries every setting of the run
that one server can: D's block size, prefix cache and KV layout, the KV dtype, speculative decoding, P's
``--max-num-batched-tokens``. The baseline is the run's recorded baseline command, started again here. Both answer the
run's sequential prompts and its prefix-cache scenarios (where D's prefix cache acts: the sequential prompts share no
prefix), one at a time; the load phase's prompts are not sent. A run whose P/D phase failed before its baseline ran
recorded no baseline command: its control only has to serve every prompt.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.checks.check import Check
from harness.checks.classify import FATAL_PATTERNS, REPEATED_FATAL
from harness.checks.compare import compare_completions
from harness.checks.load import check_logprobs, logprob_coverage
from harness.core.errors import ConfigError
from harness.core.files import new_folder, write_atomic
from harness.core.safe import load_json_object
from harness.matrix.run import OUTCOME_OF_CLASS
from harness.repro.bundle import ServerCommand, split_command
from harness.run.evaluate import MIN_PROMPTS, answered_check, match_check
from harness.run.failures import from_checks, from_exception
from harness.run.prompts_file import PROMPTS_FILE
from harness.serve.ports import PortAllocator, server_ports
from harness.serve.procs import RUN_TAG_ENV, ManagedProcess, ProcessFailed, ProcessSpec
from harness.serve.vllm_cmd import FATAL_LOG_PATTERNS
from harness.workload.client import CompletionRun, GenerationSettings, TokenPrompt, run_completions
from harness.workload.prompts import Prompt

CONTROL_DIR = "no-pd-control"  # beside the run's own files, in its folder
# What makes D's command a P/D server's: the connector's flag, and the environment of NIXL and of the harness's hooks
PD_FLAGS = ("--kv-transfer-config",)
PD_ENV_PREFIXES = ("VLLM_NIXL_", "PD_HARNESS_", "UCX_")
PD_ENV = ("PYTHONPATH",)  # only the harness's hooks (KV digest, faults, NIXL tuning) put it on a server's command


@dataclass(frozen=True)
class ControlResult:
    outcome: str  # ok, or what the plain server showed, in the matrix's words (a failure class)
    run_dir: str  # the control's folder: control.json and its servers' logs
    detail: str = ""  # the failed checks or the failure's reason


@dataclass(frozen=True)
class ControlPlan:
    control: ServerCommand
    baseline: ServerCommand | None  # None: the run recorded none (its P/D phase failed first); nothing to compare
    carried: tuple[str, ...]  # the run's settings the control server has that the baseline has not, in words


def control_plan(report: dict[str, Any]) -> ControlPlan:
    """The control's servers from a run's report (pure); ConfigError when the run recorded no decode command."""
    cfg = report.get("config") or {}
    decode = (report.get("commands") or {}).get("decode")
    if not decode:
        raise ConfigError("the run recorded no decode command (it stopped before P/D started): no control to serve")
    d = split_command(decode, "decode")
    argv = _without_flags(d.argv, PD_FLAGS)
    env = {k: v for k, v in d.env.items() if k not in PD_ENV and not k.startswith(PD_ENV_PREFIXES)}
    axes = cfg.get("axes") or {}
    carried = []
    if axes.get("prefix_caching_d"):
        carried.append("D's prefix cache")
    if cfg.get("kv_layout_d"):
        carried.append(f"D's KV layout {cfg['kv_layout_d']}")
    chunk = axes.get("max_num_batched_tokens_p")
    if chunk is not None:
        argv = _with_flag(argv, "--max-num-batched-tokens", str(int(chunk)))
        carried.append(f"P's chunked prefill (--max-num-batched-tokens {int(chunk)})")
    shown = cfg.get("baseline_command") or (report.get("commands") or {}).get("baseline")
    baseline = split_command(shown, "baseline") if shown else None
    return ControlPlan(ServerCommand("control", env, argv), baseline, tuple(carried))


def run_no_pd_control(run_dir: Path, out: Path | None = None) -> ControlResult:
    """The control of the run in ``run_dir``, in ``out`` (default ``<run_dir>/no-pd-control``, or -2, -3, ... when
    that exists). ConfigError when the run cannot have one; a baseline that does not serve raises RuntimeError."""
    run_dir = Path(run_dir)
    report = load_json_object(run_dir / "report.json", "report")
    plan = control_plan(report)
    cfg = report.get("config") or {}
    folder = new_folder(Path(out) if out else run_dir / CONTROL_DIR)
    prompts = run_prompts(run_dir)
    gen = GenerationSettings(
        max_tokens=int(cfg.get("max_tokens") or 16),
        logprobs=int(cfg.get("logprobs") or 5),
        seed=int(cfg.get("seed") or 0),
        timeout_s=float(cfg.get("request_timeout_s") or 180.0),
    )
    served = str(cfg.get("served_model_name") or plan.control.flag("--served-model-name") or "")
    ready_s = float(cfg.get("ready_timeout_s") or 600.0)
    base = None
    if plan.baseline is not None:
        try:
            base = serve_and_ask(plan.baseline, folder, served, prompts, gen, ready_s)
        except ProcessFailed as e:
            raise RuntimeError(f"the baseline did not serve: {e.name}: {e.reason}") from None
    try:
        ctl = serve_and_ask(plan.control, folder, served, prompts, gen, ready_s)
        failure, checks = judge(base, ctl, len(prompts), float(cfg.get("logprob_threshold") or 0.0), gen, folder)
    except ProcessFailed as e:
        failure, checks = from_exception(e, lambda: _logs(folder)), []
    cls = (failure or {}).get("class")
    result = ControlResult(
        "ok" if cls is None else OUTCOME_OF_CLASS.get(cls, cls), str(folder), str((failure or {}).get("reason") or "")
    )
    record = {
        "run": str(run_dir),
        **asdict(result),
        "carried": list(plan.carried),
        "commands": {"control": plan.control.argv, "baseline": plan.baseline.argv if plan.baseline else None},
        "checks": [c.to_dict() for c in checks],
        "prompts": [p.id for p in prompts],
    }
    write_atomic(folder / "control.json", json.dumps(record, indent=1) + "\n")
    return result


def judge(
    base: CompletionRun | None, ctl: CompletionRun, n: int, threshold: float, gen: GenerationSettings, folder: Path
) -> tuple[dict | None, list[Check]]:
    """(the failure, or None; the checks): the run's answered, outputs and logprobs checks, the control in P/D's
    place; without a baseline, only that the control answered every prompt."""
    if base is None:
        answered = Check(
            "all_requests_answered",
            not ctl.failures and len(ctl.completions) == n,
            f"control {len(ctl.completions)}/{n} (the run recorded no baseline: outputs are not compared)",
        )
        checks = [answered]
    else:
        result = compare_completions(base.completions, ctl.completions, top_k=gen.logprobs)
        checks = [answered_check(base, ctl, n), match_check(result, min(MIN_PROMPTS, n))]
        if logprob_coverage([result])[0] and threshold > 0:
            checks.append(check_logprobs([result], threshold))
    runs = [ctl] + ([base] if base is not None else [])
    return from_checks(checks, _logs(folder), runs), checks


def serve_and_ask(
    cmd: ServerCommand,
    folder: Path,
    served: str,
    prompts: list[Prompt | TokenPrompt],
    gen: GenerationSettings,
    ready_s: float,
) -> CompletionRun:
    """Start ``cmd`` alone on fresh ports, send every prompt one at a time, stop it. ProcessFailed: it did not serve."""
    with PortAllocator() as alloc:
        tp = int(cmd.flag("--tensor-parallel-size") or 1)
        ports = server_ports(alloc, tp)
        argv = _with_flag(cmd.argv, "--port", str(ports.http))
        host = cmd.flag("--host") or "127.0.0.1"
        env = {**cmd.env, "VLLM_PORT": str(ports.internal_base), RUN_TAG_ENV: str(folder / "logs")}
        url = f"http://{host}:{ports.http}"
        spec = ProcessSpec(
            name=cmd.role,
            argv=argv,
            env=env,
            log_path=folder / "logs" / f"{cmd.role}.log",
            health_url=f"{url}/health",
            fatal_patterns=FATAL_LOG_PATTERNS + FATAL_PATTERNS,
            repeated_fatal=REPEATED_FATAL,
            ready_timeout_s=ready_s,
        )
        with ManagedProcess(spec) as proc:
            proc.wait_ready()
            return run_completions(url, served, prompts, gen, run_tag=f"{cmd.role}-")


def run_prompts(run_dir: Path) -> list[Prompt | TokenPrompt]:
    """The run's sequential prompts (text, or token ids for a model the harness did not make) and prefix-cache
    scenarios (token ids), from its prompts.json."""
    try:
        data = json.loads((run_dir / PROMPTS_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{run_dir / PROMPTS_FILE}: the run's prompts cannot be read ({e})") from None
    out: list[Prompt | TokenPrompt] = [
        # a model the harness did not make gets its sequential prompts as token ids (token-exact lengths)
        TokenPrompt(str(k), [int(t) for t in v]) if isinstance(v, list) else Prompt(str(k), str(v), len(str(v).split()))
        for k, v in (data.get("sequential") or {}).items()
    ]
    out += [TokenPrompt(str(k), [int(t) for t in v]) for k, v in (data.get("prefix") or {}).items()]
    if not out:
        raise ConfigError(f"{run_dir / PROMPTS_FILE} holds no sequential or prefix-cache prompt")
    return out


def _logs(folder: Path) -> dict[str, str]:
    return {p.stem: p.read_text(errors="replace") for p in sorted((folder / "logs").glob("*.log"))}


def _without_flags(argv: list[str], flags: tuple[str, ...]) -> list[str]:
    """``argv`` without each of ``flags`` and its value."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        else:
            out.append(a)
    return out


def _with_flag(argv: list[str], flag: str, value: str) -> list[str]:
    """``argv`` with ``flag``'s value set to ``value`` (appended when it had none)."""
    if flag in argv[:-1]:
        i = argv.index(flag)
        return [*argv[: i + 1], value, *argv[i + 2 :]]
    return [*argv, flag, value]
