"""The load phase's flags: on by default, sized for CPU, a small KV pool only when it runs, bad values refused."""

import pytest

from harness.cli import build_parser, config_from_args, main
from harness.core.errors import ConfigError
from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, make_server
from harness.serve.ports import PortAllocator
from harness.workload.load import LoadSettings


def cfg(argv):
    return config_from_args(build_parser().parse_args(["e2e", *argv]), env={})


def test_the_load_phase_is_on_by_default_with_a_small_pool():
    c = cfg([])
    assert c.load.enabled and c.load.requests == 96 and c.load.concurrency == 8 and c.load.abort_every == 8
    assert c.model_len == 512
    assert c.pool_blocks(32) == 32, "twice a longest request's blocks (512 / 32 = 16)"


def test_no_load_phase_means_vllms_own_pool_unless_asked():
    c = cfg(["--load-requests", "0"])
    assert not c.load.enabled and c.pool_blocks(32) is None
    assert cfg(["--load-requests", "0", "--kv-pool-blocks", "40"]).pool_blocks(32) == 40
    assert cfg(["--kv-pool-blocks", "0"]).pool_blocks(32) is None


def test_flags_reach_the_config():
    c = cfg(
        [
            "--load-requests",
            "10",
            "--load-concurrency",
            "2",
            "--load-abort-every",
            "0",
            "--max-model-len",
            "1024",
            "--proxy-fault-every",
            "16",
            "--logprob-threshold",
            "0.5",
        ]
    )
    assert (c.load.requests, c.load.concurrency, c.load.abort_every) == (10, 2, 0)
    assert c.model_len == 1024 and c.proxy_fault_every == 16 and c.logprob_limit == 0.5
    assert c.pool_blocks(32) == 64


def test_an_fp8_kv_cache_gets_the_threshold_of_its_measured_noise_unless_one_is_given():
    assert cfg([]).logprob_limit == 1e-3
    assert cfg(["--kv-cache-dtype", "fp8"]).logprob_limit == 2e-2
    assert cfg(["--kv-cache-dtype", "fp8_e5m2", "--logprob-threshold", "1e-3"]).logprob_limit == 1e-3


@pytest.mark.parametrize(
    "argv",
    [["--load-concurrency", "0"], ["--load-requests", "-1"], ["--proxy-fault-every", "0"], ["--kv-pool-blocks", "x"]],
)
def test_bad_load_flags_exit_2(argv, capsys):
    with pytest.raises(SystemExit) as e:
        main(["e2e", *argv])
    assert e.value.code == 2


def test_a_context_too_short_for_a_decode_abort_is_refused():
    with pytest.raises(ConfigError, match="abort_max_tokens"):
        E2EConfig(max_model_len=128).validate()
    E2EConfig(max_model_len=128, load=LoadSettings(requests=0)).validate()


def test_servers_get_the_pool_and_request_logging_only_where_aborts_need_it(tmp_path):
    c = E2EConfig(python="/py")
    with PortAllocator() as alloc:
        want = WantedServer(
            role="decode",
            tp=1,
            model="/m",
            served_name="m",
            block_size=32,
            cpu_bind=None,
            num_blocks=c.pool_blocks(32),
            log_requests=True,
        )
        srv = make_server(c, alloc, want, tmp_path)
    argv = srv.proc.spec.argv
    assert argv[argv.index("--num-gpu-blocks-override") + 1] == "32" and "--enable-log-requests" in argv
    assert argv[argv.index("--max-model-len") + 1] == "512"


def test_the_small_pool_holds_a_longest_request_twice_in_every_kv_cache_group():
    from harness.run.config import E2EConfig

    cfg = E2EConfig()  # load phase on, 512 tokens
    assert cfg.pool_blocks(32) == 32 and cfg.pool_blocks(32, kv_cache_groups=2) == 64  # Gemma 3: sliding + full layers
    assert E2EConfig(kv_pool_blocks=40).pool_blocks(32, kv_cache_groups=2) == 40  # asked for: as asked
