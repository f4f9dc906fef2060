"""The tiny EAGLE head: the weights vLLM's EagleLlamaForCausalLM loads, none it refuses (lm_head, the first layer's
input norm), built once beside its target; ``{eagle}`` in a speculative config names it."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from harness.core.errors import ConfigError
from harness.models.eagle import BUILT_MARK, ensure_eagle_head
from harness.run.launch import speculative_for

HIDDEN = 8


def target(tmp_path, model_type: str = "llama"):
    folder = tmp_path / "tiny-llama-x"
    folder.mkdir()
    config = {"model_type": model_type, "hidden_size": HIDDEN, "num_hidden_layers": 2, "vocab_size": 16}
    (folder / "config.json").write_text(json.dumps(config))
    names = ["model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"]
    for layer in (0, 1):
        names += [f"model.layers.{layer}.{n}.weight" for n in ("input_layernorm", "self_attn.q_proj", "mlp.up_proj")]
    save_file({n: torch.ones(16 if "embed" in n or "lm_head" in n else HIDDEN, HIDDEN) for n in names},
              str(folder / "model.safetensors"))  # fmt: skip
    return folder


def test_the_head_has_what_vllms_eagle_llama_loads_and_nothing_it_refuses(tmp_path):
    head = ensure_eagle_head(target(tmp_path))
    weights = load_file(str(head / "model.safetensors"))
    assert sorted(weights) == [
        "embed_tokens.weight",
        "fc.weight",
        "layers.0.mlp.up_proj.weight",
        "layers.0.self_attn.q_proj.weight",
    ]
    assert weights["fc.weight"].shape == (HIDDEN, 2 * HIDDEN)
    assert json.loads((head / "config.json").read_text())["num_hidden_layers"] == 1
    again = load_file(str(ensure_eagle_head(head.parent / "tiny-llama-x") / "model.safetensors"))
    assert all(torch.equal(weights[n], again[n]) for n in weights)  # built once, seeded


def test_an_interrupted_build_is_built_again(tmp_path):
    head = ensure_eagle_head(target(tmp_path))
    (head / BUILT_MARK).unlink()
    (head / "model.safetensors").write_bytes(b"cut")
    assert "fc.weight" in load_file(str(ensure_eagle_head(tmp_path / "tiny-llama-x") / "model.safetensors"))


def test_eagle_in_a_speculative_config_is_the_head_and_a_model_without_one_is_a_config_error(tmp_path):
    folder = target(tmp_path)
    spec = speculative_for('{"method":"eagle","model":"{eagle}","num_speculative_tokens":2}', str(folder))
    assert spec is not None and json.loads(spec)["model"] == str(folder.parent / "tiny-llama-x-eagle")
    (tmp_path / "q").mkdir()
    other = target(tmp_path / "q", model_type="qwen3")
    with pytest.raises(ConfigError, match="no EAGLE head for .*Llama models only"):
        speculative_for('{"method":"eagle","model":"{eagle}"}', str(other))
