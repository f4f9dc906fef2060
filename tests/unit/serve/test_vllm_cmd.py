import json
from typing import Any

import pytest

from harness.serve.ports import ServerPorts
from harness.serve.vllm_cmd import API_SERVER_MODULE, CpuTuning, ServerSpec, build_server_command, plan_cpu_binding

PORTS = ServerPorts(http=21000, side_channel_base=21010, internal_base=21100, internal_count=16)


def cmd(role="decode", **kw):
    spec = ServerSpec(role=role, model="/m", served_model_name="m", **kw)
    return build_server_command(spec, PORTS, "/py", CpuTuning(), base_env={})


def arg(c, flag):
    return c.argv[c.argv.index(flag) + 1]


def test_module_entry_point_not_console_script():
    c = cmd()
    assert c.argv[:3] == ("/py", "-m", API_SERVER_MODULE)


def test_binds_loopback_and_allocated_ports():
    c = cmd()
    assert arg(c, "--host") == "127.0.0.1"
    assert arg(c, "--port") == "21000"
    assert c.env["VLLM_PORT"] == "21100"
    assert c.env["VLLM_NIXL_SIDE_CHANNEL_PORT"] == "21010"
    assert c.env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "127.0.0.1"


@pytest.mark.parametrize("role,kv_role", [("prefill", "kv_producer"), ("decode", "kv_consumer")])
def test_role_appropriate_kv_role_and_fail_policy(role, kv_role):
    cfg = json.loads(arg(cmd(role), "--kv-transfer-config"))
    assert cfg["kv_connector"] == "NixlConnector"
    assert cfg["kv_role"] == kv_role
    assert cfg["kv_load_failure_policy"] == "fail"
    assert cfg["kv_buffer_device"] == "cpu"


def test_baseline_has_no_kv_transfer():
    c = cmd("baseline")
    assert "--kv-transfer-config" not in c.argv
    assert "VLLM_NIXL_SIDE_CHANNEL_PORT" not in c.env
    assert "PD_HARNESS_NIXL_PTHR_DELAY_US" not in c.env


def test_kv_both_and_lease():
    cfg = json.loads(arg(cmd("prefill", kv_roles="both", kv_lease_s=120), "--kv-transfer-config"))
    assert cfg["kv_role"] == "kv_both"
    assert cfg["kv_connector_extra_config"] == {"kv_lease_duration": 120}


def test_cpu_tuning_injected_and_opt_out():
    on = cmd()
    assert on.env["PD_HARNESS_NIXL_PTHR_DELAY_US"] == "1000"
    assert on.env["PD_HARNESS_SKIP_NIXL_PINNING"] == "1"
    assert on.env["PD_HARNESS_SHM_BUSY_LOOP_S"] == "0.0" and on.env["PD_HARNESS_SHM_RECHECK_MS"] == "20"
    assert on.env["PD_HARNESS_ENGINE_IDLE_SLEEP_MS"] == "10"
    stock = build_server_command(
        ServerSpec(role="decode", model="/m", served_model_name="m"),
        PORTS,
        "/py",
        CpuTuning(shm_busy_loop_s=None, shm_recheck_ms=None, engine_idle_sleep_ms=None),
        base_env={},
    )
    assert not {"PD_HARNESS_SHM_BUSY_LOOP_S", "PD_HARNESS_SHM_RECHECK_MS", "PD_HARNESS_ENGINE_IDLE_SLEEP_MS"} & set(
        stock.env
    )
    assert on.env["PYTHONPATH"].endswith("cpu_tuning")
    spec = ServerSpec(role="decode", model="/m", served_model_name="m")
    off = build_server_command(spec, PORTS, "/py", CpuTuning(enabled=False), base_env={})
    assert "PYTHONPATH" not in off.env and "PD_HARNESS_NIXL_PTHR_DELAY_US" not in off.env


def test_existing_pythonpath_kept():
    spec = ServerSpec(role="decode", model="/m", served_model_name="m")
    c = build_server_command(spec, PORTS, "/py", CpuTuning(), base_env={"PYTHONPATH": "/x"})
    assert c.env["PYTHONPATH"].split(":")[-1] == "/x"


