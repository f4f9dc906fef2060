"""``python -m harness e2e``'s flags and the run config built from them: flags over upstream's env var names over
defaults (harness/run/config.py), ``validate()``d, and with ``preflight`` refused before launch when the run cannot work
here. harness/cli.py adds this parser to ``python -m harness`` and re-exports ``config_from_args``."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from harness.accuracy.settings import AccuracySettings
from harness.core.argtypes import HarnessArgumentParser, non_negative_int, positive, positive_int
from harness.core.errors import ConfigError
from harness.core.files import OVERWRITE_FLAG, run_dir_problem
from harness.envs.vllm_env import requested_versions
from harness.gpu.detect import default_device
from harness.hosts.faults import NET_FAULTS
from harness.hosts.placement import RunHosts
from harness.models.rules import DEVICES, KV_LAYOUTS, as_device
from harness.run.config import GPU_DEFAULT_MODEL, PROXY_FAULTS, AttachSettings, E2EConfig, env_defaults
from harness.serve.axes import KV_BUFFER_DEVICES, KV_CACHE_DTYPES, ServerAxes
from harness.serve.vllm_cmd import CpuTuning
from harness.workload.load import LoadSettings

PROG = "python -m harness"
E2E_HELP = "one P/D run against a non-disaggregated baseline"


def _e2e_servers_args(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("the servers: TP sizes, model and what each server runs with")
    g.add_argument("--tp-p", type=positive_int, help="prefill TP size (default: $PREFILLER_TP_SIZE or 1)")
    g.add_argument("--tp-d", type=positive_int, help="decode TP size (default: $DECODER_TP_SIZE or 1)")
    g.add_argument("--model", help="model path or hub id (default on CPU: the tiny local model)")
    g.add_argument("--device", choices=DEVICES, help="default: gpu if an NVIDIA GPU is present, else cpu")
    g.add_argument("--dtype", help="model dtype for every server (default: float32 on CPU, the model's own on GPU)")
    g.add_argument("--block-size-p", type=positive_int, help="default: $PREFILL_BLOCK_SIZE")
    g.add_argument("--block-size-d", type=positive_int, help="default: $DECODE_BLOCK_SIZE")
    g.add_argument("--kv-layout-d", choices=KV_LAYOUTS, help="default: $DECODER_KV_LAYOUT")
    g.add_argument("--gpu-memory-utilization", type=float, help="default: $GPU_MEMORY_UTILIZATION")
    g.add_argument(
        "--kv-cache-dtype", choices=KV_CACHE_DTYPES, help="every server's KV cache dtype (default: vLLM's auto)"
    )
    g.add_argument(
        "--prefix-caching-d", action="store_true", help="turn D's prefix cache on and run the prefix-cache scenarios"
    )
    g.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, help="default: vLLM's")
    g.add_argument(
        "--attention-backend", help="vLLM attention backend for every server, e.g. FLASH_ATTN (default: vLLM's)"
    )
    g.add_argument(
        "--kv-buffer-device", choices=KV_BUFFER_DEVICES, help="NIXL's KV buffer (default: cpu on CPU, cuda on GPU)"
    )
    g.add_argument(
        "--permute-local-kv-d",
        action="store_true",
        help="D permutes the HND blocks it receives into its NHD layout "
        "(vLLM's enable_permute_local_kv; with --kv-layout-d NHD)",
    )
    g.add_argument(
        "--speculative-config",
        help='vLLM --speculative-config (JSON, e.g. \'{"method":"ngram","num_speculative_tokens":2,'
        '"prompt_lookup_max":3}\') for every server, the baseline included',
    )
    g.add_argument(
        "--speculative-tokens-p",
        type=positive_int,
        help="P's num_speculative_tokens in --speculative-config (D and the baseline keep the config's; upstream's "
        "P/D spec-decode test gives P 1)",
    )
    g.add_argument(
        "--compilation-config",
        help='vLLM --compilation-config (JSON, e.g. \'{"custom_ops":["-rotary_embedding"]}\') for every server, '
        "the baseline included",
    )
    g.add_argument(
        "--max-num-batched-tokens-p",
        type=positive_int,
        help="P's --max-num-batched-tokens: below a prompt's length P prefills in chunks",
    )
    g.add_argument(
        "--kv-pool-blocks-d",
        type=positive_int,
        help="D's KV pool in blocks (P and the baseline keep the run's): small, the load phase preempts on D",
    )
    g.add_argument("--pipeline-parallel-size-p", type=positive_int, help="P's --pipeline-parallel-size")
    g.add_argument(
        "--decode-context-parallel-size-d",
        type=positive_int,
        help="D's --decode-context-parallel-size (the baseline's too); must divide D's TP size",
    )
    g.add_argument(
        "--kv-offload-bytes",
        type=positive_int,
        help="P and D run NixlConnector in a MultiConnector beside an OffloadingConnector with this much host memory",
    )
    g.add_argument(
        "--data-parallel-size-d",
        type=positive_int,
        help="D's --data-parallel-size (the baseline's too): engines at D's TP each, every one must take transfers",
    )
    g.add_argument(
        "--expert-parallel-d",
        action="store_true",
        help="D's --enable-expert-parallel (the baseline's too): an MoE model's experts split over D's ranks",
    )
    g.add_argument("--max-model-len", type=positive_int, help="default: 512 on CPU, 2048 on GPU")
    g.add_argument(
        "--kv-pool-blocks",
        type=non_negative_int,
        help="KV blocks per server (default: twice a longest request's when the load phase runs, so blocks "
        "are reused; 0: vLLM's own)",
    )
    g.add_argument("--kv-lease", type=positive_int, help="P's KV lease in s (default: 120 on CPU, vLLM's on GPU)")
    g.add_argument(
        "--enforce-eager",
        action="store_true",
        default=None,
        help="no CUDA graphs or compilation on GPU (faster start-up; CPU always runs eager)",
    )
    g.add_argument("--python", help="interpreter that has vLLM (default: this one)")
    g.add_argument(
        "--vllm-version",
        help="serve from this vLLM version, installed under .venvs/ the first time "
        "(default: $VLLM_VERSION or the pinned one)",
    )
    g.add_argument("--ready-timeout", type=float, default=600.0, help="seconds for each server set to become ready")
    g.add_argument("--no-cpu-tuning", action="store_true", help="run NIXL with stock busy polling and core pinning")
    g.add_argument(
        "--nixl-progress-delay-us", type=int, default=1000, help="NIXL progress-thread delay under CPU tuning"
    )


def _e2e_where_args(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("where the run goes: its folder, its hosts, servers started elsewhere (attach mode)")
    g.add_argument(
        "--run-dir",
        type=Path,
        help="where logs and the report go, a new or empty folder (default: runs/<timestamp>-pPdD)",
    )
    g.add_argument(
        OVERWRITE_FLAG,
        action="store_true",
        help="--run-dir may hold an earlier run: it is emptied first (only a run folder: report.json or logs/)",
    )
    g.add_argument(
        "--hosts",
        type=Path,
        metavar="FILE",
        help="a hosts file placing P, D, the proxy and the baseline on hosts with their own addresses "
        "(docs/multi-host.md; default: all here on 127.0.0.1)",
    )
    g.add_argument(
        "--prefill-url",
        help="attach mode: comma-separated URLs of prefill servers started elsewhere (needs --decode-url)",
    )
    g.add_argument("--decode-url", help="attach mode: comma-separated URLs of decode servers started elsewhere")
    g.add_argument(
        "--baseline-url", help="attach mode: a non-disaggregated server started elsewhere (default: launch one here)"
    )
    g.add_argument(
        "--health-grace",
        type=positive(float),
        metavar="SECONDS",
        help="attach mode: an attached server that answers no /health for this long is dead; until then it is "
        "unresponsive, and the run goes on (default: 30)",
    )
    g.add_argument(
        "--attached-kv-digest",
        metavar="DIR",
        help="attach mode: the folder the attached P and D write KV digest records to (started with the hook: "
        "docs/kv-digest.md#attach-mode); the records this run's requests add are compared",
    )


def _e2e_workload_args(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("what is sent and how it is judged")
    g.add_argument("--max-tokens", type=positive_int, default=16)
    g.add_argument(
        "--prompts",
        help="only these of the sequential prompts, comma-separated ids (e.g. p01-w2; "
        "default: all; a shrink narrows a failure to one)",
    )
    g.add_argument("--request-timeout", type=float, default=180.0)
    g.add_argument(
        "--fresh-baseline",
        action="store_true",
        help="compute the baseline again instead of reusing cached answers (the new ones are cached)",
    )
    g.add_argument(
        "--logprob-threshold",
        type=float,
        help="largest |logprob difference| of a chosen token against the baseline "
        "(default: the device's, see docs/load.md)",
    )
    g.add_argument(
        "--no-kv-digest",
        action="store_true",
        help="do not digest P's and D's KV (the exact check kv_digest_match, docs/kv-digest.md); the report says so",
    )
    g.add_argument(
        "--no-baseline",
        action="store_true",
        help="start no baseline server: the KV digest alone judges D's KV (outputs are not compared; the "
        "sequential prompts only, so with --load-requests 0); about half the server start-ups of a run",
    )
    g.add_argument(
        "--load-requests",
        type=non_negative_int,
        default=LoadSettings.requests,
        help="requests of the load phase (default %(default)s; 0: no load phase)",
    )
    g.add_argument(
        "--load-concurrency", type=positive_int, default=LoadSettings.concurrency, help="default %(default)s"
    )
    g.add_argument(
        "--load-abort-every",
        type=non_negative_int,
        default=LoadSettings.abort_every,
        help="the client cancels every n-th load request, alternately while P prefills and mid-decode "
        "(default %(default)s; 0: none)",
    )
    g.add_argument(
        "--accuracy",
        action="store_true",
        help="also run lm-eval through the proxy and against the baseline "
        "(on CPU: the tiny model trained on the offline task)",
    )
    g.add_argument(
        "--accuracy-task", help="lm-eval task (default: gsm8k_offline for a local model, gsm8k for a hub model)"
    )
    g.add_argument("--accuracy-limit", type=positive_int, help="samples of the test split (default: all)")
    g.add_argument("--num-fewshot", type=int, help="default: the task's")
    g.add_argument("--lm-eval-concurrency", type=positive_int, default=2)


def _e2e_faults_args(e: argparse.ArgumentParser) -> None:
    g = e.add_argument_group("fault injection (each fault run must fail, and shows that its fault fired)")
    g.add_argument(
        "--proxy-fault",
        choices=PROXY_FAULTS,
        default="none",
        help="fault injection: corrupt-block-ids hands D wrong remote block ids, no-remote-decode skips the "
        "transfer (the run must fail either way)",
    )
    g.add_argument(
        "--proxy-fault-every", type=positive_int, default=1, help="apply --proxy-fault to every n-th request only"
    )
    g.add_argument(
        "--decode-kv-fault",
        type=float,
        metavar="FACTOR",
        help="fault injection: D multiplies the KV it received for the first layer by FACTOR (e.g. 1.05: "
        "logprobs move, greedy tokens mostly do not); the run must fail",
    )
    g.add_argument(
        "--decode-swap-heads-fault",
        action="store_true",
        help="fault injection: D swaps the first two KV heads it holds in every block it received (a wrong head "
        "slice); needs two KV heads per D rank; the run must fail, kv_digest_match naming the head D holds",
    )
    g.add_argument(
        "--net-fault",
        choices=NET_FAULTS,
        default="none",
        help="fault injection between hosts (P on a namespace host of its own; docs/multi-host.md): p-link-down "
        "cuts P's host off while a request is between its hops; side-channel-blocked drops packets to P's NIXL "
        "side channel before the first request",
    )


def add_e2e_parser(sub) -> argparse.ArgumentParser:
    """The ``e2e`` subcommand and its flags, on ``sub`` (``python -m harness``'s subparsers)."""
    e = sub.add_parser("e2e", help=E2E_HELP)
    for add in (_e2e_servers_args, _e2e_where_args, _e2e_workload_args, _e2e_faults_args):
        add(e)
    return e


def e2e_parser() -> argparse.ArgumentParser:
    """``python -m harness`` with its ``e2e`` subcommand alone: ``e2e ...`` arguments parse as the full command line
    parses them, without importing every other subcommand."""
    ap = HarnessArgumentParser(prog=PROG)
    add_e2e_parser(ap.add_subparsers(dest="cmd", required=True))
    return ap


def config_from_args(
    a: argparse.Namespace, env=None, preflight: bool = False, attached: AttachSettings | None = None
) -> E2EConfig:
    """The run's config from flags over env defaults. ``preflight``: also refuse a run that cannot work here
    (harness/run/preflight.py: the model's files, TP vs heads, block sizes, CPU cores), before any vLLM environment is
    installed. ``attached`` (attach mode, see ``attach_config``): the model, device, dtype and max_model_len taken from
    the attached servers (this host's own device is then no default); its preflight is the local baseline's."""
    defaults = env_defaults(os.environ if env is None else env)

    def pick(name: str, fallback=None):
        v = getattr(a, name)
        return v if v is not None else defaults.get(name, fallback)

    device = attached.device if attached else (a.device or default_device())
    model = _model(a, attached, device)
    python, version = _python_and_version(a, env)
    cfg = _e2e_config(a, attached, pick, model, device, python)
    return _refused_or_installed(cfg, a, attached, preflight, version, device)


def _model(a: argparse.Namespace, attached: AttachSettings | None, device: str) -> str | None:
    """The model: the attached D's, else --model, else the GPU default (None on CPU: the tiny local model)."""
    if attached is not None:
        return attached.model
    return a.model if a.model is not None else (GPU_DEFAULT_MODEL if device == "gpu" else None)


def _python_and_version(a: argparse.Namespace, env) -> tuple[str, list[str]]:
    """The serving interpreter (--python, else this one) and the vLLM version asked for (--vllm-version or the
    environment's), refusing a --python that does not run, both at once, or more than one version."""
    import sys as _sys

    python = a.python or _sys.executable
    if a.python and not _runnable(a.python):
        raise ConfigError(f"--python {a.python}: no such executable (the interpreter that has vLLM)")
    version = requested_versions(a.vllm_version, env)
    if version:
        if a.python:
            raise ConfigError("give --python or --vllm-version, not both")
        if len(version) != 1:
            raise ConfigError("e2e runs one vLLM version at a time")
    return python, version


def _e2e_config(
    a: argparse.Namespace, attached: AttachSettings | None, pick, model: str | None, device: str, python: str
) -> E2EConfig:
    """The E2EConfig the flags (and ``pick``'s env defaults) describe, validated as it is built."""
    tuning = CpuTuning(enabled=not a.no_cpu_tuning, progress_thread_delay_us=a.nixl_progress_delay_us)
    return E2EConfig(
        **_tp_and_health(a, attached, pick),
        model=model,
        device=as_device(device),
        block_size_p=pick("block_size_p"),
        block_size_d=pick("block_size_d"),
        kv_layout_d=pick("kv_layout_d"),
        gpu_memory_utilization=pick("gpu_memory_utilization"),
        run_dir=a.run_dir,
        python=python,
        cpu_tuning=tuning,
        max_tokens=a.max_tokens,
        prompt_ids=tuple(x for x in a.prompts.split(",") if x) if a.prompts is not None else None,
        ready_timeout_s=a.ready_timeout,
        request_timeout_s=a.request_timeout,
        kv_lease_s=a.kv_lease,
        accuracy=_accuracy(a),
        proxy_fault=a.proxy_fault,
        proxy_fault_every=a.proxy_fault_every,
        load=LoadSettings(requests=a.load_requests, concurrency=a.load_concurrency, abort_every=a.load_abort_every),
        max_model_len=attached.max_model_len if attached else a.max_model_len,
        kv_pool_blocks=a.kv_pool_blocks,
        logprob_threshold=a.logprob_threshold,
        dtype=attached.dtype if attached else a.dtype,
        decode_kv_fault=a.decode_kv_fault,
        decode_swap_heads=a.decode_swap_heads_fault,
        kv_digest=not a.no_kv_digest,
        baseline=not a.no_baseline,
        enforce_eager=a.enforce_eager,
        fresh_baseline=a.fresh_baseline,
        hosts=_hosts(a.hosts, attached is not None),
        net_fault=_net_fault(a.net_fault),
        axes=_axes(a),
    )


def _axes(a: argparse.Namespace) -> ServerAxes:
    """The edge-case axes' flags (serve/axes.py)."""
    return ServerAxes(
        kv_cache_dtype=a.kv_cache_dtype,
        prefix_caching_d=a.prefix_caching_d,
        async_scheduling=a.async_scheduling,
        attention_backend=a.attention_backend,
        kv_buffer_device=a.kv_buffer_device,
        permute_local_kv_d=a.permute_local_kv_d,
        speculative_config=a.speculative_config,
        speculative_tokens_p=a.speculative_tokens_p,
        max_num_batched_tokens_p=a.max_num_batched_tokens_p,
        compilation_config=a.compilation_config,
        data_parallel_size_d=a.data_parallel_size_d,
        kv_pool_blocks_d=a.kv_pool_blocks_d,
        pipeline_parallel_size_p=a.pipeline_parallel_size_p,
        decode_context_parallel_size_d=a.decode_context_parallel_size_d,
        kv_offload_bytes=a.kv_offload_bytes,
        expert_parallel_d=a.expert_parallel_d,
    )


def _refused_or_installed(
    cfg: E2EConfig,
    a: argparse.Namespace,
    attached: AttachSettings | None,
    preflight: bool,
    version: list[str],
    device: str,
) -> E2EConfig:
    """Refuse a reused run folder and (``preflight``) a run that cannot work here, the context fitted to the prompts
    first; then the vLLM environment asked for is installed and its interpreter serves."""
    from dataclasses import replace

    if cfg.run_dir is not None:  # refused before anything is installed, launched or written
        problem = run_dir_problem(Path(cfg.run_dir), bool(getattr(a, "overwrite_run_dir", False)))
        if problem:
            raise ConfigError(problem)
    if preflight and attached is None:  # the context holds the prompts in the served model's tokens (attach: theirs)
        from harness.run.prompt_fit import fit_model_len

        cfg = fit_model_len(cfg)
    if preflight:
        _preflight(cfg, attached, version[0] if version else None)
    if version:
        from harness.envs.vllm_env import EnvSetupFailed, ensure_env

        try:
            cfg = replace(cfg, python=str(ensure_env(device, version[0], lm_eval=cfg.accuracy is not None)))
        except EnvSetupFailed as e:
            raise ConfigError(str(e)) from None
    return cfg


def _tp_and_health(a: argparse.Namespace, attached: AttachSettings | None, pick) -> dict:
    """TP sizes and the health grace. Attach mode: the TP sizes given or served, and a default standing in for one
    that is not known (``tp_unknown``, never shown as a fact)."""
    grace = getattr(a, "health_grace", None)
    if grace is not None and attached is None:
        raise ConfigError("--health-grace is for attach mode (--prefill-url/--decode-url)")
    out: dict = {"tp_p": pick("tp_p", 1), "tp_d": pick("tp_d", 1)}
    if attached is not None:
        out.update(tp_p=attached.tp_p or out["tp_p"], tp_d=attached.tp_d or out["tp_d"], tp_unknown=attached.tp_unknown)
    if grace is not None:
        out["health_grace_s"] = grace
    return out


def _accuracy(a: argparse.Namespace) -> AccuracySettings | None:
    """The lm-eval phase's settings where any of its flags is given; None: no accuracy phase."""
    if not (a.accuracy or a.accuracy_task or a.accuracy_limit or a.num_fewshot is not None):
        return None
    return AccuracySettings(  # refuses what lm-eval cannot take, naming the flag
        task=a.accuracy_task,
        limit=a.accuracy_limit,
        num_fewshot=a.num_fewshot,
        num_concurrent=a.lm_eval_concurrency,
        request_timeout_s=a.request_timeout,
    )


def _preflight(cfg: E2EConfig, attached: AttachSettings | None, version: str | None) -> None:
    """Refuse a run that cannot work here before anything is installed or started (harness/run/preflight.py)."""
    if attached is not None:
        from harness.run.preflight import check_attached

        check_attached(cfg, attached.baseline_here)  # P and D run elsewhere with their own TP sizes
        return
    from harness.run.preflight import check_config

    check_config(cfg, vllm_version=version)
    if cfg.device == "gpu":
        from harness.run.preflight import check_gpus

        check_gpus(cfg)


def _net_fault(name: str) -> str:
    import shutil

    if name == "side-channel-blocked" and shutil.which("iptables") is None:
        raise ConfigError("--net-fault side-channel-blocked needs iptables (Debian: apt-get install iptables)")
    return name


def _hosts(path: Path | None, attach: bool) -> RunHosts:
    if path is None:
        return RunHosts()
    if attach:
        raise ConfigError("--hosts places servers this harness launches; attached servers are already placed")
    from harness.hosts.netns import hosts_problem
    from harness.hosts.placement import hosts_file, hosts_from_dict

    data, resolve = hosts_file(path), None
    if data.get("ray") is not None:  # a Ray cluster's nodes: harness/cluster, above hosts
        from harness.cluster.placement import RayNodes

        resolve = RayNodes()
    hosts = hosts_from_dict(data, where=str(path), resolve=resolve)
    problem = hosts_problem(hosts)
    if problem:
        raise ConfigError(f"{path}: {problem}")
    return hosts


def _runnable(program: str) -> bool:
    """A path to an executable file, or a name found on PATH."""
    import shutil

    if "/" not in program:
        return shutil.which(program) is not None
    return os.path.isfile(program) and os.access(program, os.X_OK)
