from harness.checks.transfer import check_decode_log, check_lease, check_nixl_metrics, check_prefill_params
from harness.serve.prometheus import parse_metrics


def metrics(xfers, failed=0.0, ext=0.0, expired=0.0):
    return parse_metrics(
        f'vllm:nixl_xfer_time_seconds_count{{engine="0"}} {xfers}\n'
        f'vllm:nixl_bytes_transferred_sum{{engine="0"}} {xfers * 100}\n'
        f'vllm:nixl_num_failed_transfers_total{{engine="0"}} {failed}\n'
        f'vllm:nixl_num_kv_expired_reqs_total{{engine="0"}} {expired}\n'
        f'vllm:prompt_tokens_by_source_total{{engine="0",source="external_kv_transfer"}} {ext}\n'
        f'vllm:prompt_tokens_by_source_total{{engine="0",source="local_compute"}} 999\n'
    )


def by_name(checks):
    return {c.name: c for c in checks}


def test_metrics_prove_transfer():
    c = by_name(check_nixl_metrics(metrics(2, ext=10), metrics(20, ext=110), requests_sent=18, prompt_tokens=100))
    assert all(x.passed for x in c.values()), c


def test_too_few_transfers_or_failures_fail():
    c = by_name(check_nixl_metrics(metrics(0), metrics(17, ext=100), 18, 100))
    assert not c["nixl_transfers_counted"].passed
    c = by_name(check_nixl_metrics(metrics(0), metrics(18, failed=1, ext=100), 18, 100))
    assert not c["no_failed_transfers"].passed
    c = by_name(check_nixl_metrics(metrics(0), metrics(18, expired=1, ext=100), 18, 100))
    assert not c["no_failed_transfers"].passed
    c = by_name(check_nixl_metrics(metrics(0), metrics(18, ext=50), 18, 100))
    assert not c["prompt_tokens_from_transfer"].passed


def test_missing_metrics_fail_with_reason():
    c = by_name(check_nixl_metrics([], [], 18, 100))
    assert not any(x.passed for x in c.values())
    assert "no vllm:nixl_xfer_time_seconds_count" in c["nixl_transfers_counted"].detail


def test_prefill_params_check():
    assert check_prefill_params(
        3, {"prefill_with_kv_transfer_params": 3, "prefill_missing_kv_transfer_params": 0}
    ).passed
    assert not check_prefill_params(
        3, {"prefill_with_kv_transfer_params": 2, "prefill_missing_kv_transfer_params": 1}
    ).passed
    assert not check_prefill_params(0, {}).passed


def test_decode_log_checks():
    log = (
        "INFO NIXL compatibility check passed (hash: x)\n"
        "INFO Transfer plan: TransferTopology(tp_ratio=2, num_kv_heads=1, local_tp=2, remote_tp=1)\n"
        "kv_transfer_config=KVTransferConfig(kv_load_failure_policy='fail')\n"
    )
    c = by_name(check_decode_log(log))
    assert c["transfer_plan_logged"].passed and "tp_ratio=2" in c["transfer_plan_logged"].detail
    assert c["kv_load_failure_policy_fail"].passed
    c = by_name(check_decode_log("kv_load_failure_policy='recompute'"))
    assert not c["transfer_plan_logged"].passed and not c["kv_load_failure_policy_fail"].passed


def test_lease_expiry_detected():
    assert check_lease({"prefill": "all fine", "decode": ""}).passed
    c = check_lease(
        {"prefill": "WARNING Releasing expired KV blocks for request r1 which were retrieved by 1 remote worker(s)"}
    )
    assert not c.passed and "prefill: Releasing expired" in c.detail
