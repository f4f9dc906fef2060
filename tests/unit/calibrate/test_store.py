"""`calibrate --store`: a calibration that places a threshold keeps it for the box (harness/run/thresholds.py) under
the key its correct run recorded; one that cannot place one keeps nothing and says so."""

import json

import pytest

from harness.calibrate import cli
from harness.cli import main
from harness.run.thresholds import ThresholdKey, ThresholdStore

KEY = ThresholdKey("NVIDIA A100-SXM4-80GB", "550.54.15", "0.32.0", "TinyLlama/TinyLlama-1.1B-Chat-v1.0")


def report(deltas, fired=None, key=KEY, source="default (not calibrated on this box)"):
    checks = [{"name": "logprobs_match_baseline", "passed": True, "data": {"threshold": 1.5}}]
    if fired is not None:
        checks.append({"name": "decode_kv_fault_fired", "passed": fired})
    config = {
        "device": "gpu",
        "logprob_threshold_key": key.to_dict() if key else None,
        "logprob_threshold_source": source,
    }
    return {
        "verdict": "pass",
        "config": config,
        "checks": checks,
        "comparison": {"prompts": [{"max_logprob_delta": d} for d in deltas]},
    }


@pytest.fixture
def store(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_HARNESS_RESULTS_DIR", str(tmp_path / "results"))
    return ThresholdStore()


def calibrate(monkeypatch, tmp_path, noise, fault, key=KEY, source="default (not calibrated on this box)"):
    def run(out, name, args, timeout_s):
        return report(noise if name == "correct" else fault, fired=name == "fault" or None, key=key, source=source)

    monkeypatch.setattr(cli, "run_e2e", run)
    return main(["calibrate", "--out", str(tmp_path / "cal"), "--store", "--", "--device", "gpu"])


def test_a_placed_threshold_is_kept_for_the_correct_runs_key(monkeypatch, tmp_path, capsys, store):
    # GPU's 1.5 is too loose for a fault that moves 0.4: the verdict says so, and the threshold kept sits between
    rc = calibrate(monkeypatch, tmp_path, [0.03, 0.01], [0.4, 0.1])
    got = store.lookup(KEY)
    assert rc == 0 and got is not None and 0.03 * 3 < got.threshold < 0.4
    assert json.loads((tmp_path / "cal" / "calibration.json").read_text())["suggested"] == got.threshold
    assert (got.noise_max, got.fault_max, got.fault_factor) == (0.03, 0.4, 1.02)
    assert got.folder == str((tmp_path / "cal").resolve()) and len(got.date) == 10
    assert f"stored threshold {got.threshold:.3g} for NVIDIA A100-SXM4-80GB" in capsys.readouterr().out


def test_noise_and_fault_that_do_not_separate_keep_nothing(monkeypatch, tmp_path, capsys, store):
    rc = calibrate(monkeypatch, tmp_path, [0.05], [0.01, 0.04])
    assert rc == 1 and store.entries() == [] and not store.path.exists()
    assert "nothing stored: no threshold tells a correct run from the fault here (not-separable)" in (
        capsys.readouterr().out
    )


def test_a_run_with_no_box_to_key_by_keeps_nothing(monkeypatch, tmp_path, capsys, store):
    rc = calibrate(monkeypatch, tmp_path, [0.01], [0.4], key=None, source="default (the cpu threshold)")
    assert rc == 1 and store.entries() == []
    assert "nothing stored: the correct run recorded no key for this box; its threshold: default (the cpu" in (
        capsys.readouterr().out
    )


def test_without_store_nothing_is_kept(monkeypatch, tmp_path, store):
    monkeypatch.setattr(
        cli,
        "run_e2e",
        lambda out, name, args, t: report([0.01] if name == "correct" else [0.4], fired=name == "fault" or None),
    )
    assert main(["calibrate", "--out", str(tmp_path / "cal"), "--", "--device", "gpu"]) == 1  # 1.5: too loose
    assert not store.path.exists()
