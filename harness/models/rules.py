"""What vLLM requires of a P/D configuration, each rule written once: the KV layouts D may take, block sizes that
divide, TP sizes against the model's heads. The CLI, the run config, the YAML configs, the topology predictor and
preflight all ask here; each caller words the side ("P", "prefill") its own way."""

from __future__ import annotations

from typing import Literal

from harness.core.errors import ConfigError

DEVICES = ("cpu", "gpu")  # what the harness runs vLLM on
Device = Literal["cpu", "gpu"]
KV_LAYOUTS = ("HND", "NHD")  # D's KV cache layout (VLLM_KV_CACHE_LAYOUT); P's is vLLM's own
KvLayout = Literal["HND", "NHD"]
# vLLM's CPU attention backend needs KV block sizes that are multiples of this; the harness's CPU default.
CPU_BLOCK_MULTIPLE = 32
VLLM_DEFAULT_BLOCK_SIZE = 16  # what vLLM uses where no block size is given (GPU)


def as_device(value: str) -> Device:
    """``value`` as a device a run can take; ConfigError otherwise (what a flag or a YAML file said)."""
    if value == "cpu":
        return "cpu"
    if value == "gpu":
        return "gpu"
    raise ConfigError(f"device must be {' or '.join(DEVICES)}, got {value!r}")


def layout_problem(layout: object) -> str | None:
    """Why ``layout`` is no KV layout D can take (None: it is one, or not given)."""
    if layout is None or layout in KV_LAYOUTS:
        return None
    return f"must be {' or '.join(KV_LAYOUTS)}, got {layout!r}"


def block_sizes_problem(block_size_p: int | None, block_size_d: int | None) -> str | None:
    """P's block size must divide D's: D reads whole remote blocks into its own (a size not given passes)."""
    if block_size_p and block_size_d and block_size_p >= 1 and block_size_d >= 1 and block_size_d % block_size_p:
        return f"prefill block size {block_size_p} does not divide decode block size {block_size_d}"
    return None


def gqa_problem(attention_heads: int, kv_heads: int) -> str | None:
    """In GQA each KV head serves an equal group of attention heads, so K must divide them."""
    if kv_heads < 1:
        return f"K={kv_heads} KV heads: a model has at least one"
    if attention_heads % kv_heads:
        return f"{attention_heads} attention heads are not a multiple of K={kv_heads} KV heads (GQA groups)"
    return None


def tp_head_problems(attention_heads: int, kv_heads: int, side: str, tp: int, mla: bool = False) -> list[str]:
    """Why ``side``'s TP size cannot shard the model's heads: vLLM needs num_attention_heads % tp == 0, and past K
    (GQA replication) tp % K == 0. MLA has one latent KV head on every rank: K is moot there."""
    out = []
    if attention_heads % tp:
        out.append(
            f"{side} TP {tp} does not divide the model's {attention_heads} attention heads "
            "(vLLM needs num_attention_heads % tp == 0)"
        )
    if not mla and tp > kv_heads and tp % kv_heads:
        out.append(
            f"{side} TP {tp} is larger than the model's {kv_heads} KV heads and not a multiple of them "
            "(vLLM needs tp % K == 0 when tp > K)"
        )
    return out


def tp_pair_problem(tp_p: int, tp_d: int) -> str | None:
    """The larger TP size must be a multiple of the smaller: each rank of one side maps to whole ranks of the other."""
    if tp_p >= 1 and tp_d >= 1 and max(tp_p, tp_d) % min(tp_p, tp_d):
        return f"TP sizes {tp_p} (prefill) and {tp_d} (decode): the larger must be a multiple of the smaller"
    return None
