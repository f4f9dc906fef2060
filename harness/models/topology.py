"""Heterogeneous-TP KV topology: pure math, and what each vLLM version family does with it.

D is "local" and P is "remote" (as in vLLM's D worker). With K KV heads, a
rank holds ``max(1, K // tp)`` heads: once tp > K heads are replicated and the
KV block length stops scaling with 1/tp - the case vLLM before the fix mishandled
(issue #45330).

MLA (DeepSeek-style) is apart from all that: vLLM caches one latent "head" per token
(kv_lora_rank + qk_rope_head_dim wide), the same on every TP rank, so block lengths
are equal at any TP pair and D reads whole blocks from one P rank (regime M).
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.core.paths import CONFIGS_DIR
from harness.models.rules import block_sizes_problem, gqa_problem, tp_head_problems, tp_pair_problem

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "fp8": 1, "float8_e4m3fn": 1}
REGIMES = {
    "A": "K >= max(P, D), D >= P: plain head slicing",
    "B": "P <= K < D: D replicates heads P slices (issue #45330 regime)",
    "C": "K < P <= D: replicated on both sides, equal block lengths",
    "D": "K < P and P > D: replicated prefill larger than decode (rejected by design)",
    "E": "D < P <= K: D reads from several P ranks and merges",
    "M": "MLA: one latent KV head replicated on every rank; D reads whole blocks from one P rank",
}
# The first release of the `fixed` family (carrying PR #45879) is measured, not assumed: a bisect of the
# regime-B entry (python -m harness bisect) recorded it with its evidence in the matrix config.
FAMILIES_YAML = CONFIGS_DIR / "gqa_replication.yaml"


@dataclass(frozen=True)
class ModelShape:
    attention_heads: int
    kv_heads: int
    head_dim: int = 64  # MLA: the latent width (kv_lora_rank + qk_rope_head_dim)
    dtype: str = "bfloat16"
    mla: bool = False  # K is then moot: one KV head per rank on every side


@dataclass(frozen=True)
class Topology:
    tp_p: int
    tp_d: int
    kv_heads: int
    attention_heads: int
    p_heads_per_rank: int
    d_heads_per_rank: int
    tp_ratio: int
    block_size_p: int
    block_size_d: int
    block_size_ratio: int
    p_block_len: int
    d_block_len: int
    regime: str
    regime_description: str
    valid: bool
    invalid_reasons: tuple[str, ...]
    vllm_version: str | None
    version_family: str
    expected: str  # ok | assert-45330 | rejected | unsupported | invalid
    expected_reason: str
    pp_p: int = 1  # P's pipeline stages: each holds a slice of the layers, and D reads every stage
    dcp_d: int = 1  # D's decode context parallel size (its ranks split the tokens, not the P ranks they read)
    # for each D TP rank, the P ranks it reads, as (pipeline stage, TP rank) pairs (vLLM's handshake_target_ranks)
    d_sources: tuple[tuple[tuple[int, int], ...], ...] = ()

    def to_dict(self) -> dict:
        d = asdict(self)
        d["invalid_reasons"] = list(self.invalid_reasons)
        d["d_sources"] = [[list(src) for src in rank] for rank in self.d_sources]
        return d


def heads_per_rank(kv_heads: int, tp: int) -> int:
    return max(1, kv_heads // tp)


def tp_ratio(tp_p: int, tp_d: int) -> int:
    return tp_d // tp_p if tp_d >= tp_p else -(tp_p // tp_d)


def regime(k: int, p: int, d: int) -> str:
    # E is the part of "K >= max(P, D)" where P > D: named apart because D merges reads from several P ranks.
    if d < p <= k:
        return "E"
    if k >= max(p, d):
        return "A"
    if p <= k < d:
        return "B"
    if k < p <= d:
        return "C"
    return "D"  # k < p and p > d


def shape_problem(shape: ModelShape) -> str | None:
    """Why ``shape`` is no model vLLM loads, or None (MLA has no K to speak of)."""
    return None if shape.mla else gqa_problem(shape.attention_heads, shape.kv_heads)


def validity(shape: ModelShape, p: int, d: int, bs_p: int, bs_d: int) -> list[str]:
    problem = shape_problem(shape)
    reasons = [problem] if problem else []
    for side, tp in (("prefill", p), ("decode", d)):
        if tp < 1:
            reasons.append(f"{side} TP must be >= 1")
        elif shape.kv_heads >= 1:
            reasons += tp_head_problems(shape.attention_heads, shape.kv_heads, side, tp, shape.mla)
    pair = tp_pair_problem(p, d)
    if bs_p < 1 or bs_d < 1:
        reasons.append(f"block sizes must be >= 1, got prefill {bs_p}, decode {bs_d}")
    blocks = block_sizes_problem(bs_p, bs_d)
    return reasons + [r for r in (pair, blocks) if r]


def parallel_problems(tp_d: int, pp_p: int, dcp_d: int) -> list[str]:
    """What vLLM 0.32.0 refuses of P's pipeline stages and D's decode context parallel size with a KV connector: DCP
    must be 1 or D's whole TP group (config/vllm.py, the NIXL transfer parallel size)."""
    reasons = [
        f"{name} must be >= 1, got {v}" for name, v in (("P's pipeline stages", pp_p), ("D's DCP", dcp_d)) if v < 1
    ]
    if not reasons and tp_d >= 1 and dcp_d not in (1, tp_d):
        reasons.append(f"D's decode context parallel size {dcp_d} must be 1 or D's TP size {tp_d} (vLLM, with P/D)")
    return reasons


