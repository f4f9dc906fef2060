"""How many attention and KV heads (K) a model has, and what else shapes its KV cache, without loading it."""

from __future__ import annotations

from harness.models.config import load_models
from harness.models.hub import ModelHeads, config_shape, read_config

__all__ = ["config_shape", "model_heads"]


def model_heads(model: str) -> ModelHeads:
    """Attention and KV heads (K), family (model_type), head_dim (MLA: the latent width kv_lora_rank +
    qk_rope_head_dim), sliding window (tokens, None when none), whether it uses MLA, and layers: from the config.json
    of a local folder or of the hub id's snapshot in the local Hugging Face cache, else from configs/models.yaml
    (None when unknown; layers None for a models.yaml entry).

    For MLA, ``kv_heads`` is the config's num_key_value_heads and means nothing for the KV cache:
    vLLM keeps one latent "head" per token, the same on every TP rank.
    """
    cfg = read_config(model)
    if cfg is not None:
        return config_shape(cfg)
    entry = load_models().find(model, files=False)
    if entry is None:
        return {
            "attention_heads": None,
            "kv_heads": None,
            "family": None,
            "head_dim": None,
            "sliding_window": None,
            "mla": False,
            "kv_cache_groups": 1,
            "layers": None,
        }
    return {
        "attention_heads": entry.attention_heads,
        "kv_heads": entry.kv_heads,
        "family": entry.family,
        "head_dim": entry.head_dim,
        "sliding_window": entry.sliding_window,
        "mla": entry.mla,
        "kv_cache_groups": 1,
        "layers": None,
    }
