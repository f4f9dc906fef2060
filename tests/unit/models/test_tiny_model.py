import hashlib
import json
from typing import Any

import pytest

from harness.cli import main
from harness.models.tiny import TinyModelSpec, ensure_tiny_model

SMALL: dict[str, Any] = dict(kv_heads=1, heads=2, layers=1, head_dim=16)


def digest(folder):
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


def test_deterministic_cached_and_configured(tmp_path):
    spec = TinyModelSpec(**SMALL)
    a = ensure_tiny_model(spec, tmp_path / "c1")
    b = ensure_tiny_model(spec, tmp_path / "c2")
    assert digest(a) == digest(b)
    assert ensure_tiny_model(spec, tmp_path / "c1") == a  # cache hit
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["num_hidden_layers"]) == (
        2,
        1,
        16,
        1,
    )
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a)
    assert len(tok("the").input_ids) == 1  # no BOS: a one-word prompt can be one token


def test_cli_writes_out_dir(tmp_path, capsys, monkeypatch):
    import harness.models.tiny as tm

    monkeypatch.setattr(tm, "DEFAULT_CACHE", tmp_path / "cache")
    monkeypatch.setattr(tm.ensure_tiny_model, "__defaults__", (TinyModelSpec(), tmp_path / "cache"))
    monkeypatch.setattr(tm.export, "__defaults__", (tmp_path / "cache",))
    out = tmp_path / "out"
    assert (
        main(
            ["model", "tiny", "--kv-heads", "1", "--heads", "2", "--layers", "1", "--head-dim", "16", "--out", str(out)]
        )
        == 0
    )
    assert (out / "model.safetensors").exists() and str(out) in capsys.readouterr().out
    assert main(["model", "tiny", "--kv-heads", "3", "--heads", "4", "--out", str(tmp_path / "o2")]) == 2


def test_bad_spec():
    with pytest.raises(ValueError):
        TinyModelSpec(heads=4, kv_heads=3).validate()
