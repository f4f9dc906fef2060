"""Server settings beyond TP that P/D bugs live on (the edge-case matrix's axes), each defaulting to today's run.

Block sizes and D's KV layout predate this and stay fields of the run's config; the rest are here so that a
matrix entry, a run config and a server spec carry them the same way.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass

# What vLLM accepts for --kv-cache-dtype (a value outside it is a config error here, not a server crash).
KV_CACHE_DTYPES = ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
KV_BUFFER_DEVICES = ("cpu", "cuda", "xpu")
MODEL_PLACEHOLDER = "{model}"  # in speculative_config: the run's own model (the draft equals the target)
EAGLE_PLACEHOLDER = "{eagle}"  # in speculative_config: a tiny EAGLE head built for the run's model (models/eagle.py)


@dataclass(frozen=True)
class ServerAxes:
    kv_cache_dtype: str | None = None  # every server, baseline included (the baseline must quantize alike)
    prefix_caching_d: bool = False  # D's prefix cache on; P and the baseline keep theirs off
    async_scheduling: bool | None = None  # None: vLLM's default
    attention_backend: str | None = None  # None: vLLM's choice (CPU_ATTN on CPU)
    kv_buffer_device: str | None = None  # NIXL's buffer; None: cpu on CPU, cuda on GPU ("cpu" on GPU: host buffer)
    permute_local_kv_d: bool = (
        False  # D permutes received HND blocks into its NHD layout (vLLM's enable_permute_local_kv)
    )
    # --speculative-config (JSON) on every server, the baseline included: P/D decodes speculatively against a baseline
    # that does too, so the comparison stays greedy-exact and an acceptance drop is P/D's
    speculative_config: str | None = None
    # P's num_speculative_tokens in that config (D and the baseline keep the config's): upstream's P/D spec-decode test
    # gives P one speculative token and D several, since P only prefills
    speculative_tokens_p: int | None = None
    # P's --max-num-batched-tokens: below the prompt length, P prefills in chunks (D and the baseline keep theirs)
    max_num_batched_tokens_p: int | None = None
    # --compilation-config (JSON) on every server, the baseline included: e.g. a custom op turned off (the CPU
    # rotary-embedding op that mis-rotates MLA's strided views), so that an entry tests P/D and not that op
    compilation_config: str | None = None
    # D's --data-parallel-size (the baseline's too, which serves D's settings): each DP rank an engine of its own at
    # D's TP, with a NIXL side channel of its own; vLLM's API server spreads requests over them
    data_parallel_size_d: int | None = None
    # D's KV pool in blocks (P and the baseline keep the run's): below what the load phase's concurrent requests hold,
    # D preempts requests whose KV came from P and recomputes them itself
    kv_pool_blocks_d: int | None = None
    # P's --pipeline-parallel-size: P's layers split over stages (each at P's TP); D reads each stage's layers
    pipeline_parallel_size_p: int | None = None
    # D's --decode-context-parallel-size (the baseline's too): D's decode splits the context over ranks of its TP group
    decode_context_parallel_size_d: int | None = None
    # P and D run NixlConnector inside a MultiConnector beside an OffloadingConnector with this much host memory
    # (bytes): KV also offloaded, a repeated prompt served from the offloaded copy
    kv_offload_bytes: int | None = None
    # D's --enable-expert-parallel (the baseline's too): an MoE model's experts split over D's ranks (TP or DP) instead
    # of each expert's weights; P keeps its experts whole, so only D's MLPs differ, and the KV that moves does not
    expert_parallel_d: bool = False

    def validate(self) -> None:
        if self.kv_cache_dtype is not None and self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        if self.kv_buffer_device is not None and self.kv_buffer_device not in KV_BUFFER_DEVICES:
            raise ValueError(
                f"kv_buffer_device must be one of {', '.join(KV_BUFFER_DEVICES)}, got {self.kv_buffer_device!r}"
            )
        if self.attention_backend is not None and not self.attention_backend.replace("_", "").isalnum():
            raise ValueError(
                f"attention_backend must be a vLLM backend name such as FLASH_ATTN, got {self.attention_backend!r}"
            )

        if self.speculative_config is not None:
            speculative_problem(self.speculative_config)
        if self.speculative_tokens_p is not None:
            if self.speculative_config is None:
                raise ValueError("speculative_tokens_p needs speculative_config (P's tokens of which config?)")
            if self.speculative_tokens_p < 1:
                raise ValueError(f"speculative_tokens_p must be >= 1, got {self.speculative_tokens_p!r}")
        if self.compilation_config is not None:
            json_object_problem("compilation_config", self.compilation_config)
        for name in ("pipeline_parallel_size_p", "decode_context_parallel_size_d", "kv_offload_bytes"):
            if (v := getattr(self, name)) is not None and v < 1:
                raise ValueError(f"{name} must be >= 1, got {v!r}")
        if self.kv_pool_blocks_d is not None and self.kv_pool_blocks_d < 1:
            raise ValueError(f"kv_pool_blocks_d must be >= 1, got {self.kv_pool_blocks_d!r}")
        if self.data_parallel_size_d is not None and self.data_parallel_size_d < 1:
            raise ValueError(f"data_parallel_size_d must be >= 1, got {self.data_parallel_size_d!r}")
        if self.max_num_batched_tokens_p is not None and self.max_num_batched_tokens_p < 1:
            raise ValueError(f"max_num_batched_tokens_p must be >= 1, got {self.max_num_batched_tokens_p!r}")

    @property
    def pp_p(self) -> int:
        """P's pipeline stages: 1 without the axis."""
        return self.pipeline_parallel_size_p or 1

    @property
    def spec_tokens(self) -> int:
        """The speculative config's ``num_speculative_tokens``: 0 without the axis or without the key."""
        if self.speculative_config is None:
            return 0
        return int(speculative_problem(self.speculative_config).get("num_speculative_tokens") or 0)

    def speculative_config_for(self, role: str) -> str | None:
        """The speculative config ``role`` gets: the axis's, with P's own num_speculative_tokens where one is set."""
        if self.speculative_config is None or role != "prefill" or self.speculative_tokens_p is None:
            return self.speculative_config
        obj = speculative_problem(self.speculative_config)
        return json.dumps({**obj, "num_speculative_tokens": self.speculative_tokens_p}, separators=(",", ":"))

    @property
    def dcp_d(self) -> int:
        """D's decode context parallel size: 1 without the axis."""
        return self.decode_context_parallel_size_d or 1

    @property
    def dp_d(self) -> int:
        """D's data-parallel ranks (engines): 1 without the axis."""
        return self.data_parallel_size_d or 1

    def set(self) -> dict[str, object]:
        """The axes that differ from their default: what a report and a matrix listing show."""
        default = ServerAxes()
        return {k: v for k, v in asdict(self).items() if v != getattr(default, k)}

    def to_dict(self) -> dict:
        return asdict(self)


def json_object_problem(name: str, text: str, shape: str = "a JSON object") -> dict:
    """The JSON object ``text`` holds; ValueError (one line naming ``name`` and the ``shape`` wanted) when it is not
    one."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{name} is not JSON: {e}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{name} must be {shape}, got {text!r}")
    return obj


def speculative_problem(text: str) -> dict:
    """The speculative config ``text`` holds; ValueError (one line) unless it is a JSON object naming a ``method``
    (vLLM's schema, checked by vLLM itself when the server starts: here only what makes the flag unusable)."""
    shape = 'a JSON object with a "method"'
    obj = json_object_problem("speculative_config", text, shape)
    if not isinstance(obj.get("method"), str):
        raise ValueError(f"speculative_config must be {shape}, got {text!r}")
    return obj
