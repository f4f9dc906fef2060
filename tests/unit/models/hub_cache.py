"""A stand-in Hugging Face hub cache: models--org--name/{refs/main, snapshots/<rev>/} with a config.json and
small safetensors files written by hand (8-byte header length, JSON header, zero bytes), laid out as huggingface_hub
does."""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

REV = "0123456789abcdef0123456789abcdef01234567"
DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2}

TINYLLAMA = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 2048,
    "num_attention_heads": 32,
    "num_key_value_heads": 4,
    "num_hidden_layers": 22,
    "torch_dtype": "bfloat16",
}
QWEN3_06B = {
    "model_type": "qwen3",
    "architectures": ["Qwen3ForCausalLM"],
    "hidden_size": 1024,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 28,
    "sliding_window": None,
    "use_sliding_window": False,
    "torch_dtype": "bfloat16",
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int]]]) -> int:
    """A valid safetensors file of zero-filled tensors (name -> (dtype, shape)); returns the bytes of tensor data."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * DTYPE_BYTES[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads its header to 8 bytes
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    return offset


def add_model(
    cache: Path,
    repo_id: str,
    config: dict,
    shards: list[dict[str, tuple[str, list[int]]]] | None = None,
    drop: tuple[str, ...] = (),
) -> Path:
    """``repo_id`` in the cache at ``cache`` (HF_HUB_CACHE); several ``shards`` get a model.safetensors.index.json.
    ``drop``: files of the snapshot left out (an interrupted download). Returns the snapshot folder."""
    repo = cache / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / REV
    snap.mkdir(parents=True, exist_ok=True)
    (repo / "refs").mkdir(exist_ok=True)
    (repo / "refs" / "main").write_text(REV)
    (snap / "config.json").write_text(json.dumps(config))
    shards = shards if shards is not None else [{"model.embed_tokens.weight": ("BF16", [8, 4])}]
    names = (
        ["model.safetensors"]
        if len(shards) == 1
        else [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    )
    total = sum(write_safetensors(snap / n, t) for n, t in zip(names, shards, strict=False))
    if len(shards) > 1:
        weight_map = {t: n for n, s in zip(names, shards, strict=False) for t in s}
        (snap / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map})
        )
    for name in drop:
        (snap / name).unlink()
    return snap
