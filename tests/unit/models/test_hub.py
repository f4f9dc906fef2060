"""A hub model that configs/models.yaml does not list is planned from the local Hugging Face cache (config.json and
safetensors headers; nothing downloaded), a local folder the same way, and a model missing from the cache is refused
at preflight in one line that says how to fetch it (issue 23, item 9)."""

from __future__ import annotations

import shutil

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.gpu.plan import GIB, model_memory
from harness.gpu.run import GpuRun
from harness.models.config import load_models
from harness.models.heads import model_heads
from harness.models.hub import availability, header_sizes, locate, safetensors_header, weights
from harness.run.config import E2EConfig
from harness.run.preflight import check_config, preflight_config
from tests.unit.gpu.fake_nvml import FakeNvml, gpus
from tests.unit.models.hub_cache import add_model, write_safetensors

WIDGET = "acme/Widget-13B"  # listed nowhere: only the cache knows it
WIDGET_CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 5120,
    "num_attention_heads": 40,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "num_hidden_layers": 3,
}
# two shards as the hub splits them: 2 x 3 x 4 + 5 bf16 parameters and 7 x 2 f32 ones
SHARDS = [
    {"model.layers.0.weight": ("BF16", [2, 3, 4]), "model.norm.weight": ("BF16", [5])},
    {"lm_head.weight": ("F32", [7, 2])},
]
PARAMS, BYTES = 2 * 3 * 4 + 5 + 7 * 2, (2 * 3 * 4 + 5) * 2 + 7 * 2 * 4


@pytest.fixture
def cache(tmp_path, monkeypatch):
    """An empty hub cache of this test's own, found through HF_HOME as huggingface_hub would."""
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    return tmp_path / "hf" / "hub"


@pytest.fixture
def widget(cache):
    assert load_models().find(WIDGET, files=False) is None
    return add_model(cache, WIDGET, WIDGET_CONFIG, SHARDS)


def test_heads_and_weights_of_an_unlisted_model_come_from_the_cache(widget):
    h = model_heads(WIDGET)
    assert (h["attention_heads"], h["kv_heads"], h["head_dim"], h["layers"], h["family"]) == (40, 8, 128, 3, "llama")
    loc = locate(WIDGET)
    assert loc is not None and loc.from_cache and loc.folder == widget
    w = weights(widget)
    assert w is not None
    assert (w.bytes, w.params, w.files) == (BYTES, PARAMS, 2)
    entry = load_models().find(WIDGET)
    assert entry is not None and entry.hub_id is None and entry.params_b == pytest.approx(PARAMS / 1e9)
    assert availability(WIDGET) is None


def test_the_gpu_plan_sizes_an_unlisted_model_from_its_safetensors_headers(widget):
    # before: "unknown model ...: add params_b to configs/models.yaml or give the weights size in GiB"
    mem = model_memory(WIDGET)
    assert mem.weights_gib == pytest.approx(PARAMS * 2 / GIB)
    plan = GpuRun(2, 4, WIDGET, nvml=FakeNvml([gpus(8)])).plan
    assert [s.name for s in plan.servers] == ["baseline0", "prefill0", "decode0"]


def test_preflight_and_topology_check_an_unlisted_model(widget, capsys):
    pf = preflight_config(E2EConfig(device="gpu", model=WIDGET, tp_p=2, tp_d=8))
    assert pf.ok and pf.topology is not None and (pf.topology.kv_heads, pf.topology.regime) == (8, "A")
    # before, its heads were unknown and this pair passed preflight silently
    with pytest.raises(ConfigError, match="decode TP 16 does not divide the model's 40 attention heads"):
        check_config(E2EConfig(device="gpu", model=WIDGET, tp_p=2, tp_d=16))
    assert main(["topology", "--model", WIDGET, "--tp-p", "2", "--tp-d", "8"]) == 0
    assert "K=8" in capsys.readouterr().out


def test_a_local_folder_is_read_the_same_way(widget, tmp_path):
    folder = tmp_path / "widget-copy"
    shutil.copytree(widget, folder)
    assert model_heads(str(folder))["layers"] == 3 and availability(str(folder)) is None
    w = weights(folder)
    assert w is not None and w.params == PARAMS
    t = preflight_config(E2EConfig(device="gpu", model=str(folder), tp_p=2, tp_d=8)).topology
    assert t is not None and t.kv_heads == 8
    assert availability(str(tmp_path / "nowhere")) == f"model folder {tmp_path / 'nowhere'} does not exist"


def test_headers_written_by_the_safetensors_package_are_read(tmp_path):
    np = pytest.importorskip("numpy")
    st = pytest.importorskip("safetensors.numpy")
    tensors = {"a": np.zeros((3, 5), dtype=np.float16), "b": np.zeros((7,), dtype=np.float32)}
    st.save_file(tensors, str(tmp_path / "m.safetensors"))
    assert header_sizes(safetensors_header(tmp_path / "m.safetensors")) == (3 * 5 * 2 + 7 * 4, 3 * 5 + 7)
    assert write_safetensors(tmp_path / "x.safetensors", {"t": ("BF16", [4, 4])}) == 32
    assert header_sizes(safetensors_header(tmp_path / "x.safetensors")) == (32, 16)


def test_a_model_missing_from_the_cache_is_refused_in_one_line_without_a_run_folder(cache, tmp_path, capsys):
    run_dir = tmp_path / "run"
    assert main(["e2e", "--device", "cpu", "--model", "acme/Absent-1B", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and not run_dir.exists()
    assert "acme/Absent-1B is not in the local Hugging Face cache" in err and "`hf download acme/Absent-1B`" in err
    assert str(cache) in err


def test_a_gpu_run_of_a_missing_model_is_refused_before_its_gpus_are_planned(cache, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: FakeNvml([gpus(8)]))
    run_dir = tmp_path / "run"
    assert main(["e2e", "--device", "gpu", "--model", "acme/Absent-1B", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: model acme/Absent-1B is not in the local Hugging Face cache") and err.count("\n") == 1
    assert "give the weights size" not in err and not run_dir.exists()


def test_an_interrupted_download_is_refused_naming_the_missing_shard(cache):
    add_model(cache, WIDGET, WIDGET_CONFIG, SHARDS, drop=("model-00002-of-00002.safetensors",))
    line = availability(WIDGET)
    assert line is not None
    assert "1 of 2 weight files missing (e.g. model-00002-of-00002.safetensors)" in line
    assert f"hf download {WIDGET}" in line
    loc = locate(WIDGET)
    assert loc is not None and weights(loc.folder) is None


def test_the_run_itself_refuses_a_missing_model_as_a_config_error(cache, tmp_path, monkeypatch):
    """A run started without the CLI (as a matrix does) stops at resolve, classified, before anything launches."""
    from harness.run import pipeline

    monkeypatch.setattr(pipeline, "installed_versions", lambda python: {})
    launched = []
    monkeypatch.setattr(pipeline, "run_baseline", lambda *a: launched.append(a))
    d = pipeline.PDRun(E2EConfig(device="cpu", model="acme/Absent-1B", run_dir=tmp_path / "run")).run()
    assert d["failure"]["class"] == "config-error" and "hf download acme/Absent-1B" in d["failure"]["reason"]
    assert launched == []
