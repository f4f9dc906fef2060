"""What a run launches: the model it serves, a vLLM server of a role, the proxy; each a managed process not yet
started."""

from __future__ import annotations

import datetime as dt
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from harness.checks.classify import FATAL_PATTERNS, REPEATED_FATAL
from harness.checks.transport import PROTO_INFO_ENV
from harness.core.errors import ConfigError
from harness.core.files import claim_run_dir
from harness.core.notrack import with_no_track
from harness.core.paths import REPO_ROOT
from harness.gpu.plan import CUDA_DEVICE_ORDER, ServerPlacement
from harness.hosts.placement import LOCAL, RAY_STOP_GRACE_S, Host
from harness.run.config import E2EConfig
from harness.serve.axes import EAGLE_PLACEHOLDER, MODEL_PLACEHOLDER
from harness.serve.ports import PortAllocator, Ports, ServerPorts, server_ports
from harness.serve.procs import RUN_TAG_ENV, ManagedProcess, ProcessSpec
from harness.serve.vllm_cmd import (
    API_SERVER_MODULE,
    FATAL_LOG_PATTERNS,
    ROLES,
    Command,
    ServerSpec,
    build_server_command,
)
from harness.simbox.box import SIMULATED_ENV, simulated_box
from harness.simbox.claims import STATE_ENV, box_state

PROXY_SCRIPT = REPO_ROOT / "toy_proxy_server.py"
STANDIN_MODULE = "harness.simbox.standin"  # what serves a simulated GPU box in vLLM's place


@dataclass
class Server:
    spec: ServerSpec
    proc: ManagedProcess
    url: str
    command: str
    # the followers of a TP group across nodes (started headless on D's further hosts): (name, process, command)
    followers: tuple[tuple[str, ManagedProcess, str], ...] = ()


def new_run_dir(cfg: E2EConfig) -> Path:
    """The run's folder: the one given, which must be new or empty (ConfigError: an earlier run's logs would mix with
    this run's; the CLI's --overwrite-run-dir empties it first), else a new one under the runs root."""
    if cfg.run_dir is not None:
        claim_run_dir(Path(cfg.run_dir))
        return Path(cfg.run_dir)
    stamp = dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    return cfg.runs_root / f"{stamp}-p{cfg.tp_p}d{cfg.tp_d}-{os.getpid()}"


def resolve_model(cfg: E2EConfig) -> tuple[str, str]:
    """(model path or hub id, served model name). Accuracy runs on CPU use the tiny model trained on the offline
    task."""
    if cfg.model is None and cfg.device == "gpu":  # a matrix's shared config names its models per pair
        raise ConfigError("--model is required on GPU: the tiny local models are for CPU runs")
    if cfg.model is None and cfg.accuracy is not None:
        from harness.models.trained import TRAINED_NAME, ensure_trained_model

        return str(ensure_trained_model()), TRAINED_NAME
    if cfg.model is None:
        from harness.models.tiny import ensure_tiny_model

        path = ensure_tiny_model()
        return str(path), "tiny-llama"
    p = Path(cfg.model)
    return (str(p.resolve()), p.name) if p.exists() else (cfg.model, cfg.model)


def speculative_for(config: str | None, model: str) -> str | None:
    """The speculative config a server gets: ``{model}`` stands for the served model's path (a draft that equals the
    target: greedy acceptance near 100 %, so any drop is P/D's), ``{eagle}`` for a tiny EAGLE head built beside it
    (models/eagle.py): paths a matrix entry cannot name before they are built."""
    if config is None:
        return None
    if EAGLE_PLACEHOLDER in config:
        from harness.models.eagle import ensure_eagle_head

        try:
            head = ensure_eagle_head(Path(model))
        except (OSError, ValueError) as e:
            raise ConfigError(
                f"speculative_config names {EAGLE_PLACEHOLDER}, but no EAGLE head for {model}: {e}"
            ) from None
        config = config.replace(EAGLE_PLACEHOLDER, str(head))
    return config.replace(MODEL_PLACEHOLDER, model)


