"""Run configuration: CLI flags over upstream's env var names over defaults."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.accuracy.settings import AccuracySettings
from harness.core.errors import ConfigError
from harness.core.paths import RUNS_ROOT
from harness.serve.vllm_cmd import CpuTuning

# Upstream's accuracy-test scripts read these; we accept them as defaults.
UPSTREAM_ENV = {
    "tp_p": "PREFILLER_TP_SIZE",
    "tp_d": "DECODER_TP_SIZE",
    "block_size_p": "PREFILL_BLOCK_SIZE",
    "block_size_d": "DECODE_BLOCK_SIZE",
    "kv_layout_d": "DECODER_KV_LAYOUT",
    "gpu_memory_utilization": "GPU_MEMORY_UTILIZATION",
}


PROXY_FAULTS = ("none", "corrupt-block-ids", "wrong-engine-id", "no-remote-decode")  # what toy_proxy_server.py --fault accepts


@dataclass(frozen=True)
class E2EConfig:
    tp_p: int = 1
    tp_d: int = 1
    model: str | None = None  # None: the tiny local model on CPU
    device: str = "cpu"
    block_size_p: int | None = None
    block_size_d: int | None = None
    kv_layout_d: str | None = None
    gpu_memory_utilization: float | None = None
    run_dir: Path | None = None
    runs_root: Path = RUNS_ROOT
    python: str = sys.executable  # the interpreter that has vLLM
    cpu_tuning: CpuTuning = field(default_factory=CpuTuning)
    max_tokens: int = 16
    logprobs: int = 5
    ready_timeout_s: float = 600.0
    request_timeout_s: float = 180.0
    kv_lease_s: int | None = None  # None: 120 s on CPU (handshakes are slow there), vLLM's default on GPU
    seed: int = 0
    accuracy: AccuracySettings | None = None  # None: no lm-eval run
    proxy_fault: str = "none"  # fault injection for tests: "corrupt-block-ids" hands D wrong remote block ids

    def validate(self) -> None:
        for name in ("tp_p", "tp_d"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.device not in ("cpu", "gpu"):
            raise ConfigError(f"device must be cpu or gpu, got {self.device!r}")
        for name in ("block_size_p", "block_size_d"):
            v = getattr(self, name)
            if v is not None and v < 1:
                raise ConfigError(f"{name} must be a positive integer, got {v!r}")
        if self.block_size_p and self.block_size_d and self.block_size_d % self.block_size_p:
            raise ConfigError(f"prefill block size {self.block_size_p} must divide decode block size {self.block_size_d}")
        if self.kv_layout_d is not None and self.kv_layout_d not in ("HND", "NHD"):
            raise ConfigError(f"decode KV layout must be HND or NHD, got {self.kv_layout_d!r}")
        if self.model is None and self.device == "gpu":
            raise ConfigError("--model is required on GPU")
        if self.proxy_fault not in PROXY_FAULTS:
            raise ConfigError(f"proxy fault must be one of {', '.join(PROXY_FAULTS)}, got {self.proxy_fault!r}")
        if self.max_tokens < 1 or self.logprobs < 1:
            raise ConfigError("max_tokens and logprobs must be >= 1")

    @property
    def lease_s(self) -> int | None:
        return self.kv_lease_s if self.kv_lease_s is not None else (120 if self.device == "cpu" else None)

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
        return d


def env_defaults(env: Mapping[str, str] = os.environ) -> dict[str, object]:
    """Values from upstream's env var names; a bad value is an error naming the variable."""
    out: dict[str, object] = {}
    for key, var in UPSTREAM_ENV.items():
        raw = env.get(var)
        if raw is None or raw == "":
            continue
        if key == "kv_layout_d":
            if raw not in ("HND", "NHD"):
                raise ConfigError(f"{var}={raw!r} must be HND or NHD")
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
