"""`make e2e TP_P=2 TP_D=8` on a GPU box: no --model runs the reported case's model and says so; GPUs that cannot
be read stop the run at preflight (exit 2, one line, no run folder). NVML is a fake here."""

from __future__ import annotations

import pytest

from harness.cli import build_parser, config_from_args, default_model_note, main
from harness.core.errors import ConfigError
from harness.run.config import GPU_DEFAULT_MODEL
from harness.run.preflight import check_gpus
from tests.unit.gpu.fake_nvml import FakeNvml, gpus


def use_nvml(monkeypatch, fake: FakeNvml) -> None:
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: fake)


def test_no_model_on_gpu_is_the_reported_case(monkeypatch):
    use_nvml(monkeypatch, FakeNvml([gpus(8)]))
    cfg = config_from_args(
        build_parser().parse_args(["e2e", "--device", "gpu", "--tp-p", "2", "--tp-d", "8"]), env={}, preflight=True
    )
    assert cfg.model == GPU_DEFAULT_MODEL == "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
    note = default_model_note(cfg)
    assert "TinyLlama/TinyLlama-1.1B-Chat-v1.0" in note and "K=4: P2->D8 is regime B" in note
    # A model given is kept; on CPU no model still means the tiny local one.
    given = config_from_args(
        build_parser().parse_args(["e2e", "--device", "gpu", "--model", "Qwen/Qwen3-0.6B"]), env={}
    )
    assert given.model == "Qwen/Qwen3-0.6B"
    assert config_from_args(build_parser().parse_args(["e2e", "--device", "cpu"]), env={}).model is None


def test_the_run_says_which_model_it_picked(monkeypatch, capsys, tmp_path):
    use_nvml(monkeypatch, FakeNvml([gpus(8)]))

    class Stop(Exception):
        pass

    def no_run(cfg, attach=None):
        raise Stop(cfg.model)

    monkeypatch.setattr("harness.run.pipeline.PDRun", no_run)
    with pytest.raises(Stop, match="TinyLlama"):
        main(["e2e", "--device", "gpu", "--tp-p", "2", "--tp-d", "8", "--run-dir", str(tmp_path / "run")])
    out = capsys.readouterr().out
    assert out.startswith("model: no --model given, so the GPU run serves TinyLlama/TinyLlama-1.1B-Chat-v1.0")


@pytest.mark.parametrize(
    "fake, message",
    [
        (
            FakeNvml(init_error="Driver Not Loaded"),
            "--device gpu, but the GPUs cannot be read: no NVIDIA driver: Driver Not Loaded",
        ),
        (FakeNvml([[]]), "--device gpu, but NVML lists no GPU"),
        (FakeNvml([gpus(4)]), "no GPU placement for P TP2 + D TP8"),
    ],
)
def test_unreadable_or_too_few_gpus_stop_at_preflight(monkeypatch, capsys, tmp_path, fake, message):
    use_nvml(monkeypatch, fake)
    run_dir = tmp_path / "run"
    assert main(["e2e", "--device", "gpu", "--tp-p", "2", "--tp-d", "8", "--run-dir", str(run_dir)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {message}") and err.count("\n") == 1
    assert not run_dir.exists()


def test_no_pynvml_is_a_preflight_error_too(monkeypatch):
    def missing():
        raise ImportError("No module named 'pynvml'")

    monkeypatch.setattr("harness.gpu.nvml._real_nvml", missing)
    cfg = config_from_args(build_parser().parse_args(["e2e", "--device", "gpu"]), env={})
    with pytest.raises(ConfigError, match="pynvml"):
        check_gpus(cfg)


def test_a_hand_given_share_the_colocated_pair_cannot_hold_stops_the_run_at_preflight(monkeypatch, capsys, tmp_path):
    # P2+D8 on 8 GPUs: P shares GPUs 0 and 1 with D, so 0.8 each would ask for 1.6 of those GPUs
    use_nvml(monkeypatch, FakeNvml([gpus(8)]))
    run_dir = tmp_path / "run"
    rc = main(
        [
            "e2e",
            "--device",
            "gpu",
            "--tp-p",
            "2",
            "--tp-d",
            "8",
            "--model",
            "Qwen/Qwen3-0.6B",
            "--gpu-memory-utilization",
            "0.8",
            "--run-dir",
            str(run_dir),
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and not run_dir.exists()
    assert "0.8" in err and "shared" in err and len(err.strip().splitlines()) == 1, err
