"""Run configuration: CLI flags over upstream's env var names over defaults."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from harness.accuracy.settings import AccuracySettings
from harness.core.errors import ConfigError
from harness.core.paths import RUNS_ROOT
from harness.hosts.faults import NEEDS_HOLD, NET_FAULTS
from harness.hosts.placement import RunHosts
from harness.models.rules import (
    DEVICES,
    KV_LAYOUTS,
    VLLM_DEFAULT_BLOCK_SIZE,
    Device,
    KvLayout,
    as_device,
    block_sizes_problem,
    layout_problem,
)
from harness.render.run_page import tp_text
from harness.serve.axes import ServerAxes
from harness.serve.servers import ATTACHED_HEALTH_GRACE_S, Attach, Served
from harness.serve.vllm_cmd import CpuTuning
from harness.workload.load import LoadSettings
from harness.workload.prompts import prompt_set

TP_UNKNOWN = "unknown (not served)"  # attach mode: a TP size neither served nor given
# |Δ logprob| of a chosen token between P/D and the baseline that noise cannot explain (docs/load.md: how measured).
LOGPROB_THRESHOLD = {"cpu": 1e-3, "gpu": 1.5}
# An fp8 KV cache keeps 3 mantissa bits, so P's float32 arithmetic at its own TP (5.5e-6 from the baseline's at D's TP)
# flips roundings: measured on CPU up to 3.6e-3 (P1->D2, 204 requests); a 2 % KV fault moves 0.05 to 0.29.
FP8_KV_LOGPROB_THRESHOLD = 2e-2

# Upstream's accuracy-test scripts read these; we accept them as defaults.
UPSTREAM_ENV = {
    "tp_p": "PREFILLER_TP_SIZE",
    "tp_d": "DECODER_TP_SIZE",
    "block_size_p": "PREFILL_BLOCK_SIZE",
    "block_size_d": "DECODE_BLOCK_SIZE",
    "kv_layout_d": "DECODER_KV_LAYOUT",
    "gpu_memory_utilization": "GPU_MEMORY_UTILIZATION",
}


# No --model on a GPU: the reported case's model (vLLM issue #45330: K=4, so P2->D8 is regime B). Servers run with
# HF_HUB_OFFLINE=1, so it must be in the Hugging Face cache already.
GPU_DEFAULT_MODEL = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"

PROXY_FAULTS = (
    "none",
    "corrupt-block-ids",
    "wrong-engine-id",
    "no-remote-decode",
)  # what toy_proxy_server.py --fault accepts by hand
HARNESS_PROXY_FAULTS = ("hold-between-hops",)  # what the harness sets itself (--net-fault), never by hand


@dataclass(frozen=True)
class Bound:
    """A numeric setting's allowed range, declared once on its field: the CLI, the Makefile's variables and YAML
    entries all build an E2EConfig, which checks every field against its bound when built (one line naming the
    flag)."""

    flag: str
    low: float | None = None  # None: no lower bound
    high: float | None = None
    low_open: bool = False  # True: the value must be > low (else >= low)

    def problem(self, name: str, value: object) -> str | None:
        if value is None or isinstance(value, bool):
            return None
        if not isinstance(value, int | float) or value != value or value in (float("inf"), float("-inf")):
            return f"{self.flag} ({name}) must be a finite number, got {value!r}"
        too_low = self.low is not None and (value <= self.low if self.low_open else value < self.low)
        if too_low or (self.high is not None and value > self.high):
            low = "" if self.low is None else f"{'>' if self.low_open else '>='} {self.low:g}"
            high = "" if self.high is None else f"<= {self.high:g}"
            return f"{self.flag} ({name}) must be {' and '.join(x for x in (low, high) if x)}, got {value!r}"
        return None


def bounded(
    default: Any, flag: str, low: float | None = None, high: float | None = None, low_open: bool = False
) -> Any:
    """A numeric field with its range declared on it (a value outside it cannot work: it would start servers and
    fail later, or never); E2EConfig checks it when built."""
    return field(default=default, metadata={"bound": Bound(flag, low, high, low_open)})


def bounds() -> dict[str, Bound]:
    """Each bounded field of E2EConfig and its range."""
    return {f.name: f.metadata["bound"] for f in fields(E2EConfig) if "bound" in f.metadata}


@dataclass(frozen=True)
class E2EConfig:
    tp_p: int = 1
    tp_d: int = 1
    model: str | None = None  # None: the tiny local model on CPU
    device: Device = "cpu"
    block_size_p: int | None = None
    block_size_d: int | None = None
    kv_layout_d: KvLayout | None = None
    gpu_memory_utilization: float | None = bounded(None, "--gpu-memory-utilization", 0, 1, low_open=True)
    run_dir: Path | None = None
    runs_root: Path = RUNS_ROOT
    python: str = sys.executable  # the interpreter that has vLLM
    cpu_tuning: CpuTuning = field(default_factory=CpuTuning)
    max_tokens: int = bounded(16, "--max-tokens", 1)
    logprobs: int = bounded(5, "logprobs", 1, 20)  # no flag: the top-k the comparison asks for
    ready_timeout_s: float = bounded(600.0, "--ready-timeout", 0, low_open=True)
    request_timeout_s: float = bounded(180.0, "--request-timeout", 0, low_open=True)
    # None: 120 s on CPU (handshakes are slow there), vLLM's default on GPU
    kv_lease_s: int | None = bounded(None, "--kv-lease", 1)
    seed: int = 0
    fresh_baseline: bool = False  # compute the baseline again instead of reading the disk cache (it still writes it)
    accuracy: AccuracySettings | None = None  # None: no lm-eval run
    proxy_fault: str = "none"  # fault injection for tests: "corrupt-block-ids" hands D wrong remote block ids
    proxy_fault_every: int = bounded(1, "--proxy-fault-every", 1)  # the fault hits every n-th request of the proxy
    load: LoadSettings = field(default_factory=LoadSettings)  # the load phase (requests=0: none)
    max_model_len: int | None = bounded(None, "--max-model-len", 1)  # None: 512 on CPU, 2048 on GPU
    # KV blocks per server; None: small when the load phase runs, 0: vLLM's default
    kv_pool_blocks: int | None = bounded(None, "--kv-pool-blocks", 0)
    # largest |Δ logprob| of a chosen token vs the baseline; None: the device's
    logprob_threshold: float | None = bounded(None, "--logprob-threshold", 0, low_open=True)
    dtype: str | None = None  # None: float32 on CPU, the model's own on GPU
    enforce_eager: bool | None = None  # None: eager on CPU, CUDA graphs and compilation on GPU
    # fault injection: D scales the received KV of one layer by this (the run must fail); it must stay finite in
    # fp16/bf16 (65504) so the digest, not a NaN, catches it
    decode_kv_fault: float | None = bounded(None, "--decode-kv-fault", 0, 100, low_open=True)
    decode_swap_heads: bool = False  # fault injection: D swaps the first two KV heads it received (the run must fail)
    kv_digest: bool = True  # P and D digest their KV (harness/serve/inject/); the check kv_digest_match
    # False: no baseline server; the KV digest alone judges D's KV (half the server starts: a transfer probe)
    baseline: bool = True
    axes: ServerAxes = field(default_factory=ServerAxes)  # the edge-case axes (KV dtype, D's prefix cache, ...)
    prompt_ids: tuple[str, ...] | None = None  # only these of the sequential prompts (None: all; a shrink narrows it)
    hosts: RunHosts = field(default_factory=RunHosts)  # the host of P, D, the proxy and the baseline (default: here)
    net_fault: str = "none"  # a network fault between hosts (harness/hosts/faults.py): "p-link-down"
    # attach mode: "tp_p"/"tp_d" whose TP neither the servers said nor a flag gave (the int above is then a default,
    # which the report never shows as a fact)
    tp_unknown: tuple[str, ...] = ()
    health_grace_s: float = ATTACHED_HEALTH_GRACE_S  # attach mode: silence on /health for this long is a death

    def __post_init__(self) -> None:
        self.validate()  # a config that exists is one that can run: built by the CLI, a YAML entry or replace()

    def validate(self) -> None:
        """Every field against its bound, then the rules across fields (one ConfigError line naming the flag)."""
        for name, bound in bounds().items():
            problem = bound.problem(name, getattr(self, name))
            if problem:
                raise ConfigError(problem)
        if self.cpu_tuning.progress_thread_delay_us < 0:
            raise ConfigError(
                f"--nixl-progress-delay-us must be >= 0, got {self.cpu_tuning.progress_thread_delay_us!r}"
            )
        for name in ("tp_p", "tp_d"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        self._validate_attach()
        as_device(self.device)
        for name in ("block_size_p", "block_size_d"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        blocks = block_sizes_problem(self.block_size_p, self.block_size_d)
        if blocks:
            raise ConfigError(blocks)
        layout = layout_problem(self.kv_layout_d)
        if layout:
            raise ConfigError(f"decode KV layout {layout}")
        if self.proxy_fault not in PROXY_FAULTS:
            raise ConfigError(f"proxy fault must be one of {', '.join(PROXY_FAULTS)}, got {self.proxy_fault!r}")
        if self.prompt_ids is not None:
            known = [p.id for p in prompt_set(self.seed)]
            unknown = [i for i in self.prompt_ids if i not in known]
            if unknown or not self.prompt_ids:
                raise ConfigError(
                    f"unknown prompt id(s) {', '.join(unknown) or '(none given)'} (known: {', '.join(known)})"
                )
        if self.net_fault not in NET_FAULTS:
            raise ConfigError(f"net fault must be one of {', '.join(NET_FAULTS)}, got {self.net_fault!r}")
        if self.net_fault != "none" and (self.hosts.prefill.netns is None or not self.hosts.spans_hosts):
            raise ConfigError(
                f"--net-fault {self.net_fault} cuts P's host off: P must be on a namespace host of its own"
            )
        if self.net_fault in NEEDS_HOLD and self.proxy_fault != "none":
            raise ConfigError("--net-fault and --proxy-fault both need the proxy's fault hook: give one")
        if self.hosts.on_ray and self.device == "gpu":  # the GPU plan is made for the machine the harness runs on
            raise ConfigError(
                "servers on Ray nodes run on CPU only so far: on GPU the plan would be this machine's, not the "
                "node's (run GPU entries as tasks with `matrix --ray`, or attach servers started on the nodes)"
            )
        nodes = 1 + len(self.hosts.decode_nodes)
        if (self.axes.dp_d > 1 or self.axes.pp_p > 1) and (nodes > 1 or self.device == "gpu"):
            raise ConfigError(  # the plans place TP ranks, not DP engines or pipeline stages
                "D's data parallelism and P's pipeline stages run on one CPU host so far: the GPU plan and D's nodes "
                "place TP ranks only"
            )
        if self.axes.expert_parallel_d and self.ranks("decode") < 2:
            raise ConfigError(
                "--expert-parallel-d needs D on more than one rank (--tp-d or --data-parallel-size-d > 1): on one rank "
                "every expert is local"
            )
        dcp = self.axes.decode_context_parallel_size_d
        if dcp is not None and self.tp_d % dcp:
            raise ConfigError(f"D's decode context parallel size {dcp} must divide D's TP size {self.tp_d}")
        if self.tp_d % nodes:
            raise ConfigError(f"D's TP size {self.tp_d} does not split evenly over its {nodes} nodes")
        try:
            self.load.validate()
            self.axes.validate()
        except ValueError as e:
            raise ConfigError(str(e)) from None
        if self.axes.kv_pool_blocks_d is not None and not self.load.enabled:
            raise ConfigError(
                "--kv-pool-blocks-d needs the load phase (--load-requests > 0): its concurrent requests are what "
                "fills D's pool and preempts"
            )
        d_pool, bs_d = self.axes.kv_pool_blocks_d, self.block_sizes()[1] or VLLM_DEFAULT_BLOCK_SIZE
        if d_pool is not None and d_pool * bs_d < self.model_len:  # vLLM refuses to start below one longest request
            raise ConfigError(
                f"--kv-pool-blocks-d {d_pool} holds {d_pool * bs_d} tokens in blocks of {bs_d}, fewer than one request "
                f"of --max-model-len {self.model_len}: vLLM refuses to start; give >= {-(-self.model_len // bs_d)}"
            )
        if self.load.enabled and self.load.abort_max_tokens >= self.model_len:
            raise ConfigError(
                f"load abort_max_tokens {self.load.abort_max_tokens} leaves no room for a prompt "
                f"in {self.model_len} tokens"
            )

        self._validate_no_baseline()

    def _validate_no_baseline(self) -> None:
        """Without a baseline nothing compares outputs: only what the digest judges may run."""
        if self.baseline:
            return
        needs = [
            flag
            for flag, used in (
                ("--no-kv-digest", not self.kv_digest),
                ("--accuracy", self.accuracy is not None),
                ("--load-requests > 0", self.load.enabled),
                ("--prefix-caching-d", self.axes.prefix_caching_d),
            )
            if used
        ]
        if needs:
            raise ConfigError(
                f"--no-baseline leaves the KV digest as the run's only judge, so it cannot run with "
                f"{', '.join(needs)} (each of those compares with a baseline or turns the digest off)"
            )

    def _validate_attach(self) -> None:
        if set(self.tp_unknown) - {"tp_p", "tp_d"}:
            raise ConfigError(f"tp_unknown names tp_p or tp_d, got {self.tp_unknown!r}")
        if not self.health_grace_s > 0:
            raise ConfigError(f"health grace must be > 0 seconds, got {self.health_grace_s!r}")

    @property
    def logprob_limit(self) -> float:
        if self.logprob_threshold is not None:
            return self.logprob_threshold
        limit = LOGPROB_THRESHOLD[self.device]
        if (self.axes.kv_cache_dtype or "").startswith("fp8"):
            limit = max(limit, FP8_KV_LOGPROB_THRESHOLD)
        return limit

    def tp_label(self, name: str) -> str:
        """``name``'s (tp_p, tp_d) TP for people: "TP2", or "TP unknown (not served)"."""
        return tp_text(TP_UNKNOWN if name in self.tp_unknown else getattr(self, name))

    @property
    def model_len(self) -> int:
        return self.max_model_len or (512 if self.device == "cpu" else 2048)

    def pool_blocks(self, block_size: int | None, kv_cache_groups: int = 1) -> int | None:
        """KV blocks a server gets: twice a longest request's in each of the model's KV cache groups (layers of one
        attention kind), so the load phase must reuse blocks (None: vLLM's)."""
        if self.kv_pool_blocks == 0 or (self.kv_pool_blocks is None and not self.load.enabled):
            return None
        if self.kv_pool_blocks:
            return self.kv_pool_blocks
        return kv_cache_groups * 2 * -(-self.model_len // (block_size or VLLM_DEFAULT_BLOCK_SIZE))

    @property
    def lease_s(self) -> int | None:
        return self.kv_lease_s if self.kv_lease_s is not None else (120 if self.device == "cpu" else None)

    def ranks(self, role: str) -> int:
        """The worker ranks of a server of ``role``: its TP size, times D's DP ranks on D and the baseline (which
        serves D's settings); what its CPU binding and ports are planned for."""
        return self.tp_p * self.axes.pp_p if role == "prefill" else self.tp_d * self.axes.dp_d

    def block_sizes(self) -> tuple[int | None, int | None]:
        # vLLM's CPU attention needs a multiple of 32; pick it so prompts span several blocks.
        default = 32 if self.device == "cpu" else None
        return (self.block_size_p or default, self.block_size_d or self.block_size_p or default)

    def to_dict(self) -> dict:
        d = asdict(self)
        d["run_dir"] = str(self.run_dir) if self.run_dir else None
        d["runs_root"] = str(self.runs_root)
        d["block_size_p"], d["block_size_d"] = self.block_sizes()
        d["kv_lease_s"] = self.lease_s
        d["hosts"] = self.hosts.to_dict()
        for name in self.tp_unknown:  # a default is no fact: say that it is not known
            d[name] = TP_UNKNOWN
        return d


def env_defaults(env: Mapping[str, str] = os.environ) -> dict[str, object]:
    """Values from upstream's env var names; a bad value is an error naming the variable."""
    out: dict[str, object] = {}
    for key, var in UPSTREAM_ENV.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        if key == "kv_layout_d":
            if raw not in KV_LAYOUTS:
                raise ConfigError(f"{var}={raw!r} must be {' or '.join(KV_LAYOUTS)}")
            out[key] = raw
            continue
        try:
            value: float | int = float(raw) if key == "gpu_memory_utilization" else int(raw)
        except ValueError:
            raise ConfigError(f"{var}={raw!r} is not a valid number") from None
        if key == "gpu_memory_utilization" and not 0 < value <= 1:
            raise ConfigError(f"{var}={raw!r} must be in (0, 1]")
        if key != "gpu_memory_utilization" and value < 1:
            raise ConfigError(f"{var}={raw!r} must be a positive integer")
        out[key] = value
    return out


# Where vLLM 0.32.0 says its device and dtype: only /server_info, which it serves with VLLM_SERVER_DEV_MODE=1.
SERVER_INFO_HINT = (
    "vLLM says them only at /server_info, served with VLLM_SERVER_DEV_MODE=1 (its /metrics and /v1/models do not)"
)


@dataclass(frozen=True)
class AttachSettings:
    """What a run against attached servers takes from them: the model D serves, the device (thresholds, defaults, the
    local baseline's placement), the model dtype and max_model_len (the local baseline's), each with its source."""

    model: str
    device: Device
    dtype: str | None  # None: unknown; a baseline launched here then uses the device's default
    max_model_len: int | None  # None: unknown; the device's default
    baseline_here: bool  # no --baseline-url: the harness launches the baseline on this host
    sources: dict[str, str]
    tp_p: int | None = None  # None: unknown (not served, not given)
    tp_d: int | None = None

    @property
    def tp_unknown(self) -> tuple[str, ...]:
        return tuple(name for name in ("tp_p", "tp_d") if getattr(self, name) is None)


def on_this_host(url: str) -> bool:
    host = (urlparse(url).hostname or "").lower()
    return host in ("localhost", "::1") or host.startswith("127.")


def _one(values: dict[str, str], what: str) -> str | None:
    """The single value the servers report (url -> value), None if none does; ConfigError if they disagree."""
    seen = sorted(set(values.values()))
    if len(seen) > 1:
        raise ConfigError(
            f"the attached servers report different {what}s: "
            + ", ".join(f"{u} {v}" for u, v in sorted(values.items()))
        )
    return seen[0] if seen else None


def _attach_device(served: Sequence[Served], flag: str | None, host_device: Callable[[], str]) -> tuple[Device, str]:
    reported = _one({s.url: s.device for s in served if s.device}, "device")
    if reported is not None and reported not in DEVICES:
        raise ConfigError(f"the attached servers run on {reported}; this harness compares runs on cpu or gpu")
    if flag is not None:
        if reported is not None and reported != flag:
            raise ConfigError(f"--device {flag}, but the attached servers report device {reported}")
        return as_device(flag), "--device"
    if reported is not None:
        return as_device(reported), "the servers' /server_info"
    # Servers on this host share its hardware: the host's default is the one a run launching them would take.
    if served and all(on_this_host(s.url) for s in served):
        return as_device(host_device()), "this host (every attached server is on it)"
    raise ConfigError(
        f"attach mode: cannot tell which device the attached servers run on ({SERVER_INFO_HINT}); "
        "give --device cpu or --device gpu"
    )


TP_HINT = "vLLM 0.32.0 names its TP size only at /server_info, served with VLLM_SERVER_DEV_MODE=1"
TP_ROLES = {"tp_p": ("prefill", "--tp-p"), "tp_d": ("decode", "--tp-d")}


def _attach_tp(attach: Attach, name: str, given: tuple[int, str] | None) -> tuple[int | None, str]:
    """(the TP size of ``name``'s servers, where it came from): a flag or upstream's variable (``given``: value and
    its name), else what the servers' /server_info said, else None: unknown. A given size they contradict, or servers
    of one role that disagree, are a ConfigError."""
    role, flag = TP_ROLES[name]
    urls = {u.rstrip("/") for u in (attach.prefill_urls if role == "prefill" else attach.decode_urls)}
    served = _one({s.url: str(s.tp) for s in attach.served if s.url in urls and s.tp}, f"{role} TP size")
    if given is not None:
        if served is not None and int(served) != given[0]:
            raise ConfigError(f"{given[1]} {given[0]}, but the attached {role} servers serve TP {served}")
        return given[0], given[1]
    if served is not None:
        return int(served), f"the {role} servers' /server_info"
    return None, f"{TP_UNKNOWN}: {TP_HINT}; give {flag}"


def _baseline_tp_source(attach: Attach, tp_d: int | None, tp_d_src: str) -> str:
    if attach.baseline_url is not None:
        return "the attached baseline's own (--baseline-url)"
    if tp_d is not None:
        return f"D's TP ({tp_d_src})"
    return f"a guess: TP 1, since D's TP is {TP_UNKNOWN}; give --tp-d to run the baseline at D's TP"


def _attach_model(attach: Attach, flag: str | None) -> tuple[str, str]:
    if flag is not None:
        return flag, "--model"
    url = attach.decode_urls[0].rstrip("/")
    decode = next((s for s in attach.served if s.url == url), None)
    if decode is None or decode.model is None:
        why = "; ".join(u for u in (decode.unread if decode else ()) if "/v1/models" in u) or "not read"
        raise ConfigError(f"attach mode: cannot tell which model {url} serves ({why})")
    return decode.model, f"{url}/v1/models"


def _attach_length(served: Sequence[Served], flag: int | None) -> tuple[int | None, str]:
    lengths = {s.url: s.max_model_len for s in served if s.max_model_len}
    served_len = min(lengths.values()) if lengths else None
    if flag is not None and served_len is not None and flag > served_len:
        url = min(lengths, key=lambda u: lengths[u])
        raise ConfigError(f"--max-model-len {flag}, but {url} serves at most {served_len} tokens")
    length = flag or served_len
    if flag:
        return length, "--max-model-len"
    return length, ("the servers' /v1/models (the smallest)" if length else "unknown: the device's default")


def attach_settings(
    attach: Attach,
    model: str | None,
    device: str | None,
    dtype: str | None,
    max_model_len: int | None,
    host_device: Callable[[], str],
    given_tp: Mapping[str, tuple[int, str]] | None = None,
) -> AttachSettings:
    """The settings of a run against ``attach``'s servers from what each said (``attach.served``) and the flags given
    (None: not given). A flag the servers contradict is a ConfigError; so is a device that cannot be told.
    ``host_device``: this host's default device, taken only when every attached server runs on this host.
    ``given_tp``: "tp_p"/"tp_d" -> (size, the flag or variable that gave it), for those the user gave."""
    served = attach.served
    tp_p, tp_p_src = _attach_tp(attach, "tp_p", (given_tp or {}).get("tp_p"))
    tp_d, tp_d_src = _attach_tp(attach, "tp_d", (given_tp or {}).get("tp_d"))
    mod, mod_src = _attach_model(attach, model)
    dev, dev_src = _attach_device(served, device, host_device)
    reported_dtype = _one({s.url: s.dtype for s in served if s.dtype}, "dtype")
    if dtype is not None and reported_dtype is not None and dtype != reported_dtype:
        raise ConfigError(f"--dtype {dtype}, but the attached servers serve {reported_dtype}")
    dt = dtype or reported_dtype
    dt_src = (
        "--dtype"
        if dtype
        else (
            "the servers' /server_info"
            if dt
            else f"unknown ({SERVER_INFO_HINT}): a baseline launched here takes the device's "
            "default; give --dtype to match the servers"
        )
    )
    length, len_src = _attach_length(served, max_model_len)
    return AttachSettings(
        mod,
        dev,
        dt,
        length,
        attach.baseline_url is None,
        {
            "model": mod_src,
            "device": dev_src,
            "dtype": dt_src,
            "max_model_len": len_src,
            "tp_p": tp_p_src,
            "tp_d": tp_d_src,
            "baseline_tp": _baseline_tp_source(attach, tp_d, tp_d_src),
        },
        tp_p,
        tp_d,
    )
