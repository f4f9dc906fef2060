"""The GPU side of a run against a fake NVML: placement into server commands, checks before and after a phase."""

import pytest

from harness.core.errors import ConfigError
from harness.gpu.nvml import GpuCheckFailed
from harness.gpu.run import GpuRun
from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, make_server
from harness.serve.ports import PortAllocator
from tests.unit.gpu.fake_nvml import FakeNvml, gpus

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def gpu_server(run: GpuRun, role: str, tp: int) -> WantedServer:
    """A server of TinyLlama at ``role`` placed by ``run``'s plan."""
    return WantedServer(
        role=role,
        tp=tp,
        model=TINYLLAMA,
        served_name=TINYLLAMA,
        block_size=None,
        cpu_bind=None,
        placement=run.placement(role),
    )


def test_p2_d8_on_eight_gpus_is_colocated_and_staggered():
    run = GpuRun(2, 8, TINYLLAMA, nvml=FakeNvml([gpus(8)]))
    assert run.plan.colocated and run.plan.stagger_start
    pre, dec = run.placement("prefill"), run.placement("decode")
    assert len(pre.gpus) == 2 and len(dec.gpus) == 8 and set(pre.gpus) <= set(dec.gpus)
    assert pre.gpu_memory_utilization + dec.gpu_memory_utilization <= 0.91


def test_no_driver_or_impossible_plan_is_a_config_error_before_launch():
    with pytest.raises(ConfigError, match="cannot be read"):
        GpuRun(1, 1, TINYLLAMA, nvml=FakeNvml(init_error="Driver Not Loaded"))
    with pytest.raises(ConfigError, match="no GPU placement"):
        GpuRun(1, 16, TINYLLAMA, nvml=FakeNvml([gpus(8)]))


def test_the_placement_reaches_the_server_command(tmp_path):
    run = GpuRun(2, 8, TINYLLAMA, nvml=FakeNvml([gpus(8)]))
    cfg = E2EConfig(device="gpu", model=TINYLLAMA, python="python3")
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(cfg, alloc, gpu_server(run, "prefill", 2), tmp_path)
    env = srv.proc.spec.env
    assert (
        env["CUDA_VISIBLE_DEVICES"] == run.placement("prefill").cuda_visible_devices
        and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"
    )
    argv = list(srv.proc.spec.argv)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == str(run.placement("prefill").gpu_memory_utilization)


def test_a_given_memory_utilization_reaches_the_server_through_the_plan(tmp_path):
    # the plan holds the run's value (checked against colocation there), so the server and the checks agree
    run = GpuRun(1, 1, TINYLLAMA, nvml=FakeNvml([gpus(2)]), gpu_memory_utilization=0.3)
    assert run.placement("decode").gpu_memory_utilization == 0.3
    cfg = E2EConfig(device="gpu", model=TINYLLAMA, python="python3", gpu_memory_utilization=0.3)
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(cfg, alloc, gpu_server(run, "decode", 1), tmp_path)
    argv = list(srv.proc.spec.argv)
    assert argv[argv.index("--gpu-memory-utilization") + 1] == "0.3"


def test_before_refuses_a_busy_gpu_and_after_waits_for_release():
    busy = gpus(2)
    busy[1].free_gib, busy[1].pids = 1.0, [999]
    run = GpuRun(1, 1, TINYLLAMA, nvml=FakeNvml([gpus(2), busy]))
    with pytest.raises(GpuCheckFailed, match="GPU 1 .*held by PIDs 999"):
        run.before("pd")

    held = gpus(2, pids=[4242])
    sleeps: list[float] = []
    # NVML sessions: the plan, before(), then two polls with our PID still on the GPUs, then released
    run = GpuRun(1, 1, TINYLLAMA, nvml=FakeNvml([gpus(2), gpus(2), held, held, gpus(2)]), sleep=sleeps.append)
    run.before("pd")
    run.after("pd", [4242])
    assert len(sleeps) == 2


def test_after_fails_this_run_when_the_gpus_stay_held():
    held = gpus(2, pids=[4242])
    run = GpuRun(1, 1, TINYLLAMA, nvml=FakeNvml([gpus(2), gpus(2), held]), release_timeout_s=0)
    run.before("pd")
    with pytest.raises(GpuCheckFailed, match="not released"):
        run.after("pd", [4242])