def test_gpu_spec_sets_devices_and_utilization():
    c = cmd(device="gpu", tp=2, gpus=(3, 4), gpu_memory_utilization=0.2, kv_layout="HND")
    assert c.env["CUDA_VISIBLE_DEVICES"] == "3,4"
    assert arg(c, "--gpu-memory-utilization") == "0.2"
    assert arg(c, "--tensor-parallel-size") == "2"
    assert c.env["VLLM_KV_CACHE_LAYOUT"] == "HND"
    assert json.loads(arg(c, "--kv-transfer-config"))["kv_buffer_device"] == "cuda"
    assert "VLLM_CPU_KVCACHE_SPACE" not in c.env


@pytest.mark.parametrize(
    "bad",
    [
        dict(role="router"),
        dict(tp=0),
        dict(block_size=0),
        dict(gpu_memory_utilization=1.5),
        dict(device="gpu", tp=2, gpus=(0,)),
    ],
)
def test_bad_specs_rejected(bad):
    kw: dict[str, Any] = dict(role="decode", model="/m", served_model_name="m")
    kw.update(bad)
    with pytest.raises(ValueError):
        ServerSpec(**kw)


def test_shell_rendering_is_quoted():
    s = cmd().shell()
    assert '\'{"kv_connector"' in s and "VLLM_PORT=21100" in s


@pytest.mark.parametrize(
    "cores,ranks,expected",
    [
        (2, [1, 1], ["0", "1"]),
        (2, [1, 2], ["0", "1|0"]),
        (4, [1, 1], ["0-1", "2-3"]),
        (8, [2, 2], ["0-1|2-3", "4-5|6-7"]),
        (1, [1, 1], ["0", "0"]),
    ],
)
def test_cpu_binding_plan(cores, ranks, expected):
    assert plan_cpu_binding(cores, ranks) == expected


def test_cpu_binding_rejects_nonsense():
    with pytest.raises(ValueError):
        plan_cpu_binding(0, [1])
    with pytest.raises(ValueError):
        plan_cpu_binding(2, [0])


def test_edge_axes_become_vllm_flags_and_connector_settings():
    c = cmd(
        kv_cache_dtype="fp8",
        async_scheduling=True,
        attention_backend="FLASH_ATTN",
        permute_local_kv=True,
        kv_buffer_device="cpu",
        prefix_caching=True,
    )
    assert arg(c, "--kv-cache-dtype") == "fp8" and arg(c, "--attention-backend") == "FLASH_ATTN"
    assert "--async-scheduling" in c.argv and "--enable-prefix-caching" in c.argv
    kv = json.loads(arg(c, "--kv-transfer-config"))
    assert kv["enable_permute_local_kv"] is True and kv["kv_buffer_device"] == "cpu"
    plain = cmd()
    assert not {"--kv-cache-dtype", "--attention-backend", "--async-scheduling", "--no-async-scheduling"} & set(
        plain.argv
    )
    assert "--no-enable-prefix-caching" in plain.argv
    assert "enable_permute_local_kv" not in json.loads(arg(plain, "--kv-transfer-config"))
    assert "--no-async-scheduling" in cmd(async_scheduling=False).argv


@pytest.mark.parametrize("role", ["baseline", "prefill", "decode"])
@pytest.mark.parametrize("device", ["cpu", "gpu"])
def test_every_server_runs_with_usage_reporting_off(role, device):
    # an axis that sets one of them otherwise cannot turn reporting back on
    kw = {"device": device, "extra_env": (("VLLM_NO_USAGE_STATS", "0"), ("DO_NOT_TRACK", "0"))}
    if device == "gpu":
        kw["gpus"] = (0,)
    c = cmd(role, **kw)
    for k in ("VLLM_NO_USAGE_STATS", "VLLM_DO_NOT_TRACK", "DO_NOT_TRACK"):
        assert c.env[k] == "1", k
        assert f"{k}=1" in c.shell()  # the report's command line shows it
