import json

import pytest

from harness.cli import main
from harness.gpu import nvml

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def run(capsys, *argv):
    rc = main(["plan", *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def test_json_plan_p2_d8_on_8_gpus(capsys):
    rc, out, err = run(capsys, "--gpus", "8", "--tp-p", "2", "--tp-d", "8", "--model", TINYLLAMA, "--json")
    assert rc == 0 and err == ""
    d = json.loads(out)
    assert d["colocated"] is True and d["baseline_alone"] is True
    servers = {(s["role"], s["index"]): s for s in d["servers"]}
    assert set(servers) == {("baseline", 0), ("prefill", 0), ("decode", 0)}
    for s in servers.values():
        assert set(s) >= {"role", "index", "gpus", "gpu_memory_utilization"}
    assert sorted(servers["decode", 0]["gpus"]) == list(range(8))
    assert len(servers["prefill", 0]["gpus"]) == 2
    shared = set(servers["prefill", 0]["gpus"])
    assert all(
        servers["prefill", 0]["gpu_memory_utilization"] + servers["decode", 0]["gpu_memory_utilization"] <= 0.9
        for _ in shared
    )


def test_json_n_by_m(capsys):
    rc, out, _ = run(
        capsys, "--gpus", "8", "--tp-p", "2", "--tp-d", "4", "--num-p", "2", "--model", TINYLLAMA, "--json"
    )
    d = json.loads(out)
    assert rc == 0 and d["colocated"] is False
    assert [s["role"] for s in d["servers"]] == ["baseline", "prefill", "prefill", "decode"]


def test_text_plan_shows_cuda_visible_devices(capsys):
    rc, out, _ = run(capsys, "--gpus", "8", "--tp-p", "2", "--tp-d", "8", "--model", TINYLLAMA)
    assert rc == 0
    assert "CUDA_VISIBLE_DEVICES" in out and "colocated" in out and "decode0" in out and "0.45" in out


def test_gpu_memory_flag_changes_the_verdict(capsys):
    rc, _, err = run(capsys, "--gpus", "8", "--gpu-mem-gib", "8", "--tp-p", "1", "--tp-d", "1", "--weights-gib", "12")
    assert rc == 2 and "needs GPUs of >= " in err


@pytest.mark.parametrize(
    "argv,what",
    [
        (["--gpus", "8", "--tp-p", "2", "--tp-d", "16"], "largest TP here is 8"),
        (["--gpus", "eight"], "--gpus 'eight' is not an integer"),
        (["--gpus", "0"], "--gpus must be > 0"),
        (["--gpus", "8", "--model", "nobody/nothing"], "unknown model"),
        (["--gpus", "8", "--max-util", "2"], "max utilization"),
    ],
)
def test_bad_input_is_one_line_on_stderr_and_exit_2(capsys, argv, what):
    rc, out, err = run(capsys, *argv)
    assert rc == 2 and out == ""
    assert what in err and err.count("\n") == 1 and err.startswith("error: ")


def test_without_gpus_flag_it_asks_nvml(capsys, monkeypatch):
    monkeypatch.setattr(nvml, "discover", lambda nvml=None: nvml_result(False))
    rc, _, err = run(capsys, "--tp-d", "2")
    assert rc == 2 and "no GPUs found" in err and "--gpus N" in err
    monkeypatch.setattr(nvml, "discover", lambda nvml=None: nvml_result(True))
    rc, out, _ = run(capsys, "--tp-d", "2", "--json")
    d = json.loads(out)
    assert rc == 0 and [g["total_gib"] for g in d["gpus"]] == [40.0, 40.0]


def nvml_result(available):
    if not available:
        return nvml.Discovery(False, reason="no NVIDIA driver: test")
    return nvml.Discovery(True, tuple(nvml.GpuInfo(i, "A100", 40.0, 39.0) for i in range(2)))


# Issue 35 item 10: `plan --gpus 8` planned 80 GiB GPUs on a 40 GiB box, and a model sized from the hub cache was said
# to be sized "from configs/models.yaml".


def test_gpus_without_a_size_takes_nvmls_memory(capsys, monkeypatch):
    from harness.simbox.box import SIMULATED_ENV

    monkeypatch.setenv(SIMULATED_ENV, "8x40")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    rc, out, _ = run(capsys, "--gpus", "8", "--tp-p", "2", "--tp-d", "8", "--model", TINYLLAMA, "--json")
    d = json.loads(out)
    assert rc == 0 and [g["total_gib"] for g in d["gpus"]] == [40.0] * 8 and not any("assumed" in n for n in d["notes"])
    assert d["required_free_gib"]["0"] == pytest.approx(0.9 * 40)
    rc, out, _ = run(capsys, "--gpus", "4", "--tp-d", "4", "--json")
    assert rc == 0 and [g["total_gib"] for g in json.loads(out)["gpus"]] == [40.0] * 4
    rc, out, _ = run(capsys, "--gpus", "16", "--tp-d", "16")
    assert rc == 0 and "16 GPUs x 40 GiB" in out
    assert "note: 16 GPUs planned, 8 present: each as the smallest, 40 GiB" in out
    rc, out, _ = run(capsys, "--gpus", "8", "--gpu-mem-gib", "80", "--json")  # a size given is a size given
    assert rc == 0 and {g["total_gib"] for g in json.loads(out)["gpus"]} == {80.0}


def test_gpus_where_nvml_cannot_be_read_says_the_size_it_assumed(capsys, monkeypatch):
    monkeypatch.setattr(nvml, "discover", lambda nvml=None: nvml_result(False))
    rc, out, err = run(capsys, "--gpus", "8", "--tp-p", "2", "--tp-d", "8", "--model", TINYLLAMA)
    assert rc == 0 and err == "" and "8 GPUs x 80 GiB" in out
    assert "note: 80 GiB per GPU assumed (no NVIDIA driver: test); give --gpu-mem-gib to plan for another size" in out


def test_the_plan_says_where_the_model_size_came_from(capsys, monkeypatch, tmp_path):
    from tests.unit.models.hub_cache import add_model

    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    snap = add_model(
        tmp_path / "hf" / "hub",
        "acme/Widget-13B",
        {"model_type": "llama", "num_attention_heads": 8, "num_key_value_heads": 8, "hidden_size": 64},
        [{"lm_head.weight": ("BF16", [1000, 64])}],
    )
    rc, out, _ = run(capsys, "--gpus", "2", "--gpu-mem-gib", "80", "--model", "acme/Widget-13B")
    line = next(x for x in out.splitlines() if x.startswith("model weights"))
    assert rc == 0 and "configs/models.yaml" not in line
    assert f"from its safetensors headers (read from the local Hugging Face cache: {snap})" in line
    rc, out, _ = run(capsys, "--gpus", "2", "--gpu-mem-gib", "80", "--model", TINYLLAMA)
    assert rc == 0 and "params_b 1.1 x 2 B (bfloat16) from configs/models.yaml" in out
