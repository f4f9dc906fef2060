import json

import pytest

from harness.calibrate import cli
from harness.calibrate.threshold import calibrate, per_request_deltas
from harness.cli import main
from harness.core.errors import ConfigError


def test_a_threshold_between_noise_and_the_faults_effect_is_ok():
    c = calibrate("cpu", [1e-6, 5e-6], [0.05, 0.2, 0.3], 1.02, 1e-3)
    assert c.verdict == "ok" and c.noise_max == 5e-6 and c.fault_max == 0.3 and c.fault_median == 0.2
    assert c.suggested is not None and 5e-6 * 3 < c.suggested < 0.3


@pytest.mark.parametrize("threshold, verdict", [(1.5, "too-loose"), (0.3, "too-loose"), (5e-6, "too-tight")])
def test_a_threshold_outside_is_named(threshold, verdict):
    # GPU's 1.5 against a bf16 noise of 3.2e-2 and a fault that moves 0.3: the check could not catch it
    c = calibrate("gpu", [3.2e-2, 1e-3] if verdict == "too-loose" else [5e-6], [0.1, 0.3], 1.02, threshold)
    assert c.verdict == verdict and str(threshold).rstrip("0") in c.why or f"{threshold:g}" in c.why


def test_a_fault_inside_the_noise_cannot_be_told_apart():
    c = calibrate("gpu", [0.05], [0.01, 0.04], 1.02, 0.02)
    assert c.verdict == "not-separable" and c.suggested is None


def test_no_deltas_is_an_error_not_a_verdict():
    with pytest.raises(ValueError):
        calibrate("cpu", [], [0.1], 1.02, 1e-3)


def test_deltas_come_from_the_sequential_prompts_and_the_load():
    report = {
        "comparison": {"prompts": [{"max_logprob_delta": 1e-6}, {"max_logprob_delta": None}]},
        "load": {"comparison": {"prompts": [{"max_logprob_delta": 2e-3}]}},
    }
    assert per_request_deltas(report) == [1e-6, 2e-3]


def fake_report(deltas, fired=None, threshold=1e-3):
    checks = [{"name": "logprobs_match_baseline", "passed": True, "data": {"threshold": threshold}}]
    if fired is not None:
        checks.append({"name": "decode_kv_fault_fired", "passed": fired})
    return {
        "verdict": "pass",
        "config": {"device": "cpu"},
        "checks": checks,
        "comparison": {"prompts": [{"max_logprob_delta": d} for d in deltas]},
    }


def test_the_command_runs_both_runs_and_writes_its_verdict(tmp_path, monkeypatch, capsys):
    seen = []

    def run(out, name, args, timeout_s):
        seen.append((name, args))
        return fake_report([1e-6] if name == "correct" else [0.1, 0.2], fired=name == "fault" or None)

    monkeypatch.setattr(cli, "run_e2e", run)
    rc = main(["calibrate", "--out", str(tmp_path / "cal"), "--", "--device", "cpu", "--tp-d", "2"])
    assert rc == 0 and seen == [
        ("correct", ["--device", "cpu", "--tp-d", "2"]),
        ("fault", ["--device", "cpu", "--tp-d", "2", "--decode-kv-fault", "1.02"]),
    ]
    got = json.loads((tmp_path / "cal" / "calibration.json").read_text())
    assert got["verdict"] == "ok" and got["threshold"] == 1e-3 and "**ok**" in capsys.readouterr().out


def test_a_fault_that_did_not_fire_is_no_measurement(tmp_path, monkeypatch):
    monkeypatch.setattr(cli, "run_e2e", lambda out, name, args, t: fake_report([1e-6], fired=False))
    with pytest.raises(ConfigError, match="did not fire"):
        cli.measure(tmp_path, [], 1.02, 10)
