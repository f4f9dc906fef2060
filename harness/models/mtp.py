"""Multi-token-prediction (MTP) layers for a tiny model, so that ``{"method": "mtp"}`` speculative decoding runs
through P/D on the harness's own models (no MTP checkpoint can be fetched here).

The family is Xiaomi's MiMo as vLLM serves it: a Qwen2 model (``MiMoForCausalLM``) whose checkpoint also holds
``model.mtp_layers.N``: token and hidden norms, ``input_proj`` (the token's embedding and the target's hidden state,
concatenated, down to the hidden size), one Qwen2 decoder layer and a final norm. vLLM loads that layer as the drafter
of the target itself (``MiMoMTP``), with a KV cache layer of its own, which P/D must move with the target's. The
weights are seeded, not trained, so few drafts are accepted: what P/D is checked for is that the MTP layer's KV
travels (the KV digest covers it) and that acceptance matches the baseline's.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.models.perturb import perturbed_layer

MTP_ARCHITECTURE = "MiMoForCausalLM"
MTP_LAYERS = 1  # vLLM's MiMo MTP predicts one token (``mimo_mtp only support predict one token now``)


def add_mtp_layers(folder: Path, seed: int = 0) -> None:
    """Append seeded MTP layers to the Qwen2 checkpoint in ``folder`` and name it a MiMo model (in place)."""
    import torch
    from safetensors.torch import load_file, save_file

    config_path, weights_path = folder / "config.json", folder / "model.safetensors"
    config = json.loads(config_path.read_text())
    if config.get("model_type") != "qwen2":
        raise ValueError(f"MTP layers are added to Qwen2 models only; {folder} is {config.get('model_type')!r}")
    weights = load_file(str(weights_path))
    hidden = int(config["hidden_size"])
    gen = torch.Generator().manual_seed(seed)
    for i in range(MTP_LAYERS):
        prefix = f"model.mtp_layers.{i}."
        for norm in ("token_layernorm", "hidden_layernorm", "final_layernorm"):
            weights[f"{prefix}{norm}.weight"] = torch.ones(hidden)
        weights[f"{prefix}input_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=gen) / (2 * hidden) ** 0.5
        weights.update(perturbed_layer(weights, "model.layers.0.", prefix, gen))  # a layer with KV of its own
    save_file(weights, str(weights_path), metadata={"format": "pt"})
    config.update({"architectures": [MTP_ARCHITECTURE], "num_nextn_predict_layers": MTP_LAYERS})
    config_path.write_text(json.dumps(config, indent=2))
