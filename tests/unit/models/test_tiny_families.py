import json

import pytest

from harness.cli import main
from harness.models.config import ModelEntry, load_models
from harness.models.heads import config_shape, model_heads
from harness.models.tiny import (
    FAMILIES,
    TinyModelSpec,
    ensure_tiny_model,
    spec_for_model_entry,
)

SMALL = {"heads": 2, "layers": 2, "head_dim": 16, "vocab": 300}


def test_the_default_llama_keeps_its_key_dirname_and_record():
    # the caches built before families existed (.cache/models/tiny-llama-h4-k1-l2-d64-cbba112b34df)
    assert TinyModelSpec().dirname() == "tiny-llama-h4-k1-l2-d64-cbba112b34df"
    assert TinyModelSpec(kv_heads=2).dirname() == "tiny-llama-h4-k2-l2-d64-92865974b9fb"
    assert "family" not in TinyModelSpec().record() and "sliding_window" not in TinyModelSpec().record()


def test_family_names_and_windows():
    assert TinyModelSpec(family="qwen3").dirname().startswith("tiny-qwen3-h4-k1-l2-d64-")
    assert TinyModelSpec(family="mistral").sliding_window == 64  # the family default
    assert TinyModelSpec(family="gemma3", sliding_window=32).dirname().startswith("tiny-gemma3-h4-k1-l2-d64-w32-")
    assert TinyModelSpec(family="granitemoehybrid").dirname().startswith("tiny-granitemoehybrid-h4-k1-l2-d64-")
    assert TinyModelSpec(family="granitemoehybrid").sliding_window is None
    keys = {TinyModelSpec(family=f, kv_heads=4 if f == "deepseek_v2" else 1).key() for f in FAMILIES}
    assert len(keys) == len(FAMILIES)


@pytest.mark.parametrize(
    "kw,msg",
    [
        ({"family": "gpt2"}, "unknown family"),
        ({"family": "qwen3", "sliding_window": 64}, "no sliding window"),
        ({"sliding_window": 64}, "no sliding window"),
        ({"family": "deepseek_v2", "kv_heads": 1}, "kv_heads == heads"),
        ({"family": "mistral", "sliding_window": 0}, ">= 1"),
        ({"family": "granitemoehybrid", "layers": 1}, "layers >= 2"),
        ({"family": "granitemoehybrid", "sliding_window": 64}, "no sliding window"),
    ],
)
def test_bad_family_specs(kw, msg):
    with pytest.raises(ValueError, match=msg):
        TinyModelSpec(**kw).validate()


@pytest.mark.parametrize(
    "family,k,model_type,head_dim,window,mla",
    [
        ("qwen3", 1, "qwen3", 16, None, False),
        ("qwen2", 1, "qwen2", 16, None, False),
        ("mistral", 1, "mistral", 16, 64, False),
        ("gemma3", 1, "gemma3_text", 16, 64, False),
        ("deepseek_v2", 2, "deepseek_v2", 576, None, True),  # latent 512 + rope 64
        ("qwen3_moe", 1, "qwen3_moe", 16, None, False),
        ("mimo", 1, "qwen2", 16, None, False),  # MiMo is a Qwen2 to transformers; vLLM picks MiMo by architecture
        ("granitemoehybrid", 1, "granitemoehybrid", 16, None, False),  # K and head_dim of the attention layers
    ],
)
def test_each_family_builds_runs_and_reads_back(tmp_path, family, k, model_type, head_dim, window, mla):
    import torch
    from transformers import AutoModelForCausalLM

    folder = ensure_tiny_model(TinyModelSpec(family=family, kv_heads=k, **SMALL), tmp_path)
    assert json.loads((folder / "harness_tiny_model.json").read_text())["family"] == family
    # Gemma 3 interleaves sliding and full layers, the hybrid Mamba2 and attention layers: two KV cache groups
    groups = 2 if family in ("gemma3", "granitemoehybrid") else 1
    assert model_heads(str(folder)) == {
        "attention_heads": 2,
        "kv_heads": k,
        "family": model_type,
        "head_dim": head_dim,
        "sliding_window": window,
        "mla": mla,
        "kv_cache_groups": groups,
        "layers": 2,
    }
    model = AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        assert model(torch.tensor([[3, 4, 5]])).logits.shape[-1] == 300


