"""Failure mapping of a server that failed during start-up: its log decides between server-exited and unsupported."""

from pathlib import Path

from harness.run.failures import process_failure
from harness.serve.procs import ProcessFailed

REFUSAL = (
    "(EngineCore pid=1) ERROR [core.py:1510] EngineCore failed to start.\n"
    "(EngineCore pid=1) ERROR [core.py:1510] ValueError: VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set; "
    "valid layouts: ['LBHNC'].\n"
)


def failed(tail: str) -> ProcessFailed:
    return ProcessFailed("decode", "fatal log line: EngineCore failed to start.", None, Path("decode.log"), tail)


def test_a_setting_vllm_refuses_at_start_up_is_unsupported_with_its_message():
    f = process_failure(failed(REFUSAL), {"decode": REFUSAL})
    assert f["class"] == "unsupported" and "VLLM_KV_CACHE_LAYOUT=NHD" in f["excerpt"] and f["source"] == "decode"


def test_another_start_up_failure_stays_server_exited_with_its_signature():
    log = "ValidationError: 1 validation error for ModelConfig\n"
    f = process_failure(failed(log), {"decode": log})
    assert (f["class"], f["signature"]) == ("server-exited", "config-error")


LEASE = (
    "prefill: WARNING Releasing expired KV blocks for request cmpl-pd-load038-0 which were retrieved by 0 remote "
    "worker(s)"
)


def test_a_lease_expiry_the_checks_explained_is_not_the_cause_of_a_mismatch():
    """The corrupt-block-ids run: a faulted request's read failed and P held its blocks until the lease; the run
    fails on its outputs, and that is its class."""
    from harness.checks.check import Check
    from harness.run.failures import from_checks

    mismatch = Check("load_outputs_match_baseline", False, "5 mismatched")
    explained = Check(
        "no_kv_lease_expiry",
        True,
        "no KV block lease expired (1 other(s) expired for requests the proxy fault changed)",
    )
    failure = from_checks([mismatch, explained], {"prefill": LEASE}, [])
    assert failure is not None and failure["class"] == "output-mismatch"
    unexplained = Check("no_kv_lease_expiry", False, "1 lease-expiry lines")
    failure = from_checks([mismatch, unexplained], {"prefill": LEASE}, [])
    assert failure is not None and failure["class"] == "kv-lease-expired"


HANDSHAKE = (
    "(Worker_TP0 pid=7) ERROR 12-05 10:00:05 [base_worker.py:1261] NIXL transfer failure: handshake_setup_failed | "
    "Context: {'remote_engine_id': 'e1'}\n"
    "(Worker_TP0 pid=7) Traceback (most recent call last):\n"
    '(Worker_TP0 pid=7)   File "zmq/backend/cython/_zmq.py", line 1212, in zmq.backend.cython._zmq.Socket.recv\n'
    "(Worker_TP0 pid=7) zmq.error.Again: Resource temporarily unavailable\n"
)


def test_a_handshake_that_keeps_failing_is_a_handshake_timeout_from_ds_log():
    """D stopped on its third failed handshake (a side channel nothing answers on), after it had been serving."""
    e = ProcessFailed(
        "decode",
        "fatal log line: NIXL transfer failure: handshake_setup_failed | ... (seen 3 times)",
        None,
        Path("decode.log"),
        HANDSHAKE * 3,
        after_ready=True,
    )
    f = process_failure(e, {"prefill": "INFO ready\n", "decode": HANDSHAKE * 3})
    assert (f["class"], f["source"]) == ("handshake-timeout", "decode") and "zmq.error.Again" in f["excerpt"]
    assert "seen 3 times" in f["reason"]
