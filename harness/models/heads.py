"""How many attention and KV heads (K) a model has, and what else shapes its KV cache, without loading it."""

from __future__ import annotations

import json
from pathlib import Path

from harness.models.config import load_models


def _text_config(c: dict) -> dict:
    # Multimodal checkpoints (e.g. Gemma 3 4B) keep the language model's settings under text_config.
    return {**c, **c["text_config"]} if isinstance(c.get("text_config"), dict) else c


def config_shape(c: dict) -> dict:
    """The KV-relevant shape of a config.json's contents (see ``model_heads``)."""
    c = _text_config(c)
    heads = c.get("num_attention_heads")
    mla = c.get("kv_lora_rank") is not None
    if mla:
        # vLLM caches MLA's compressed latent plus the rope part per token, as one head (model_config.get_head_size).
        head_dim = c["kv_lora_rank"] + (c.get("qk_rope_head_dim") or 0)
    else:
        head_dim = c.get("head_dim") or (c["hidden_size"] // heads if heads and c.get("hidden_size") else None)
    # Qwen2/Qwen3 configs carry a sliding_window that is off unless use_sliding_window is set.
    window = c.get("sliding_window") if c.get("use_sliding_window", True) else None
    # Layers of different attention kinds (Gemma 3: sliding and full) are separate KV cache groups in vLLM, each
    # taking its own blocks of the one pool: a pool sized for one group serves a shorter context.
    groups = len(set(c["layer_types"])) if isinstance(c.get("layer_types"), list) and c["layer_types"] else 1
    return {"attention_heads": heads, "kv_heads": c.get("num_key_value_heads", heads), "family": c.get("model_type"),
            "head_dim": head_dim, "sliding_window": window, "mla": mla, "kv_cache_groups": groups}


def model_heads(model: str) -> dict[str, int | str | bool | None]:
    """Attention and KV heads (K), family (model_type), head_dim (MLA: the latent width kv_lora_rank +
    qk_rope_head_dim), sliding window (tokens, None when none) and whether it uses MLA: from a local
    config.json, else from configs/models.yaml (None when unknown).

    For MLA, ``kv_heads`` is the config's num_key_value_heads and means nothing for the KV cache:
    vLLM keeps one latent "head" per token, the same on every TP rank.
    """
    cfg_file = Path(model) / "config.json"
    if cfg_file.exists():
        return config_shape(json.loads(cfg_file.read_text()))
    entry = load_models().find(model)
    if entry is None:
        return {"attention_heads": None, "kv_heads": None, "family": None, "head_dim": None, "sliding_window": None,
                "mla": False, "kv_cache_groups": 1}
    return {"attention_heads": entry.attention_heads, "kv_heads": entry.kv_heads, "family": entry.family,
            "head_dim": entry.head_dim, "sliding_window": entry.sliding_window, "mla": entry.mla, "kv_cache_groups": 1}
