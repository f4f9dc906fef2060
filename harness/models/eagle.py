"""A tiny EAGLE head for a local Llama-family model, built beside it, so that speculative decoding with
``{"method": "eagle"}`` runs through P/D on the harness's own models (no EAGLE checkpoint can be fetched here).

The head is what vLLM's ``EagleLlamaForCausalLM`` loads: ``fc`` (the token's embedding and the target's hidden state,
concatenated, down to the hidden size), one decoder layer (no input norm: EAGLE's first layer has none), the target's
embedding; no ``lm_head`` (vLLM shares the target's). Its weights are seeded, so a run's drafts are deterministic; they
are not trained, so few drafts are accepted — what P/D is checked for is that the head's KV layer travels with the
target's (the KV digest covers it) and that acceptance matches the baseline's, not that it is high.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.models.perturb import perturbed_layer

EAGLE_SUFFIX = "-eagle"
BUILT_MARK = "harness_eagle_head.json"  # written last: a folder without it is an interrupted build


def eagle_head_dir(target: Path) -> Path:
    return target.parent / f"{target.name}{EAGLE_SUFFIX}"


def ensure_eagle_head(target: Path, seed: int = 0) -> Path:
    """The EAGLE head of the local model folder ``target``, built on first use (ValueError: not a Llama model)."""
    out = eagle_head_dir(target)
    if (out / BUILT_MARK).exists():
        return out
    config = json.loads((target / "config.json").read_text())
    if config.get("model_type") != "llama":
        raise ValueError(f"an EAGLE head is built for Llama models only; {target} is {config.get('model_type')!r}")
    import torch
    from safetensors.torch import load_file, save_file

    weights = load_file(str(target / "model.safetensors"))
    hidden = int(config["hidden_size"])
    gen = torch.Generator().manual_seed(seed)
    head = {"embed_tokens.weight": weights["model.embed_tokens.weight"].clone()}
    head["fc.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
    # the target's first layer, perturbed: another layer's KV (no input norm: EAGLE's first layer has none)
    head.update(perturbed_layer(weights, "model.layers.0.", "layers.0.", gen, skip=("input_layernorm",)))
    out.mkdir(parents=True, exist_ok=True)
    save_file(head, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 1}, indent=2))
    (out / BUILT_MARK).write_text(json.dumps({"target": target.name, "seed": seed}) + "\n")
    return out
