import re
from dataclasses import replace

import pytest

from harness.cli import build_parser, config_from_args, main
from harness.core.errors import ConfigError
from harness.run.config import E2EConfig, env_defaults


def cfg(argv, env=None):
    return config_from_args(build_parser().parse_args(["e2e", *argv]), env=env or {})


def test_defaults_tiny_model_tp_1_1():
    c = cfg(["--device", "cpu"])
    assert (c.tp_p, c.tp_d, c.model, c.device) == (1, 1, None, "cpu")
    assert c.block_sizes() == (32, 32) and c.lease_s == 120


def test_upstream_env_names_are_defaults_and_flags_win():
    env = {
        "PREFILLER_TP_SIZE": "2",
        "DECODER_TP_SIZE": "8",
        "DECODE_BLOCK_SIZE": "64",
        "DECODER_KV_LAYOUT": "HND",
        "GPU_MEMORY_UTILIZATION": "0.2",
    }
    c = cfg(["--device", "cpu"], env)
    assert (c.tp_p, c.tp_d, c.block_size_d, c.kv_layout_d, c.gpu_memory_utilization) == (2, 8, 64, "HND", 0.2)
    assert cfg(["--device", "cpu", "--tp-d", "4"], env).tp_d == 4


@pytest.mark.parametrize("env", [{"DECODER_TP_SIZE": "x"}, {"DECODER_TP_SIZE": "0"}, {"DECODER_KV_LAYOUT": "ABC"}])
def test_bad_env_values_are_errors(env):
    with pytest.raises(ConfigError):
        cfg(["--device", "cpu"], env)


def test_block_sizes_must_divide():
    with pytest.raises(ConfigError, match="divide"):
        cfg(["--device", "cpu", "--block-size-p", "64", "--block-size-d", "96"])


def test_gpu_needs_a_model_when_its_servers_are_made():
    # a matrix's shared GPU config names no model (each pair brings its own); a run launched from it needs one
    from harness.run.launch import resolve_model

    with pytest.raises(ConfigError, match="--model is required on GPU"):
        resolve_model(E2EConfig(device="gpu"))
    assert resolve_model(E2EConfig(device="gpu", model="org/m")) == ("org/m", "org/m")


def test_bad_flags_exit_2(capsys):
    with pytest.raises(SystemExit) as e:
        main(["e2e", "--tp-p", "0"])
    assert e.value.code == 2
    assert main(["e2e", "--device", "cpu", "--block-size-p", "64", "--block-size-d", "96"]) == 2
    assert "divide" in capsys.readouterr().err


def test_env_defaults_ignores_empty():
    assert env_defaults({"PREFILLER_TP_SIZE": ""}) == {}


def test_vllm_version_selects_an_environment_and_conflicts_with_python(monkeypatch):
    monkeypatch.setattr(
        "harness.envs.vllm_env.ensure_env",
        lambda device, version, lm_eval=False: f"/envs/{device}-{version}{'-lm' if lm_eval else ''}/bin/python",
    )
    assert cfg(["--device", "cpu", "--vllm-version", "0.21.0"]).python == "/envs/cpu-0.21.0/bin/python"
    # an accuracy run's lm-eval runs with the serving interpreter: its environment must have it
    assert cfg(["--device", "cpu", "--vllm-version", "0.21.0", "--accuracy"]).python == "/envs/cpu-0.21.0-lm/bin/python"
    assert cfg(["--device", "cpu"], {"VLLM_VERSION": "0.21.0"}).python == "/envs/cpu-0.21.0/bin/python"
    with pytest.raises(ConfigError, match="not both"):
        cfg(["--device", "cpu", "--vllm-version", "0.21.0", "--python", "/usr/bin/python3"])
    with pytest.raises(ConfigError, match="one vLLM version"):
        cfg(["--device", "cpu", "--vllm-version", "0.21.0,0.32.0"])
    with pytest.raises(ConfigError, match="not a version number"):
        cfg(["--device", "cpu", "--vllm-version", "latest"])


def test_matrix_with_a_bad_version_launches_nothing(capsys):
    assert main(["matrix", "--vllm-version", "0.21;x", "--device", "cpu"]) == 2
    assert "not a version number" in capsys.readouterr().err


def test_accuracy_flags_build_settings_and_stay_off_by_default():
    assert cfg(["--device", "cpu"]).accuracy is None
    a = cfg(
        ["--device", "cpu", "--accuracy", "--accuracy-limit", "40", "--num-fewshot", "2", "--request-timeout", "90"]
    ).accuracy
    assert (a.task, a.limit, a.num_fewshot, a.request_timeout_s) == (None, 40, 2, 90.0)  # the task follows the model
    assert (
        cfg(["--device", "cpu", "--accuracy-task", "gsm8k"]).accuracy.task == "gsm8k"
    )  # a task flag implies --accuracy
    with pytest.raises(ConfigError):
        cfg(["--device", "cpu", "--num-fewshot", "-1"])