def test_family_specifics_in_the_configs(tmp_path):
    q3 = json.loads((ensure_tiny_model(TinyModelSpec(family="qwen3", **SMALL), tmp_path) / "config.json").read_text())
    assert q3["hidden_size"] != q3["num_attention_heads"] * q3["head_dim"]  # head_dim apart from the hidden size
    g3 = json.loads((ensure_tiny_model(TinyModelSpec(family="gemma3", **SMALL), tmp_path) / "config.json").read_text())
    assert g3["architectures"] == ["Gemma3ForCausalLM"] and g3["layer_types"] == ["sliding_attention", "full_attention"]


def test_the_moe_config_routes_every_layer_over_experts_an_ep_pair_can_split(tmp_path):
    spec = TinyModelSpec(family="qwen3_moe", **SMALL)
    c = json.loads((ensure_tiny_model(spec, tmp_path) / "config.json").read_text())
    assert c["architectures"] == ["Qwen3MoeForCausalLM"]
    assert c["decoder_sparse_step"] == 1 and c["mlp_only_layers"] == []  # no dense layer: every MLP routes
    experts = c["num_local_experts"]  # transformers 5 writes Qwen3-MoE's num_experts under this name; vLLM reads both
    assert experts % 2 == 0 and c["num_experts_per_tok"] < experts  # EP 2 splits them, the router picks among them