@dataclass(frozen=True)
class WantedServer:
    """What one server of a run is asked to be; the run's own parts (its config, port allocator and logs folder) are
    make_server's other arguments.

    ``label`` names the process and its log (default: the role); ``kv_load_failure_policy`` other than
    "fail" is for tests that must see the harness refuse a silently recomputed transfer. ``placement``
    (GPU): the server's GPUs and memory share from the run's GPU plan (which holds a given --gpu-memory-utilization).
    ``num_blocks``: its KV pool (None: vLLM's own); ``log_requests``: vLLM logs each request (a load phase's aborts
    are read from it)."""

    role: str  # prefill / decode / baseline
    tp: int
    model: str  # path or hub id
    served_name: str
    block_size: int | None
    cpu_bind: str | None  # CPU: the cores of its ranks, separated by "|" in rank order
    kv_layout: str | None = None
    label: str | None = None
    kv_load_failure_policy: str = "fail"
    placement: ServerPlacement | None = None
    num_blocks: int | None = None
    log_requests: bool = False

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"a server's role must be one of {', '.join(ROLES)}, got {self.role!r}")
        if self.tp < 1:
            raise ConfigError(f"a server's tp must be >= 1, got {self.tp}")

    @property
    def name(self) -> str:
        """The name of its process and log."""
        return self.label or self.role


