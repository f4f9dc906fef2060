"""A bundle's build_model.py rebuilds the tiny model of any family the run served, byte for byte."""

import subprocess
import sys

import pytest

from harness.models.tiny import TinyModelSpec, ensure_tiny_model
from harness.repro.builder import builder_script, tiny_spec, weights_sha256


@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma3", "mimo"])  # mimo: its MTP layer added after
def test_the_standalone_script_rebuilds_the_same_weights(tmp_path, family):
    src = ensure_tiny_model(TinyModelSpec(family=family, kv_heads=1, sliding_window=64 if family == "gemma3" else None))
    script = tmp_path / "build_model.py"
    spec = tiny_spec(src)
    assert spec is not None
    script.write_text(builder_script(spec, weights_sha256(src)))
    r = subprocess.run(
        [sys.executable, str(script), str(tmp_path / "out")], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )  # not the repository: the script must not need this project
    assert r.returncode == 0, r.stderr[-2000:]
    assert "weights identical to the run's" in r.stdout