def test_proxy_faults_are_the_proxys_own():
    import toy_proxy_server
    from harness.run.config import HARNESS_PROXY_FAULTS, PROXY_FAULTS

    assert set(PROXY_FAULTS) | set(HARNESS_PROXY_FAULTS) == set(toy_proxy_server.FAULTS)
    assert cfg(["--device", "cpu", "--proxy-fault", "corrupt-block-ids"]).proxy_fault == "corrupt-block-ids"
    with pytest.raises(ConfigError):
        E2EConfig(proxy_fault="drop-everything").validate()


def test_edge_axis_flags_reach_the_run_and_only_d_gets_the_prefix_cache(tmp_path):
    from harness.run.launch import WantedServer, make_server
    from harness.serve.ports import PortAllocator

    c = cfg(["--device", "cpu", "--kv-cache-dtype", "fp8", "--prefix-caching-d", "--no-async-scheduling"])
    assert (c.axes.kv_cache_dtype, c.axes.prefix_caching_d, c.axes.async_scheduling) == ("fp8", True, False)
    assert cfg(["--device", "cpu"]).axes.set() == {}
    with PortAllocator() as alloc:
        cmds = {
            role: make_server(
                c,
                alloc,
                WantedServer(role=role, tp=1, model="/m", served_name="m", block_size=32, cpu_bind=None),
                tmp_path,
            ).command
            for role in ("prefill", "decode", "baseline")
        }
    assert all("--kv-cache-dtype fp8" in x for x in cmds.values())
    assert "--enable-prefix-caching" in cmds["decode"]
    assert "--no-enable-prefix-caching" in cmds["prefill"] and "--no-enable-prefix-caching" in cmds["baseline"]
    with pytest.raises(SystemExit):
        cfg(["--device", "cpu", "--kv-cache-dtype", "fp9"])


def test_attach_config_takes_the_servers_settings_not_this_hosts(monkeypatch):
    from harness.cli import attach_config, attach_from_args
    from harness.serve.servers import Served

    monkeypatch.setattr("harness.gpu.detect.has_nvidia_gpu", lambda *a, **k: False)
    a = build_parser().parse_args(
        [
            "e2e",
            "--prefill-url",
            "http://10.0.0.5:8000",
            "--decode-url",
            "http://10.0.0.6:8000",
            "--baseline-url",
            "http://10.0.0.7:8000",
        ]
    )
    attach = attach_from_args(a)
    said = tuple(Served(u, "/models/m", "m", 8192, "gpu", "bfloat16") for u in attach.urls)
    c, attach = attach_config(a, replace(attach, served=said), env={})
    assert (c.device, c.dtype, c.model_len, c.model, c.logprob_limit) == ("gpu", "bfloat16", 8192, "/models/m", 1.5)
    assert attach.sources["model"] == "http://10.0.0.6:8000/v1/models"
    with pytest.raises(ConfigError, match="give --device"):
        attach_config(a, replace(attach, served=tuple(replace(s, device=None) for s in said)), env={})


@pytest.mark.parametrize(
    "extra,named",
    [
        (["--no-kv-digest"], "--no-kv-digest"),
        (["--accuracy"], "--accuracy"),
        (["--load-requests", "4"], "--load-requests > 0"),
        (["--prefix-caching-d"], "--prefix-caching-d"),
    ],
)
def test_no_baseline_is_refused_with_what_needs_a_baseline(extra, named):
    # without a baseline only the digest judges: whatever compares with a baseline, or turns the digest off, is refused
    base = ["--no-baseline", "--load-requests", "0"]
    with pytest.raises(ConfigError, match=re.escape(named)):
        cfg([*base, *extra])
    assert cfg(base).baseline is False


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--request-timeout", "-5"], "--request-timeout"),
        (["--ready-timeout", "0"], "--ready-timeout"),
        (["--logprob-threshold", "-1"], "--logprob-threshold"),
        (["--nixl-progress-delay-us", "-100"], "--nixl-progress-delay-us"),
        (["--decode-kv-fault=-1e9"], "--decode-kv-fault"),
        (["--decode-kv-fault=nan"], "--decode-kv-fault"),
        (["--python", "/nonexistent/python3"], "--python"),
        (["--gpu-memory-utilization", "5"], "--gpu-memory-utilization"),
    ],
)
def test_a_flag_value_that_cannot_work_is_refused_in_one_line_before_any_server(argv, says):
    with pytest.raises(ConfigError) as e:
        cfg(["--device", "cpu", *argv])
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_same_bounds_hold_for_a_config_built_in_code_or_from_yaml():
    with pytest.raises(ConfigError, match="--gpu-memory-utilization"):
        replace(E2EConfig(), gpu_memory_utilization=5.0).validate()
    with pytest.raises(ConfigError, match="GPU_MEMORY_UTILIZATION"):
        env_defaults({"GPU_MEMORY_UTILIZATION": "5"})
