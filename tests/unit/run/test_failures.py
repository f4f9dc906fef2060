"""Failure mapping of a server that failed during start-up: its log decides between server-exited and unsupported."""

from pathlib import Path

from harness.run.failures import process_failure
from harness.serve.procs import ProcessFailed

REFUSAL = ("(EngineCore pid=1) ERROR [core.py:1510] EngineCore failed to start.\n"
           "(EngineCore pid=1) ERROR [core.py:1510] ValueError: VLLM_KV_CACHE_LAYOUT=NHD does not satisfy every supported set; "
           "valid layouts: ['LBHNC'].\n")


def failed(tail: str) -> ProcessFailed:
    return ProcessFailed("decode", "fatal log line: EngineCore failed to start.", None, Path("decode.log"), tail)


def test_a_setting_vllm_refuses_at_start_up_is_unsupported_with_its_message():
    f = process_failure(failed(REFUSAL), {"decode": REFUSAL})
    assert f["class"] == "unsupported" and "VLLM_KV_CACHE_LAYOUT=NHD" in f["excerpt"] and f["source"] == "decode"


def test_another_start_up_failure_stays_server_exited_with_its_signature():
    log = "ValidationError: 1 validation error for ModelConfig\n"
    f = process_failure(failed(log), {"decode": log})
    assert (f["class"], f["signature"]) == ("server-exited", "config-error")