def test_mimo_carries_an_mtp_layer_vllm_loads_as_the_drafter(tmp_path):
    from safetensors import safe_open

    folder = ensure_tiny_model(TinyModelSpec(family="mimo", **SMALL), tmp_path)
    c = json.loads((folder / "config.json").read_text())
    assert c["architectures"] == ["MiMoForCausalLM"] and c["num_nextn_predict_layers"] == 1
    with safe_open(str(folder / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        # its own attention (another layer of KV for P/D to move), fed by the target's hidden state
        assert {"model.mtp_layers.0.input_proj.weight", "model.mtp_layers.0.self_attn.k_proj.weight"} <= names
        assert f.get_tensor("model.mtp_layers.0.input_proj.weight").shape == (c["hidden_size"], 2 * c["hidden_size"])
        assert not f.get_tensor("model.mtp_layers.0.self_attn.k_proj.weight").equal(
            f.get_tensor("model.layers.0.self_attn.k_proj.weight")
        )


def test_the_hybrid_config(tmp_path):
    spec = TinyModelSpec(family="granitemoehybrid", **{**SMALL, "layers": 4})
    h = json.loads((ensure_tiny_model(spec, tmp_path) / "config.json").read_text())
    assert h["architectures"] == ["GraniteMoeHybridForCausalLM"]
    # transformers writes Granite's mamba/attention as linear_attention/full_attention, the names vLLM maps
    assert h["layer_types"] == ["linear_attention", "full_attention"] * 2
    assert h["num_local_experts"] == 0 and h["position_embedding_type"] == "rope"
    # the Mamba2 inner width (heads x head dim) is expand x hidden, the heads a multiple of the attention heads
    assert h["mamba_n_heads"] * h["mamba_d_head"] == h["mamba_expand"] * h["hidden_size"]
    assert h["mamba_n_heads"] % h["num_attention_heads"] == 0
    assert h["hidden_size"] == h["num_attention_heads"] * 16 and "head_dim" not in h  # vLLM: hidden // heads


def test_model_heads_config_rules():
    # Qwen configs carry a window that is off; multimodal Gemma 3 nests its text config; Llama has neither
    assert (
        config_shape(
            {
                "model_type": "qwen2",
                "num_attention_heads": 16,
                "num_key_value_heads": 2,
                "hidden_size": 2048,
                "sliding_window": 32768,
                "use_sliding_window": False,
            }
        )["sliding_window"]
        is None
    )
    g = config_shape(
        {
            "model_type": "gemma3",
            "text_config": {
                "model_type": "gemma3_text",
                "num_attention_heads": 8,
                "num_key_value_heads": 4,
                "head_dim": 256,
                "sliding_window": 1024,
            },
        }
    )
    assert (g["attention_heads"], g["kv_heads"], g["head_dim"], g["sliding_window"], g["family"]) == (
        8,
        4,
        256,
        1024,
        "gemma3_text",
    )
    assert config_shape({"num_attention_heads": 4, "hidden_size": 256, "num_hidden_layers": 3}) == {
        "attention_heads": 4,
        "kv_heads": 4,
        "family": None,
        "head_dim": 64,
        "sliding_window": None,
        "mla": False,
        "kv_cache_groups": 1,
        "layers": 3,
    }


def test_model_heads_from_models_yaml_keeps_the_old_keys():
    h = model_heads("tiny-llama")
    assert (h["attention_heads"], h["kv_heads"], h["mla"]) == (4, 1, False)
    d = model_heads("tiny-deepseek-v2")
    assert d["mla"] and d["head_dim"] == 576 and d["family"] == "deepseek_v2"
    g = model_heads("tiny-granitemoehybrid")
    assert (g["kv_heads"], g["head_dim"], g["family"], g["mla"]) == (1, 64, "granitemoehybrid", False)
    assert model_heads("no/such-model")["kv_heads"] is None


def test_spec_for_model_entry():
    m = load_models()

    def find(name: str) -> ModelEntry:
        e = m.find(name)
        assert e is not None, name
        return e

    assert spec_for_model_entry(find("tiny-llama")) == TinyModelSpec()
    q = spec_for_model_entry(find("tiny-qwen3"), kv_heads=2)
    assert (q.family, q.kv_heads, q.heads, q.head_dim) == ("qwen3", 2, 4, 64)
    assert spec_for_model_entry(find("tiny-gemma3")).sliding_window == 64
    g = spec_for_model_entry(find("tiny-granitemoehybrid"))
    assert (g.family, g.kv_heads, g.heads, g.head_dim, g.sliding_window) == ("granitemoehybrid", 1, 4, 64, None)
    mla = spec_for_model_entry(find("tiny-deepseek-v2"), kv_heads=1)  # MLA has no K to choose
    assert (mla.family, mla.kv_heads, mla.head_dim) == ("deepseek_v2", 4, 64)
    for e in m.models:
        if e.hub_id is None:
            spec_for_model_entry(e).validate()


def test_cli_family(tmp_path, capsys, monkeypatch):
    import harness.models.tiny as tm

    monkeypatch.setattr(tm.ensure_tiny_model, "__defaults__", (TinyModelSpec(), tmp_path / "cache"))
    assert (
        main(
            [
                "model",
                "tiny",
                "--family",
                "mistral",
                "--sliding-window",
                "32",
                "--heads",
                "2",
                "--layers",
                "1",
                "--head-dim",
                "16",
            ]
        )
        == 0
    )
    assert "tiny-mistral-h2-k1-l1-d16-w32-" in capsys.readouterr().out
    assert main(["model", "tiny", "--family", "nope"]) == 2
    assert main(["model", "tiny", "--family", "deepseek_v2", "--kv-heads", "1"]) == 2


def test_kv_cache_groups_count_the_attention_kinds_of_the_layers():
    from harness.models.heads import config_shape

    base = {"num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 256}
    assert config_shape({**base, "layer_types": ["sliding_attention", "full_attention"]})["kv_cache_groups"] == 2
    assert config_shape({**base, "layer_types": ["full_attention", "full_attention"]})["kv_cache_groups"] == 1
    assert config_shape(base)["kv_cache_groups"] == 1
    assert config_shape({**base, "layer_types": ["linear_attention", "full_attention"]})["kv_cache_groups"] == 2