def make_server(cfg: E2EConfig, alloc: Ports, want: WantedServer, logs_dir: Path) -> Server:
    """A not-yet-started vLLM server as ``want`` asks, with ports from ``alloc`` and its log in ``logs_dir``."""
    role, tp = want.role, want.tp
    host = cfg.hosts.for_role(role)
    nodes = (host, *cfg.hosts.decode_nodes) if role == "decode" else (host,)
    binds = _node_binds(want.cpu_bind, len(nodes))
    spec = replace(
        _spec(cfg, want, binds[0]),
        extra_env=(
            *((("CUDA_DEVICE_ORDER", CUDA_DEVICE_ORDER),) if want.placement else ()),
            *host_env(cfg, host, role),
        ),
        num_blocks=want.num_blocks,
        log_requests=want.log_requests,
        kv_digest_dir=str(kv_digest_dir(logs_dir, want.name)) if cfg.kv_digest and role != "baseline" else None,
    )
    if len(nodes) > 1:  # rank 0's torch.distributed address, from our allocator like every port
        spec = replace(spec, nodes=len(nodes), master=(host.address, alloc.port()))
    dp = cfg.axes.dp_d if role != "prefill" else 1
    if dp > 1:  # vLLM's DP coordinator listens here; the engines' own ports come from VLLM_PORT's block
        spec = replace(spec, data_parallel_size=dp, dp_rpc_port=alloc.port())
    # a side channel port per DP engine and room for every rank's ports (P's pipeline stages each a TP group)
    ports = server_ports(alloc, cfg.ranks(role) // len(nodes))
    url = host.url(ports.http)
    proc, shown = _process(cfg, spec, ports, host, want.name, logs_dir, f"{url}/health")
    followers = []
    for rank, node in enumerate(nodes[1:], start=1):
        f_spec = replace(
            spec, node_rank=rank, host_ip=node.address, cpu_bind=binds[rank], extra_env=host_env(cfg, node, role)
        )
        f_name = f"{want.name}-node{rank}"
        # no health of its own: D's API on rank 0 answers only once every node has joined
        f_proc, f_shown = _process(cfg, f_spec, server_ports(alloc, tp // len(nodes)), node, f_name, logs_dir, None)
        followers.append((f_name, f_proc, f_shown))
    return Server(spec, proc, url, shown, tuple(followers))


def kv_digest_dir(logs_dir: Path, name: str) -> Path:
    """Where a server's KV digests go: beside its run's logs (``<run>/kv_digest/<name>``)."""
    return logs_dir.parent / "kv_digest" / name


def _node_binds(cpu_bind: str | None, nodes: int) -> list[str | None]:
    """Each node's share of a server's CPU binding (ranks separated by "|", in rank order)."""
    if cpu_bind is None or nodes == 1:
        return [cpu_bind] * nodes
    ranks = cpu_bind.split("|")
    per = len(ranks) // nodes
    return ["|".join(ranks[i * per : (i + 1) * per]) for i in range(nodes)]


def _spec(cfg: E2EConfig, want: WantedServer, cpu_bind: str | None) -> ServerSpec:
    """The vLLM server of ``want`` under the run's settings; ``cpu_bind``: its first node's share of the binding."""
    role, model, placement = want.role, want.model, want.placement
    return ServerSpec(
        role=role,  # type: ignore[arg-type]
        model=model,
        served_model_name=want.served_name,
        tp=want.tp,
        device=cfg.device,
        block_size=want.block_size,
        kv_layout=want.kv_layout,
        cpu_bind=cpu_bind,
        kv_lease_s=cfg.lease_s,
        # the plan's share: the run's own value where one was given, checked against colocation by the plan
        gpu_memory_utilization=placement.gpu_memory_utilization if placement else cfg.gpu_memory_utilization,
        gpus=placement.gpus if placement else (),
        seed=cfg.seed,
        kv_load_failure_policy=want.kv_load_failure_policy,
        fault_kv_scale=cfg.decode_kv_fault if role == "decode" else None,
        fault_swap_heads=cfg.decode_swap_heads and role == "decode",
        max_model_len=cfg.model_len,
        dtype=cfg.dtype or ("float32" if cfg.device == "cpu" else None),
        enforce_eager=cfg.enforce_eager if cfg.enforce_eager is not None else cfg.device == "cpu",
        kv_cache_dtype=cfg.axes.kv_cache_dtype,
        async_scheduling=cfg.axes.async_scheduling,
        attention_backend=cfg.axes.attention_backend,
        speculative_config=speculative_for(cfg.axes.speculative_config_for(role), model),
        compilation_config=cfg.axes.compilation_config,
        pipeline_parallel_size=cfg.axes.pipeline_parallel_size_p if role == "prefill" else None,
        decode_context_parallel_size=cfg.axes.decode_context_parallel_size_d if role != "prefill" else None,
        kv_offload_bytes=cfg.axes.kv_offload_bytes if role != "baseline" else None,
        enable_expert_parallel=role != "prefill" and cfg.axes.expert_parallel_d,
        max_num_batched_tokens=cfg.axes.max_num_batched_tokens_p if role == "prefill" else None,
        kv_buffer_device=cfg.axes.kv_buffer_device,
        prefix_caching=role == "decode" and cfg.axes.prefix_caching_d,
        permute_local_kv=role == "decode" and cfg.axes.permute_local_kv_d,
        host_ip=cfg.hosts.for_role(role).address,
        max_num_seqs=ServerSpec.max_num_seqs if cfg.device == "cpu" else None,  # GPU: vLLM's own default
    )


def _process(
    cfg: E2EConfig, spec: ServerSpec, ports: ServerPorts, host: Host, name: str, logs_dir: Path, health: str | None
) -> tuple[ManagedProcess, str]:
    """The managed process of one server (or node of one) and its command as the report shows it."""
    cmd = build_server_command(spec, ports, cfg.python, cfg.cpu_tuning)
    sim = simulated_spec(cfg)
    argv, env, shown = (cmd.argv, cmd.env, cmd.shell()) if sim is None else standin(cmd, sim)
    env = {**env, RUN_TAG_ENV: str(logs_dir)}
    if host.netns or host.ray:
        argv = host.wrap(argv, env_names=tuple(env), name=name)
        shown = Command(argv, env).shell()
    proc = _managed(
        host,
        name,
        argv,
        env,
        logs_dir,
        health,
        fatal_patterns=FATAL_LOG_PATTERNS + FATAL_PATTERNS,  # a handshake no retry can cure ends the run at once
        repeated_fatal=REPEATED_FATAL,
        ready_timeout_s=cfg.ready_timeout_s,
    )
    return proc, shown


def _managed(
    host: Host, name: str, argv: Sequence[str], env: dict[str, str], logs_dir: Path, health: str | None, **more: Any
) -> ManagedProcess:
    """The process ``name`` on ``host``, its log ``<logs_dir>/<name>.log``; on a Ray node its launcher's stop covers
    the server's own stop there and Ray's round trips."""
    if host.ray:
        more["stop_grace_s"] = RAY_STOP_GRACE_S
    spec = ProcessSpec(name=name, argv=argv, env=env, log_path=logs_dir / f"{name}.log", health_url=health, **more)
    return ManagedProcess(spec)


def host_env(cfg: E2EConfig, host: Host, role: str = "decode") -> tuple[tuple[str, str], ...]:
    """What a server gets from its host: the host's own settings and, on P and D, UCX's protocol tables in its log
    (the evidence of which transport carried the KV, checks/transport.py: between hosts the network check, on one
    host the record of what UCX chose, e.g. cuda_ipc or a slower copy on a GPU box)."""
    proto = tuple(PROTO_INFO_ENV.items()) if role != "baseline" or cfg.hosts.spans_hosts else ()
    return (*host.env, *proto)


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
    own arguments and environment (its GPUs, its memory share), run by harness/simbox/standin.py. The report keeps
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
    host: Host = LOCAL,
    hold_dir: Path | None = None,
) -> tuple[ManagedProcess, str]:
    port = alloc.port()
    env = with_no_track({RUN_TAG_ENV: str(logs_dir)})
    argv = [
        *host.wrap([python], env_names=tuple(env), name=name),
        str(PROXY_SCRIPT),
        "--host",
        host.address,
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
    if hold_dir is not None:
        argv += ["--hold-dir", str(hold_dir)]
    url = host.url(port)
    # on a Ray node the launcher connects and places it first
    proc = _managed(host, name, argv, env, logs_dir, f"{url}/health", ready_timeout_s=180 if host.ray else 60)
    return proc, url
