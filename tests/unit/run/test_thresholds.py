"""Calibrated logprob thresholds (harness/run/thresholds.py): the store, its key, and which threshold a run uses."""

import json

import pytest

from harness.core.errors import ConfigError
from harness.gpu.run import GpuRun
from harness.run import pipeline
from harness.run.config import LOGPROB_THRESHOLD, E2EConfig
from harness.run.thresholds import (
    GIVEN,
    NOT_CALIBRATED,
    StoredThreshold,
    ThresholdChoice,
    ThresholdKey,
    ThresholdStore,
    choose_threshold,
    threshold_key,
)
from harness.serve.axes import ServerAxes
from tests.unit.gpu.fake_nvml import FakeGpu, FakeNvml

TINY = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
A100 = "NVIDIA A100-SXM4-80GB"
KEY = ThresholdKey(A100, "550.54.15", "0.32.0", TINY)


def stored(key: ThresholdKey = KEY, threshold: float = 0.21, folder: str = "/runs/cal") -> StoredThreshold:
    return StoredThreshold(key, threshold, 0.03, 120, 1.02, 1.4, 118, folder, "2026-12-08")


def test_the_key_is_the_gpu_model_driver_vllm_and_model():
    assert threshold_key([A100] * 8, "550.54.15", "0.32.0", TINY) == KEY
    # mixed GPUs name both; a local build of the version keys as the version the night names
    mixed = threshold_key(["NVIDIA H100", A100, ""], "550.54.15", "0.32.0+cu130", TINY)
    assert mixed == ThresholdKey(f"{A100}+NVIDIA H100", "550.54.15", "0.32.0", TINY)


def test_a_part_nvml_did_not_give_is_no_key_and_says_which():
    why = threshold_key(["", ""], None, "0.32.0", TINY)
    assert isinstance(why, str) and "GPU model name" in why and "driver version" in why and "vLLM" not in why


def test_the_store_keeps_one_entry_per_key_in_one_file(tmp_path):
    store = ThresholdStore(tmp_path / "results" / "t.json")
    assert store.entries() == [] and store.lookup(KEY) is None  # no file yet: nothing calibrated
    other = ThresholdKey(A100, "550.54.15", "0.21.0", TINY)
    store.put(stored())
    store.put(stored(other, 0.3))
    store.put(stored(threshold=0.25, folder="/runs/cal2"))  # a calibration again replaces the key's entry
    assert [e.threshold for e in store.entries()] == [0.3, 0.25]
    assert store.lookup(KEY) == stored(threshold=0.25, folder="/runs/cal2")
    got, again = store.lookup(other), ThresholdStore(store.path).lookup(KEY)
    assert got is not None and got.source == "calibrated 2026-12-08 (/runs/cal)"
    assert again is not None and again.threshold == 0.25  # read back from the file by a new reader


def test_the_default_store_is_beside_the_results_store(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_HARNESS_RESULTS_DIR", str(tmp_path))
    assert ThresholdStore().path == tmp_path / "calibrated_thresholds.json"


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "not JSON"),
        ('{"entries": {}}', "'entries' is {}, not a list"),
        ('{"entries": [{"threshold": 0.2}]}', "entry 0: the key is None"),
    ],
)
def test_a_broken_store_is_one_line_naming_the_file(tmp_path, text, message):
    path = tmp_path / "t.json"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as e:
        ThresholdStore(path).lookup(KEY)
    assert str(path) in str(e.value) and "\n" not in str(e.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("threshold", 0),
        ("threshold", "0.2"),
        ("threshold", float("nan")),
        ("noise_max", -1),
        ("folder", "x" * 400),
        ("date", None),
    ],
)
def test_an_entry_the_harness_did_not_write_is_refused(tmp_path, field, value):
    entry = stored().to_dict() | {field: value}
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": [stored(threshold=0.3).to_dict(), entry]}))
    with pytest.raises(ConfigError, match=f"entry 1: {field}"):
        ThresholdStore(path).entries()


def test_a_folder_with_a_line_break_is_shown_on_one_line(tmp_path):
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"entries": [stored(folder="/runs/a\nFAKE: line").to_dict()]}))
    got = ThresholdStore(path).lookup(KEY)
    assert got is not None and got.source == "calibrated 2026-12-08 (/runs/a FAKE: line)"


