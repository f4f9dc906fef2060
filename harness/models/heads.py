"""How many attention and KV heads (K) a model has, without loading it."""

from __future__ import annotations

import json
from pathlib import Path

from harness.models.config import load_models


def model_heads(model: str) -> dict[str, int | None]:
    """Attention and KV heads (K): from a local config.json, else from configs/models.yaml (None when unknown)."""
    cfg_file = Path(model) / "config.json"
    if cfg_file.exists():
        c = json.loads(cfg_file.read_text())
        return {"attention_heads": c.get("num_attention_heads"), "kv_heads": c.get("num_key_value_heads", c.get("num_attention_heads"))}
    entry = load_models().find(model)
    return {"attention_heads": entry.attention_heads if entry else None, "kv_heads": entry.kv_heads if entry else None}
