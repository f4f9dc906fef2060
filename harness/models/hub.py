"""A model's files on this machine, read without loading or downloading anything.

A model is a local folder, or a hub id whose snapshot is in the local Hugging Face cache (servers run with
HF_HUB_OFFLINE=1: what is not there cannot be served). From its files: the KV-relevant shape of its config.json
(``config_shape``) and its weights' size, from the safetensors headers (8 bytes of header length, then a JSON
header with each tensor's dtype, shape and byte offsets), so nothing of the weights themselves is read.
"""

from __future__ import annotations

import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypedDict

SAFETENSORS_INDEX = "model.safetensors.index.json"
MAX_HEADER_BYTES = 100 * 2**20  # safetensors' own limit: a longer "header" is not one


def fetch_command(repo_id: str) -> str:
    return f"hf download {repo_id}"


def hub_cache_dir(env: Mapping[str, str] | None = None) -> Path:
    """Where huggingface_hub keeps models, read from the environment now (huggingface_hub reads it once, at import)."""
    env = os.environ if env is None else env
    home = env.get("HF_HOME") or os.path.join(env.get("XDG_CACHE_HOME") or os.path.join("~", ".cache"), "huggingface")
    raw = env.get("HF_HUB_CACHE") or env.get("HUGGINGFACE_HUB_CACHE") or os.path.join(home, "hub")
    return Path(os.path.expanduser(os.path.expandvars(raw)))


def is_hub_id(model: str) -> bool:
    """``org/name`` (or a bare legacy name) as the hub spells ids; anything else is meant as a local path."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    try:
        validate_repo_id(model)
    except HFValidationError:
        return False
    return True


@dataclass(frozen=True)
class LocalModel:
    name: str  # as given: a folder or a hub id
    folder: Path  # the folder, or the hub id's snapshot in the cache
    from_cache: bool


def locate(model: str, env: Mapping[str, str] | None = None) -> LocalModel | None:
    """The folder that holds ``model``'s config.json here: the folder itself, or the cache's snapshot of refs/main."""
    p = Path(model).expanduser()
    if p.is_dir():
        return LocalModel(model, p, False)
    if not is_hub_id(model):
        return None
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(model, "config.json", cache_dir=hub_cache_dir(env))
    return LocalModel(model, Path(found).parent, True) if isinstance(found, str) else None


def read_config(model: str, env: Mapping[str, str] | None = None) -> dict | None:
    """``model``'s config.json (None when it is neither a local folder with one nor in the local hub cache)."""
    loc = locate(model, env)
    cfg = loc.folder / "config.json" if loc else None
    if cfg is None or not cfg.is_file():
        return None
    try:
        return json.loads(cfg.read_text())
    except (OSError, ValueError):
        return None


@dataclass(frozen=True)
class Weights:
    bytes: int
    params: int | None  # None where only sizes are known (no safetensors header read)
    files: int
    source: str  # how the size was found, for the report


def safetensors_header(path: Path) -> dict:
    """The JSON header of a safetensors file (ValueError when it is not one)."""
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ValueError(f"{path}: shorter than a safetensors header")
        (n,) = struct.unpack("<Q", head)
        if n > MAX_HEADER_BYTES:
            raise ValueError(f"{path}: header length {n} is not a safetensors header's")
        return json.loads(f.read(n))


def header_sizes(header: dict) -> tuple[int, int]:
    """(bytes, parameters) of the tensors a safetensors header describes."""
    nbytes = params = 0
    for name, t in header.items():
        if name == "__metadata__":
            continue
        start, end = t["data_offsets"]
        nbytes += end - start
        params += math.prod(t["shape"])
    return nbytes, params


def weight_files(folder: Path) -> tuple[list[str], list[str]]:
    """(safetensors files the model is made of, those of them missing here): the index's shards, else every file."""
    index = folder / SAFETENSORS_INDEX
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text()).get("weight_map", {}).values()))
    else:
        shards = sorted(f.name for f in folder.glob("*.safetensors"))
    return shards, [s for s in shards if not (folder / s).is_file()]


def weights(folder: Path) -> Weights | None:
    """The weights' size from the safetensors headers (None: no safetensors here, or a shard missing or unreadable)."""
    try:
        shards, missing = weight_files(folder)
        if not shards or missing:
            return None
        nbytes = params = 0
        for s in shards:
            b, p = header_sizes(safetensors_header(folder / s))
            nbytes, params = nbytes + b, params + p
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return Weights(nbytes, params, len(shards), f"safetensors headers of {len(shards)} file(s) in {folder}")


def availability(model: str, env: Mapping[str, str] | None = None) -> str | None:
    """Why ``model`` cannot be served from this machine's files, as one line naming how to fetch it (None: it can)."""
    loc = locate(model, env)
    if loc is None:
        if not is_hub_id(model):
            return f"model folder {model} does not exist"
        return (
            f"model {model} is not in the local Hugging Face cache ({hub_cache_dir(env)}) and is no local folder; "
            f"servers run offline: fetch it first with `{fetch_command(model)}` "
            f"(or `huggingface-cli download {model}`)"
        )
    if not (loc.folder / "config.json").is_file():
        return f"model folder {model} has no config.json"
    try:
        shards, missing = weight_files(loc.folder)
    except (OSError, ValueError):
        return f"model {model}: {loc.folder / SAFETENSORS_INDEX} cannot be read"
    if missing:
        fetch = f"; fetch it with `{fetch_command(model)}`" if loc.from_cache else ""
        return (
            f"model {model} is incomplete in {loc.folder}: {len(missing)} of {len(shards)} weight files missing "
            f"(e.g. {missing[0]}){fetch}"
        )
    return None


def _text_config(c: dict) -> dict:
    # Multimodal checkpoints (e.g. Gemma 3 4B) keep the language model's settings under text_config.
    return {**c, **c["text_config"]} if isinstance(c.get("text_config"), dict) else c


class ModelHeads(TypedDict):
    """A model's KV-relevant shape (``config_shape``, ``harness.models.heads.model_heads``); None: unknown."""

    attention_heads: int | None
    kv_heads: int | None
    family: str | None
    head_dim: int | None
    sliding_window: int | None
    mla: bool
    kv_cache_groups: int
    layers: int | None


def config_shape(c: dict) -> ModelHeads:
    """The KV-relevant shape of a config.json's contents (see ``harness.models.heads.model_heads``)."""
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
    return {
        "attention_heads": heads,
        "kv_heads": c.get("num_key_value_heads", heads),
        "family": c.get("model_type"),
        "head_dim": head_dim,
        "sliding_window": window,
        "mla": mla,
        "kv_cache_groups": groups,
        "layers": c.get("num_hidden_layers"),
    }