def gpu_cfg(**kw) -> E2EConfig:
    return E2EConfig(device="gpu", model=TINY, **kw)


def test_a_given_threshold_wins_and_keeps_the_key(tmp_path):
    store = ThresholdStore(tmp_path / "t.json")
    store.put(stored())
    got = choose_threshold(gpu_cfg(logprob_threshold=0.5), KEY, store)
    assert (got.threshold, got.source, got.key) == (0.5, GIVEN, KEY)


def test_the_keys_calibration_else_the_default_saying_so(tmp_path):
    store = ThresholdStore(tmp_path / "t.json")
    assert choose_threshold(gpu_cfg(), KEY, store) == ThresholdChoice(None, NOT_CALIBRATED, KEY)
    store.put(stored())
    got = choose_threshold(gpu_cfg(), KEY, store)
    assert (got.threshold, got.source) == (0.21, "calibrated 2026-12-08 (/runs/cal)")
    other_driver = ThresholdKey(A100, "560.28.03", "0.32.0", TINY)  # a new driver: measured again, not reused
    assert choose_threshold(gpu_cfg(), other_driver, store).source == NOT_CALIBRATED
    assert choose_threshold(gpu_cfg(), "no driver version to key a calibration by", store).source == (
        "default (no driver version to key a calibration by)"
    )


def test_an_fp8_kv_run_keeps_its_own_default(tmp_path):
    store = ThresholdStore(tmp_path / "t.json")
    store.put(stored())
    got = choose_threshold(gpu_cfg(axes=ServerAxes(kv_cache_dtype="fp8")), KEY, store)
    assert got.threshold is None and got.source.startswith("default (an fp8 KV cache")


# Where a run resolves its config (run/pipeline.py _resolve): the store injected, the GPUs from a fake NVML.


def resolved(monkeypatch, tmp_path, store, cfg, nvml):
    monkeypatch.setattr(pipeline, "GpuRun", lambda *a, **k: GpuRun(*a, **{**k, "nvml": nvml, "env": {}}))
    run = pipeline.PDRun(cfg, thresholds=store)
    run.report.versions = {"vllm": "0.32.0"}  # what run() reads from the serving interpreter first
    run._resolve()
    return run


def test_a_gpu_run_without_a_threshold_uses_its_boxs_calibration(monkeypatch, tmp_path):
    store = ThresholdStore(tmp_path / "t.json")
    store.put(stored())
    nvml = FakeNvml([[FakeGpu(name=A100) for _ in range(2)]], driver="550.54.15")
    run = resolved(monkeypatch, tmp_path, store, gpu_cfg(run_dir=tmp_path / "run"), nvml)
    assert run.ctx.cfg.logprob_limit == 0.21 and run.cfg is run.ctx.cfg  # what evaluate() checks against
    config = run.report.config
    assert config["logprob_threshold"] == 0.21
    assert config["logprob_threshold_source"] == "calibrated 2026-12-08 (/runs/cal)"
    assert config["logprob_threshold_key"] == KEY.to_dict()  # what `calibrate --store` keeps a measurement under


def test_a_gpu_run_on_an_uncalibrated_box_says_it_uses_the_default(monkeypatch, tmp_path):
    store = ThresholdStore(tmp_path / "t.json")
    store.put(stored())
    nvml = FakeNvml([[FakeGpu(name=A100) for _ in range(2)]], driver="560.28.03")  # the driver changed
    run = resolved(monkeypatch, tmp_path, store, gpu_cfg(run_dir=tmp_path / "run"), nvml)
    assert run.ctx.cfg.logprob_limit == LOGPROB_THRESHOLD["gpu"]
    assert run.report.config["logprob_threshold"] is None
    assert run.report.config["logprob_threshold_source"] == NOT_CALIBRATED


def test_a_cpu_run_never_reads_the_store(tmp_path):
    path = tmp_path / "t.json"
    path.write_text("{broken")  # read, it would stop the run
    run = pipeline.PDRun(E2EConfig(model=TINY, run_dir=tmp_path / "run"), thresholds=ThresholdStore(path))
    run.report.versions = {"vllm": "0.32.0"}
    run._resolve()
    assert run.report.config["logprob_threshold_source"] == "default (the cpu threshold)"
