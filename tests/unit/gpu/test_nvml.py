import pytest

from harness.gpu.nvml import GpuCheckFailed, GpuInfo, check_free, discover, wait_released
from harness.gpu.plan import ModelMemory, plan_gpus, uniform_gpus
from tests.unit.gpu.fake_nvml import FakeClock, FakeGpu, FakeNvml, gpus


def test_no_driver_is_a_result_not_a_crash():
    fake = FakeNvml(init_error="Driver Not Loaded")
    d = discover(fake)
    assert not d.available and d.count == 0
    assert d.reason == "no NVIDIA driver: Driver Not Loaded"


def test_the_real_pynvml_without_a_driver_says_so():
    d = discover()  # this test machine has no NVIDIA driver; on a GPU box it lists the GPUs
    assert d.available or (d.reason or "").startswith(("no NVIDIA driver", "nvidia-ml-py"))


def test_discover_lists_memory_names_and_pids():
    fake = FakeNvml([[FakeGpu(80, 70, [123, 456]), FakeGpu(80, 79.5, [], name="A100")]], bytes_names=True)
    d = discover(fake)
    assert d.available and d.count == 2 and d.driver == "580.65.06"
    g0, g1 = d.gpus
    assert (g0.index, g0.total_gib, g0.free_gib, g0.pids) == (0, 80, 70, (123, 456))
    assert g1.name == "A100"  # bytes from an older pynvml are decoded
    assert fake.open == 0  # the NVML session is closed again


def test_pid_query_refused_still_gives_memory():
    d = discover(FakeNvml([[FakeGpu(80, 60, [1], procs_error=True)]]))
    assert d.available and d.gpus[0].pids == () and d.gpus[0].free_gib == 60


def colocated_plan():
    return plan_gpus(uniform_gpus(8, 80), 2, 8, ModelMemory(2.0, "given"))  # needs 72 GiB free on every GPU


def infos(free, pids=()):
    return [GpuInfo(i, "H100", 80, f, tuple(pids) if i == 0 else ()) for i, f in enumerate(free)]


def test_check_free_passes_with_enough_memory():
    check_free(colocated_plan(), infos([79.0] * 8))


def test_check_free_names_the_short_gpu_and_who_holds_it():
    with pytest.raises(GpuCheckFailed) as e:
        check_free(colocated_plan(), infos([40.0] + [79.0] * 7, pids=[4242]))
    msg = str(e.value)
    assert "GPU 0 (H100) has 40.0 GiB free of 80.0, the plan needs 72.0" in msg and "4242" in msg
    assert "GPU 1" not in msg


def test_check_free_of_one_phase_and_missing_gpus():
    free = infos([79.0, 79.0] + [40.0] * 6)
    check_free(colocated_plan(), free, phase="pd")  # P/D: 0.45 + 0.45 on GPUs 0, 1, only D's 0.45 on the others
    with pytest.raises(GpuCheckFailed, match="GPU 2 "):
        check_free(colocated_plan(), free)  # the baseline takes 0.9 of every GPU
    with pytest.raises(GpuCheckFailed, match="GPU 7 is not present"):
        check_free(colocated_plan(), infos([79.0] * 7))


def test_wait_released_returns_once_pids_leave_and_memory_is_back():
    states = [
        gpus(2, free_gib=40.0, pids=[11, 12]),
        gpus(2, free_gib=60.0, pids=[12]),
        gpus(2, free_gib=79.0, pids=[99]),
    ]
    fake, clock = FakeNvml(states), FakeClock()
    wait_released(
        [11, 12], [0, 1], timeout_s=60, free_before={0: 79.0, 1: 79.0}, nvml=fake, clock=clock, sleep=clock.sleep
    )
    assert fake.sessions == 3 and clock.sleeps == 2  # PID 99 is not ours and does not hold us up


def test_wait_released_waits_for_memory_even_when_pids_are_gone():
    states = [gpus(1, free_gib=30.0), gpus(1, free_gib=78.5)]  # within the 1 GiB tolerance of 79
    fake, clock = FakeNvml(states), FakeClock()
    wait_released([11], [0], timeout_s=60, free_before={0: 79.0}, nvml=fake, clock=clock, sleep=clock.sleep)
    assert fake.sessions == 2


def test_wait_released_times_out_naming_what_is_still_held():
    fake, clock = FakeNvml([gpus(2, free_gib=40.0, pids=[11])]), FakeClock()
    with pytest.raises(GpuCheckFailed) as e:
        wait_released(
            [11], [0, 1], timeout_s=10, free_before={0: 79.0, 1: 79.0}, nvml=fake, clock=clock, sleep=clock.sleep
        )
    msg = str(e.value)
    assert (
        "after 10 s" in msg and "GPU 0: PIDs 11 still running" in msg and "GPU 1: 40.0 GiB free, expected 79.0" in msg
    )
    assert fake.open == 0


def test_wait_released_without_a_driver_fails_clearly():
    with pytest.raises(GpuCheckFailed, match="no NVIDIA driver"):
        wait_released([1], [0], timeout_s=5, nvml=FakeNvml(init_error="Driver Not Loaded"))
