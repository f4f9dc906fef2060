"""What a run launches: the model it serves, a vLLM server of a role, the proxy; each a managed process not yet started."""

from __future__ import annotations

import datetime as dt
import os
from dataclasses import dataclass
from pathlib import Path

from harness.checks.classify import FATAL_PATTERNS
from harness.core.notrack import with_no_track
from harness.core.paths import REPO_ROOT
from harness.gpu.claims import STATE_ENV, box_state
from harness.gpu.plan import CUDA_DEVICE_ORDER, ServerPlacement
from harness.gpu.simulate import SIMULATED_ENV, simulated_box
from harness.run.config import E2EConfig
from harness.serve.ports import PortAllocator, server_ports
from harness.serve.procs import ManagedProcess, ProcessSpec
from harness.serve.vllm_cmd import API_SERVER_MODULE, FATAL_LOG_PATTERNS, Command, ServerSpec, build_server_command

PROXY_SCRIPT = REPO_ROOT / "toy_proxy_server.py"
# Every process of a run carries its logs folder in this variable, so leftovers can be found by owner, never by name.
RUN_TAG_ENV = "PD_HARNESS_RUN_LOGS"
STANDIN_MODULE = "harness.gpu.standin"  # what serves a simulated GPU box in vLLM's place


@dataclass
class Server:
    spec: ServerSpec
    proc: ManagedProcess
    url: str
    command: str


def new_run_dir(cfg: E2EConfig) -> Path:
    if cfg.run_dir is not None:
        return Path(cfg.run_dir)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return cfg.runs_root / f"{stamp}-p{cfg.tp_p}d{cfg.tp_d}-{os.getpid()}"


def resolve_model(cfg: E2EConfig) -> tuple[str, str]:
    """(model path or hub id, served model name). Accuracy runs on CPU use the tiny model trained on the offline task."""
    if cfg.model is None and cfg.accuracy is not None:
        from harness.models.trained import TRAINED_NAME, ensure_trained_model

        return str(ensure_trained_model()), TRAINED_NAME
    if cfg.model is None:
        from harness.models.tiny import ensure_tiny_model

        path = ensure_tiny_model()
        return str(path), "tiny-llama"
    p = Path(cfg.model)
    return (str(p.resolve()), p.name) if p.exists() else (cfg.model, cfg.model)


def make_server(
    cfg: E2EConfig,
    alloc: PortAllocator,
    role: str,
    tp: int,
    model: str,
    name: str,
    block_size: int | None,
    cpu_bind: str | None,
    logs_dir: Path,
    kv_layout: str | None = None,
    label: str | None = None,
    kv_load_failure_policy: str = "fail",
    placement: ServerPlacement | None = None,
    num_blocks: int | None = None,
    log_requests: bool = False,
) -> Server:
    """A not-yet-started vLLM server of ``role`` with ports from ``alloc`` and its log in ``logs_dir``.

    ``label`` names the process and its log (default: the role); ``kv_load_failure_policy`` other than
    "fail" is for tests that must see the harness refuse a silently recomputed transfer. ``placement``
    (GPU): the server's GPUs and memory share from the run's GPU plan (which holds a given --gpu-memory-utilization)."""
    spec = ServerSpec(
        role=role,  # type: ignore[arg-type]
        model=model,
        served_model_name=name,
        tp=tp,
        device=cfg.device,  # type: ignore[arg-type]
        block_size=block_size,
        kv_layout=kv_layout,
        cpu_bind=cpu_bind,
        kv_lease_s=cfg.lease_s,
        # the plan's share: the run's own value where one was given, checked against colocation by the plan
        gpu_memory_utilization=placement.gpu_memory_utilization if placement else cfg.gpu_memory_utilization,
        gpus=placement.gpus if placement else (),
        # CUDA_VISIBLE_DEVICES comes from ``gpus``; the plan's ids are NVML's, so CUDA must count in the same order
        extra_env=(("CUDA_DEVICE_ORDER", CUDA_DEVICE_ORDER),) if placement else (),
        seed=cfg.seed,
        kv_load_failure_policy=kv_load_failure_policy,
        num_blocks=num_blocks,
        log_requests=log_requests,
        fault_kv_scale=cfg.decode_kv_fault if role == "decode" else None,
        max_model_len=cfg.model_len,
        dtype=cfg.dtype or ("float32" if cfg.device == "cpu" else None),
        enforce_eager=cfg.enforce_eager if cfg.enforce_eager is not None else cfg.device == "cpu",
        kv_cache_dtype=cfg.axes.kv_cache_dtype,
        async_scheduling=cfg.axes.async_scheduling,
        attention_backend=cfg.axes.attention_backend,
        kv_buffer_device=cfg.axes.kv_buffer_device,
        prefix_caching=role == "decode" and cfg.axes.prefix_caching_d,
        permute_local_kv=role == "decode" and cfg.axes.permute_local_kv_d,
        **({} if cfg.device == "cpu" else {"max_num_seqs": None}),
    )
    ports = server_ports(alloc, tp)
    cmd = build_server_command(spec, ports, cfg.python, cfg.cpu_tuning)
    url = f"http://127.0.0.1:{ports.http}"
    sim = simulated_spec(cfg)
    argv, env, shown = (cmd.argv, cmd.env, cmd.shell()) if sim is None else standin(cmd, sim)
    proc = ManagedProcess(
        ProcessSpec(
            name=label or role,
            argv=argv,
            env={**env, RUN_TAG_ENV: str(logs_dir)},
            log_path=logs_dir / f"{label or role}.log",
            health_url=f"{url}/health",
            fatal_patterns=FATAL_LOG_PATTERNS + FATAL_PATTERNS,  # a handshake no retry can cure ends the run at once
            ready_timeout_s=cfg.ready_timeout_s,
        )
    )
    return Server(spec, proc, url, shown)


