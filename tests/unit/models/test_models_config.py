import pytest

from harness.models.config import load_models
from tests.helpers import config_error


def test_shipped_models_file_is_valid():
    m = load_models()
    tinyllama, by_folder = m.find("TinyLlama/TinyLlama-1.1B-Chat-v1.0"), m.find("/some/dir/tiny-llama")
    qwen = m.find("Qwen/Qwen3-0.6B")
    assert tinyllama is not None and tinyllama.kv_heads == 4
    assert by_folder is not None and by_folder.kv_heads == 1
    assert qwen is not None and qwen.gsm8k_expected == 0.41
    assert m.find("unknown/model") is None


@pytest.mark.parametrize(
    "text,field",
    [
        ("models:\n  - id: x\n    attention_heads: 4\n    kv_heads: 0\n", "models.0.kv_heads"),
        ("models:\n  - id: x\n    attention_heads: 4\n    kv_heads: 3\n", "not a multiple of K=3 KV heads"),
        ("models:\n  - id: x\n    attention_heads: 4\n    kv_heads: 1\n    colour: red\n", "models.0.colour"),
        (
            "models:\n  - id: x\n    attention_heads: 4\n    kv_heads: 1\n"
            "  - id: x\n    attention_heads: 4\n    kv_heads: 1\n",
            "duplicate",
        ),
        ("models: [\n", "models.yaml"),
    ],
)
def test_bad_entry_is_one_line_naming_the_field(tmp_path, text, field):
    msg = config_error(load_models, tmp_path / "models.yaml", text)
    assert field in msg and "\n" not in msg.strip() or "models.yaml" in field