def d_sources(tp_p: int, tp_d: int, pp_p: int = 1) -> tuple[tuple[tuple[int, int], ...], ...]:
    """For each D TP rank, the (P stage, P TP rank) pairs it reads: vLLM's ``handshake_target_ranks`` (0.32.0,
    kv_connector/utils.py) against every one of P's pipeline stages (its handshake walks them all). D's own DCP
    leaves this unchanged while P's is 1: a DCP-sharded D rank still reads the P rank its TP rank maps to."""
    ratio = tp_ratio(tp_p, tp_d)
    out = []
    for r in range(tp_d):
        ranks = [r // ratio] if ratio > 0 else [r * -ratio + i for i in range(-ratio)]
        out.append(tuple((stage, p) for stage in range(pp_p) for p in ranks))
    return tuple(out)


def parse_version(v: str) -> tuple[int, ...]:
    core = v.split("+")[0].split("rc")[0].split(".dev")[0]
    parts = []
    for x in core.split(".")[:3]:
        digits = "".join(ch for ch in x if ch.isdigit())
        parts.append(int(digits) if digits else 0)
    while len(parts) < 3:
        parts.append(0)
    return tuple(parts)


@functools.lru_cache(maxsize=8)
def measured_fixed_in(path: Path = FAMILIES_YAML) -> tuple[int, ...]:
    """families.fixed.fixed_in of the matrix config (validated with the rest of it by harness/matrix/config.py)."""
    import yaml

    data = yaml.safe_load(Path(path).read_text()) or {}
    v = ((data.get("families") or {}).get("fixed") or {}).get("fixed_in")
    if not v:
        raise ValueError(f"{path}: families.fixed.fixed_in is not set (measure it: python -m harness bisect)")
    return parse_version(str(v))


def version_family(v: str | None, fixed_in: tuple[int, ...] | None = None) -> str:
    """pre-fix before the measured first fixed release (or ``fixed_in``), else fixed; no version: fixed."""
    if v is None:
        return "fixed"
    return "pre-fix" if parse_version(v) < (fixed_in or measured_fixed_in()) else "fixed"


def predict(
    shape: ModelShape,
    tp_p: int,
    tp_d: int,
    block_size_p: int = 16,
    block_size_d: int | None = None,
    vllm_version: str | None = None,
    fixed_in: tuple[int, ...] | None = None,
    pp_p: int = 1,
    dcp_d: int = 1,
) -> Topology:
    bs_d = block_size_d or block_size_p
    k = shape.kv_heads
    reasons = validity(shape, tp_p, tp_d, block_size_p, bs_d) + parallel_problems(tp_d, pp_p, dcp_d)
    valid = not reasons
    # MLA: vLLM's get_num_kv_heads is 1 for MLA at any TP (vllm/config/model.py).
    hp = 1 if shape.mla else heads_per_rank(k, max(tp_p, 1))
    hd = 1 if shape.mla else heads_per_rank(k, max(tp_d, 1))
    nbytes = DTYPE_BYTES.get(shape.dtype, 2)
    p_len = block_size_p * hp * shape.head_dim * nbytes
    d_len = bs_d * hd * shape.head_dim * nbytes
    ratio = tp_ratio(tp_p, tp_d) if valid else 0
    bsr = bs_d // block_size_p if valid else 0
    reg = "M" if shape.mla else regime(k, tp_p, tp_d)
    family = version_family(vllm_version, fixed_in)
    if not valid:
        expected, why = "invalid", "; ".join(reasons)
    elif dcp_d > 1 and not shape.mla:
        expected, why = "unsupported", "vLLM runs P/D with decode context parallel on MLA models only (config/vllm.py)"
    elif shape.mla:
        # 0.21.0 and 0.32.0 both treat MLA as replicated (nixl base_worker.py _validate_remote_agent_handshake):
        # block lengths equal up to block_size_ratio, which they are by construction; no P > D refusal.
        expected, why = "ok", "MLA latent is replicated: equal block lengths, each D rank reads one P rank"
    elif tp_p > tp_d and tp_p > k:
        expected, why = "rejected", "a replicated prefill TP larger than decode TP is refused at handshake (by design)"
    elif family == "pre-fix" and tp_d >= tp_p and tp_p <= k:
        # <= 0.21 asserted remote_block_len == block_len * tp_ratio // block_size_ratio (non-replicated P).
        if p_len == d_len * ratio // bsr:
            expected, why = "ok", "block lengths agree with tp_ratio"
        else:
            expected, why = (
                "assert-45330",
                (
                    f"P block length {p_len} != D block length {d_len} * tp_ratio {ratio} // "
                    f"block_size_ratio {bsr} = {d_len * ratio // bsr} (issue #45330)"
                ),
            )
    else:
        expected, why = "ok", "handshake compatible"
    if valid and pp_p > 1:
        why += f"; P in {pp_p} pipeline stages: each D rank reads its P rank(s) of every stage"
    return Topology(
        tp_p,
        tp_d,
        k,
        shape.attention_heads,
        hp,
        hd,
        ratio,
        block_size_p,
        bs_d,
        bsr,
        p_len,
        d_len,
        reg,
        REGIMES[reg],
        valid,
        tuple(reasons),
        vllm_version,
        family,
        expected,
        why,
        pp_p,
        dcp_d,
        d_sources(tp_p, tp_d, pp_p) if valid else (),
    )