def simulated_spec(cfg: E2EConfig) -> str | None:
    """The simulated GPU box a GPU run is on (PD_HARNESS_SIMULATED_GPUS), None on a real one or on CPU. A value that
    names no box is None here: GPU discovery refuses it, with the reason, before anything is launched."""
    if cfg.device != "gpu":
        return None
    try:
        box = simulated_box(os.environ)
    except ValueError:
        return None
    return None if box is None or box.unreadable else box.spec


def standin(cmd: Command, spec: str) -> tuple[tuple[str, ...], dict[str, str], str]:
    """(argv, env, command as the report shows it) of the stand-in that serves a simulated box in vLLM's place: vLLM's
    own arguments and environment (its GPUs, its memory share), run by harness/gpu/standin.py. The report keeps
    vLLM's command line, with a note saying who served it."""
    python, flag, module, *args = cmd.argv
    assert (flag, module) == ("-m", API_SERVER_MODULE), cmd.argv[:3]
    path = cmd.env.get("PYTHONPATH") or os.environ.get("PYTHONPATH", "")
    env = {
        **cmd.env,
        "PYTHONPATH": os.pathsep.join(p for p in (str(REPO_ROOT), path) if p),
        STATE_ENV: str(box_state()),
    }
    note = f"  # served by a stand-in ({python} -m {STANDIN_MODULE}): simulated GPUs, {SIMULATED_ENV}={spec}"
    return (python, "-m", STANDIN_MODULE, *args), env, cmd.shell() + note


def make_proxy(
    python: str,
    alloc: PortAllocator,
    prefill_urls: list[str],
    decode_urls: list[str],
    logs_dir: Path,
    timeout_s: float,
    fault: str = "none",
    name: str = "proxy",
    fault_every: int = 1,
) -> tuple[ManagedProcess, str]:
    port = alloc.port()
    argv = [
        python,
        str(PROXY_SCRIPT),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        *prefill_urls,
        "--decode",
        *decode_urls,
        "--timeout",
        str(timeout_s),
        "--fault",
        fault,
    ]
    if fault_every != 1:
        argv += ["--fault-every", str(fault_every)]
    url = f"http://127.0.0.1:{port}"
    proc = ManagedProcess(
        ProcessSpec(
            name=name,
            argv=argv,
            env=with_no_track({RUN_TAG_ENV: str(logs_dir)}),
            log_path=logs_dir / f"{name}.log",
            health_url=f"{url}/health",
            ready_timeout_s=60,
        )
    )
    return proc, url
