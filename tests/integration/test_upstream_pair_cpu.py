"""Attach mode against a P/D pair started the way upstream vLLM's own accuracy-test scripts start one.

The harness's own servers carry its settings (block size 32, prefix caching off, CPU tuning, the KV digest hook). A
user's pair does not: this module starts P (TP 1) and D (TP 2) on the harness's tiny K=1 model with a plain
`vllm.entrypoints.openai.api_server` command line, a `kv_both` NixlConnector and vLLM's defaults otherwise, then runs
`python -m harness e2e --prefill-url ... --decode-url ...` against them. The run must pass with the KV proven to have
moved, state the servers' TP as given, and name the settings in which its own baseline differs from the pair (block
size 32 against 128, prefix caching off against on), so that a reader knows what the comparison stood on.
"""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from harness.models.tiny import ensure_tiny_model
from harness.render.run_markdown import attach_markdown
from harness.serve.ports import PortAllocator, server_ports
from harness.serve.procs import RUN_TAG_ENV, ManagedProcess, ProcessSpec, start_all
from tests.helpers import processes_tagged

REPO = Path(__file__).resolve().parents[2]
READY_S = 900  # both servers start together in about 4 min on 2 cores
RUN_S = 900  # the attach run (its baseline's start-up, the sequential prompts) takes about 3 min there
# a hang fails this module's test, not the whole tier: the two waits above, and room for teardown
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(READY_S + RUN_S + 120)]
KV_CONFIG = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both"})


def upstream_server(name: str, model: str, tp: int, alloc: PortAllocator, logs: Path) -> ManagedProcess:
    """One server as upstream's scripts start it: the OpenAI api_server with a kv_both NixlConnector, no harness
    tuning and no harness hooks."""
    ports = server_ports(alloc, tp)
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    argv += ["--port", str(ports.http), "--tensor-parallel-size", str(tp)]
    argv += ["--dtype", "float32", "--max-model-len", "512", "--kv-transfer-config", KV_CONFIG]
    # vLLM's own refusal otherwise: on CPU each rank reserves this fraction of its NUMA node's whole memory and will
    # not start when less is free; P's and D's two ranks all share this box's one node (the default 0.9 cannot fit).
    argv += ["--gpu-memory-utilization", "0.2"]
    env = {
        "VLLM_NIXL_SIDE_CHANNEL_PORT": str(ports.side_channel_base),  # one port per rank from here on
        "VLLM_PORT": str(ports.internal_base),
        "HF_HUB_OFFLINE": "1",
        RUN_TAG_ENV: str(logs),  # the owner's tag, read by processes_tagged; vLLM does not read it
    }
    if tp > 1:
        # vLLM's own refusal otherwise: its CPU auto-binding wants a NUMA node per rank ("Not enough allowed NUMA
        # nodes ... Please try to bind threads manually"), and this box has one; so one allowed core per rank.
        cores = sorted(os.sched_getaffinity(0))
        env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(cores[rank % len(cores)]) for rank in range(tp))
    spec = ProcessSpec(
        name=name,
        argv=argv,
        env=env,
        log_path=logs / f"{name}.log",
        health_url=f"http://127.0.0.1:{ports.http}/health",
        ready_timeout_s=READY_S,
    )
    return ManagedProcess(spec)


def url_of(server: ManagedProcess) -> str:
    assert server.spec.health_url is not None
    return server.spec.health_url.removesuffix("/health")


def attach_run(prefill: str, decode: str, model: str, run_dir: Path) -> tuple[subprocess.CompletedProcess, dict]:
    argv = [sys.executable, "-m", "harness", "e2e", "--prefill-url", prefill, "--decode-url", decode]
    argv += ["--tp-p", "1", "--tp-d", "2", "--device", "cpu", "--dtype", "float32", "--model", model]
    # the sequential prompts only: they carry the proof of transfer; the load phase is test_attach_cpu's.
    # A generous /health grace: D's two ranks share 2 cores with P and the baseline, and a slow answer is not a death.
    argv += ["--load-requests", "0", "--health-grace", "120", "--run-dir", str(run_dir)]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True, timeout=RUN_S)
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, json.loads((run_dir / "report.json").read_text())


@pytest.mark.full("a P/D pair started as upstream's scripts start one, D at TP 2 (about 8 min)")
def test_attach_to_an_upstream_style_pair_passes_and_names_where_the_baseline_differs(tmp_path):
    model = str(ensure_tiny_model())
    logs = tmp_path / "servers"
    logs.mkdir()
    run_dir = tmp_path / "run"
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        prefill = upstream_server("prefill", model, 1, alloc, logs)
        decode = upstream_server("decode", model, 2, alloc, logs)
        start_all([prefill, decode], stack, READY_S)
        proc, report = attach_run(url_of(prefill), url_of(decode), model, run_dir)
    assert processes_tagged(logs) == []  # the pair is gone with its owner
    assert processes_tagged(run_dir / "logs") == []  # and the run left nothing behind

    assert report["verdict"] == "pass" and proc.returncode == 0, report.get("reason") or proc.stdout[-3000:]
    checks = {c["name"]: c for c in report["checks"]}
    for name in (
        "prefill_returned_kv_transfer_params",
        "nixl_transfers_counted",
        "no_failed_transfers",
        "prompt_tokens_from_transfer",
        "outputs_match_baseline",
        "logprobs_match_baseline",
    ):
        assert checks[name]["passed"], checks[name]
    assert checks["nixl_transfers_counted"]["data"]["transfers"] >= report["config"]["prompts"]
    # the harness launched neither P nor D: only its proxy and its baseline (never a cached one in these tests)
    assert set(report["logs"]) == {"proxy", "baseline"}, report["logs"]

    # the servers' TP as given on the command line, said to be given
    config, attach = report["config"], report["config"]["attach"]
    assert (config["tp_p"], config["tp_d"]) == (1, 2)
    assert (attach["sources"]["tp_p"], attach["sources"]["tp_d"]) == ("--tp-p", "--tp-d")
    # what the baseline and the pair differ in, read from the pair's /metrics: vLLM's defaults against the harness's
    assert attach["differences"] == [
        {"setting": "block size", "baseline": "32", "servers": {"prefill": "128", "decode": "128"}},
        {"setting": "prefix caching", "baseline": "off", "servers": {"prefill": "on", "decode": "on"}},
        {"setting": "TP", "baseline": "2", "servers": {"prefill": "1"}},  # the baseline runs at D's TP
    ]
    assert attach["not_compared"] == []
    # and report.md says it to the people who read it
    md = (run_dir / "report.md").read_text()
    assert all(line in md for line in attach_markdown(attach, config) if line), md
