"""D at data parallel 2: each DP engine must take transfers of its own; the sum over engines could hide one that no
P reached (its own NIXL side channel)."""

import pytest

from harness.checks.transfer import XFER_COUNT, check_dp_engines_received
from harness.core.errors import ConfigError
from harness.run.config import E2EConfig
from harness.serve.axes import ServerAxes
from harness.serve.prometheus import parse_metrics


def metrics(per_engine: dict[str, int]) -> list:
    lines = [f'{XFER_COUNT}{{engine="{e}",model_name="m"}} {n}' for e, n in per_engine.items()]
    return parse_metrics("\n".join(lines) + "\n")


def test_every_engine_with_transfers_passes_and_says_each_count():
    check = check_dp_engines_received(metrics({"0": 0, "1": 0}), metrics({"0": 10, "1": 8}), 2)
    assert check.passed, check.detail
    assert check.detail == "D's transfers per DP engine: engine 0: 10, engine 1: 8"
    assert check.data == {"per_engine": {"0": 10.0, "1": 8.0}}


def test_an_engine_that_took_none_fails_though_the_sum_covers_every_request():
    check = check_dp_engines_received(metrics({"0": 0, "1": 0}), metrics({"0": 18, "1": 0}), 2)
    assert not check.passed and "engine 1: 0" in check.detail


def test_metrics_without_the_engine_label_are_unknown_never_a_pass():
    plain = parse_metrics(f'{XFER_COUNT}{{model_name="m"}} 18\n')
    check = check_dp_engines_received(plain, plain, 2)
    assert not check.passed and "transfers per DP engine unknown" in check.detail


def test_d_at_dp_2_binds_and_counts_its_ranks_times_its_engines():
    cfg = E2EConfig(tp_p=1, tp_d=2, axes=ServerAxes(data_parallel_size_d=2))
    assert (cfg.ranks("prefill"), cfg.ranks("decode"), cfg.ranks("baseline")) == (1, 4, 4)
    assert E2EConfig(tp_d=2).ranks("decode") == 2


@pytest.mark.parametrize("settings", [dict(device="gpu", model="org/m"), dict()])
def test_d_at_dp_2_is_refused_where_no_plan_places_its_engines(settings):
    from harness.hosts.placement import hosts_from_dict

    if not settings:  # D over two namespace hosts
        hosts = {
            "hosts": {"a": {"address": "10.201.0.2", "netns": "pdh-t-a"}, "b": {"address": "10.201.0.3", "netns": "b"}},
            "prefill": "a",
            "decode": ["a", "b"],
        }
        settings = dict(tp_d=2, hosts=hosts_from_dict(hosts))
    with pytest.raises(ConfigError, match="pipeline stages run on one CPU host so far"):
        E2EConfig(axes=ServerAxes(data_parallel_size_d=2), **settings)


def dp_metrics(usage: dict[str, float]) -> list:
    lines = []
    for e, u in usage.items():
        lines += [
            f'vllm:num_requests_running{{engine="{e}",model_name="m"}} 0.0',
            f'vllm:num_requests_waiting{{engine="{e}",model_name="m"}} 0.0',
            f'vllm:kv_cache_usage_perc{{engine="{e}",model_name="m"}} {u}',
            f'vllm:cache_config_info{{block_size="32",engine="{e}",model_name="m",num_gpu_blocks="100"}} 1.0',
        ]
    return parse_metrics("\n".join(lines) + "\n")


def test_a_dp_servers_leak_state_is_read_per_engine_so_one_engines_held_blocks_show():
    from harness.checks.leak import held_blocks, states_of

    states = states_of({"prefill": dp_metrics({"0": 0.0}), "decode": dp_metrics({"0": 0.0, "1": 0.25})})
    assert set(states) == {"prefill", "decode engine 0", "decode engine 1"}  # one engine: the server's own name
    assert held_blocks(states["decode engine 0"], None) == 0
    assert held_blocks(states["decode engine 1"], None) == 25  # of engine 1's own 100 blocks
