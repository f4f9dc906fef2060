"""A tiny random Phi-3: a model of a family the harness has no entry for, and one it did not make (no
``harness_tiny_model.json``), as a local folder or as a hub id in a Hugging Face cache of the test's own.

Phi-3 fuses q/k/v into one ``qkv_proj`` (and gate/up into ``gate_up_proj``); here with 4 attention heads, K=1 and a
1024-token limit. Its tokenizer is the tiny models' byte-level BPE (harness/models/tiny.py ``train_tokenizer``),
trained locally: the prompts' words are not one token each in it, so the word texts miss their intended lengths.
"""

from __future__ import annotations

from pathlib import Path

from harness.models.tiny import TinyModelSpec, train_tokenizer

HUB_ID = "pd-harness-tests/tiny-phi3"
REV = "0123456789abcdef0123456789abcdef01234567"
SPEC = TinyModelSpec(kv_heads=1, heads=4, layers=2, head_dim=64, intermediate=512, max_positions=1024)


def phi3_config(vocab_size: int, spec: TinyModelSpec = SPEC):
    from transformers import Phi3Config

    return Phi3Config(
        vocab_size=vocab_size,
        hidden_size=spec.heads * spec.head_dim,
        intermediate_size=spec.intermediate,
        num_hidden_layers=spec.layers,
        num_attention_heads=spec.heads,
        num_key_value_heads=spec.kv_heads,
        max_position_embeddings=spec.max_positions,
        original_max_position_embeddings=spec.max_positions,
        initializer_range=spec.init_std,
        sliding_window=None,
        tie_word_embeddings=False,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )


def build_tiny_phi3(out: Path, weights: bool = True, spec: TinyModelSpec = SPEC) -> Path:
    """The model in ``out``: tokenizer files, config.json and (``weights``) seeded random float32 weights."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = phi3_config(train_tokenizer(spec, out), spec)
    if not weights:
        config.save_pretrained(out)
        return out
    import torch
    from transformers import Phi3ForCausalLM

    torch.manual_seed(spec.seed)
    model = Phi3ForCausalLM(config).to(torch.float32)  # type: ignore[arg-type]  # wraps()-typed .to() drops self
    model.save_pretrained(out, safe_serialization=True)
    return out


def hub_cache_phi3(hf_home: Path, weights: bool = True) -> Path:
    """The model as ``HUB_ID`` in the Hugging Face cache of ``hf_home`` (``hub/models--.../snapshots/<rev>``, laid out
    as huggingface_hub does); returns the snapshot folder."""
    repo = Path(hf_home) / "hub" / ("models--" + HUB_ID.replace("/", "--"))
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    (repo / "refs" / "main").write_text(REV)
    return build_tiny_phi3(repo / "snapshots" / REV, weights)
