"""The GPU inventory (issue 23): NVML's GPUs through the caller's CUDA_VISIBLE_DEVICES, simulated boxes
(PD_HARNESS_SIMULATED_GPUS), and a gpu_memory_utilization given by hand applied within the plan."""

from __future__ import annotations

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.gpu import detect
from harness.gpu.nvml import GpuCheckFailed, discover
from harness.gpu.plan import ModelMemory, UtilizationError, plan_gpus, render_plan, uniform_gpus
from harness.gpu.run import GpuRun
from harness.gpu.visible import resolve_visible
from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, make_server
from harness.serve.ports import PortAllocator
from harness.simbox.box import SIMULATED_ENV, parse_box, sim_uuid
from tests.unit.gpu.fake_nvml import FakeGpu, FakeNvml, gpus

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
UUIDS = [sim_uuid(i) for i in range(8)]


@pytest.fixture(autouse=True)
def no_caller_settings(monkeypatch):
    for name in (SIMULATED_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "GPU_MEMORY_UTILIZATION"):
        monkeypatch.delenv(name, raising=False)


# --- CUDA_VISIBLE_DEVICES as CUDA reads it (pure) ---


@pytest.mark.parametrize(
    "raw, indices",
    [
        (None, tuple(range(8))),
        ("4,5,6,7", (4, 5, 6, 7)),
        (" 6, 4 ", (6, 4)),  # the caller's order is CUDA's order
        (f"{UUIDS[5]},{UUIDS[2]}", (5, 2)),
        (f"3,{UUIDS[1].upper()}", (3, 1)),
        ("", ()),  # set but empty: CUDA sees no GPU
    ],
)
def test_visible_devices_map_to_nvml_indices(raw, indices):
    v = resolve_visible(raw, UUIDS)
    assert v.problem is None and v.indices == indices


def test_a_unique_uuid_prefix_is_enough_as_for_cuda():
    uuids = ["GPU-8932f937-d72c-4106-c12f-20bd9faed9f6", "GPU-af7b61d8-3c55-ca3a-a955-82c69ed360fc"]
    assert resolve_visible("GPU-af7b", uuids).indices == (1,)


@pytest.mark.parametrize(
    "raw, what",
    [
        ("4,5,9", "'9' names no GPU (NVML lists 8, indices 0-7)"),
        ("4,4", "'4' repeats an earlier entry"),
        ("GPU-00000000", "matches 8 GPU UUIDs"),
        ("GPU-ffff", "matches no GPU UUID"),
        ("MIG-377e0049-554c-540b-93c6-d0976f8426cb", "is a MIG instance"),
        ("-1", "'-1' is neither a GPU index nor a GPU UUID"),
    ],
)
def test_entries_cuda_would_drop_are_refused_by_name(raw, what):
    v = resolve_visible(raw, UUIDS)
    assert v.problem is not None and what in v.problem and "CUDA would hide it" in v.problem and "\n" not in v.problem


def test_indices_on_a_mixed_host_need_pci_bus_order():
    names = ["NVIDIA H100 80GB HBM3"] * 4 + ["NVIDIA L4"] * 4
    assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in (resolve_visible("4,5", UUIDS, names).problem or "")
    assert resolve_visible("4,5", UUIDS, names, order="PCI_BUS_ID").problem is None
    assert resolve_visible(UUIDS[4], UUIDS, names).problem is None  # a UUID is never ambiguous


# --- discovery and detection restricted to the caller's GPUs ---


def test_discover_lists_only_the_callers_gpus_with_physical_ids():
    fake = FakeNvml([gpus(8)])
    d = discover(fake, env={"CUDA_VISIBLE_DEVICES": f"{UUIDS[6]},{UUIDS[7]},4,5", "CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    assert d.available and [g.index for g in d.gpus] == [6, 7, 4, 5] and d.host_count == 8
    assert [g.id for g in d.plan_gpus()] == [6, 7, 4, 5] and d.gpus[0].uuid == UUIDS[6]
    bad = discover(fake, env={"CUDA_VISIBLE_DEVICES": "4,12"})
    assert not bad.available and "'12' names no GPU" in (bad.reason or "")


@pytest.mark.parametrize(
    "spec, count, total, name",
    [
        ("8x80", 8, 80.0, "NVIDIA H100 80GB HBM3"),
        ("8x40", 8, 40.0, "NVIDIA A100-SXM4-40GB"),
        ("8x80:visible=4,5,6,7", 4, 80.0, "NVIDIA H100 80GB HBM3"),
        ("2x141:name=NVIDIA H200:free=100", 2, 141.0, "NVIDIA H200"),
    ],
)
def test_the_switch_makes_nvml_answer_from_a_simulated_box(monkeypatch, spec, count, total, name):
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: pytest.fail("the real pynvml was asked"))
    monkeypatch.setenv(SIMULATED_ENV, spec)
    d = discover()
    assert d.available and d.count == count and d.simulated == spec
    assert {g.total_gib for g in d.gpus} == {total} and {g.name for g in d.gpus} == {name}
    assert detect.has_nvidia_gpu() and detect.count_gpus() == count


def test_the_switch_off_or_bad_or_unreadable(monkeypatch):
    monkeypatch.setenv(SIMULATED_ENV, "unreadable")
    d = discover()
    assert not d.available and (d.reason or "").startswith("no NVIDIA driver") and "simulated" in d.describe()
    assert detect.count_gpus() == 0
    monkeypatch.setenv(SIMULATED_ENV, "eight")
    d = discover()
    assert not d.available and f"{SIMULATED_ENV}='eight' is not a GPU box" in (d.reason or "")
    for bad in ("8x80:free=90", "8x80:colour=red", "0x80"):
        with pytest.raises(ValueError):
            parse_box(bad)
    monkeypatch.delenv(SIMULATED_ENV)
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: FakeNvml([gpus(3)]))
    assert discover().count == 3 and discover().simulated is None  # unset: the real NVML (here a stand-in)


def test_a_caller_visible_devices_applies_to_a_simulated_box_without_visible(monkeypatch):
    monkeypatch.setenv(SIMULATED_ENV, "8x80")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert [g.index for g in discover().gpus] == [2, 3] and detect.count_gpus() == 2


# --- the P2+D8 plan on each box ---


@pytest.mark.parametrize(
    "spec, ids, total",
    [
        ("8x80", list(range(8)), 80.0),
        ("8x40", list(range(8)), 40.0),
    ],
)
def test_p2_d8_plan_takes_count_and_memory_from_nvml(monkeypatch, spec, ids, total):
    monkeypatch.setenv(SIMULATED_ENV, spec)
    run = GpuRun(2, 8, TINYLLAMA)
    assert [g.id for g in run.plan.gpus] == ids and {g.total_gib for g in run.plan.gpus} == {total}
    assert run.placement("prefill").gpu_memory_utilization == run.placement("decode").gpu_memory_utilization == 0.45
    assert max(run.plan.required_free_gib().values()) == pytest.approx(0.9 * total)
    run.before("baseline")  # 0.9 x 40 = 36 GiB of the 39.5 free: ready (on 80 GiB it wanted 72)
    run.before("pd")
    assert "(NVIDIA " in render_plan(run.plan).splitlines()[0]


def test_p2_d8_on_4_of_8_is_planned_and_launched_on_the_callers_gpus(monkeypatch, tmp_path):
    monkeypatch.setenv(SIMULATED_ENV, "8x80:visible=4,5,6,7")
    with pytest.raises(ConfigError, match="largest TP here is 4"):
        GpuRun(2, 8, TINYLLAMA)
    run = GpuRun(2, 4, TINYLLAMA)
    assert run.placement("prefill").gpus == (4, 5) and run.placement("decode").gpus == (6, 7, 4, 5)
    cfg = E2EConfig(device="gpu", model=TINYLLAMA, python="python3")
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        want = WantedServer(
            role="decode",
            tp=4,
            model=TINYLLAMA,
            served_name=TINYLLAMA,
            block_size=None,
            cpu_bind=None,
            placement=run.placement("decode"),
        )
        srv = make_server(cfg, alloc, want, tmp_path)
    env = srv.proc.spec.env
    assert env["CUDA_VISIBLE_DEVICES"] == "6,7,4,5" and env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID"


def test_the_checks_look_at_the_physical_gpus_of_the_plan(monkeypatch):
    box = [FakeGpu(80, 1.0, [999]) for _ in range(4)] + [FakeGpu(80, 79.0) for _ in range(4)]
    fake = FakeNvml([box])
    env = {"CUDA_VISIBLE_DEVICES": "4,5,6,7"}
    run = GpuRun(1, 1, TINYLLAMA, nvml=fake, env=env, release_timeout_s=0)
    run.before("pd")  # GPUs 0-3 are someone else's and full: not ours to check
    box[4].free_gib, box[4].pids = 2.0, [4242]
    with pytest.raises(GpuCheckFailed, match="GPU 4 .*4242"):
        run.before("pd")
    with pytest.raises(GpuCheckFailed, match="GPU 4: PIDs 4242 still running"):
        run.after("pd", [4242])


def test_unreadable_box_stops_a_gpu_run_with_one_line(monkeypatch):
    monkeypatch.setenv(SIMULATED_ENV, "unreadable")
    with pytest.raises(ConfigError, match="^--device gpu, but the GPUs cannot be read: no NVIDIA driver"):
        GpuRun(2, 8, TINYLLAMA)


# --- a gpu_memory_utilization given by hand ---


def test_a_given_share_is_every_servers_and_refused_where_shared_gpus_cannot_hold_it():
    tiny = ModelMemory(2.05, "given")
    with pytest.raises(UtilizationError) as e:
        plan_gpus(uniform_gpus(8, 80), 2, 8, tiny, util=0.8)
    assert str(e.value) == (
        "GPUs 0,1 are shared by prefill0 and decode0: 2 x 0.8 = 1.60 > 0.9 per GPU; give at most "
        "0.45, or leave it unset (the plan then splits 0.9 between them)"
    )
    plan = plan_gpus(uniform_gpus(8, 80), 2, 8, tiny, util=0.4)
    assert {s.gpu_memory_utilization for s in plan.servers} == {0.4} and plan.util_given == 0.4
    free = plan.required_free_gib("pd")
    assert free[0] == pytest.approx(0.8 * 80) and free[2] == pytest.approx(0.4 * 80)
    alone = plan_gpus(uniform_gpus(8, 80), 2, 4, tiny, util=0.95)  # disjoint GPUs: vLLM's own range
    assert {s.gpu_memory_utilization for s in alone.servers} == {0.95}
    with pytest.raises(UtilizationError, match="prefill0 .*give at least 0.13, or leave it unset"):
        plan_gpus(uniform_gpus(8, 40), 2, 8, tiny, util=0.05)


def test_gpu_run_checks_the_share_the_servers_are_given():
    # 66 GiB free of 80: the plan's split (0.45 + 0.45 = 72 GiB on GPUs 0, 1) is short; a given 0.4 (64 GiB) is not.
    fake = FakeNvml([gpus(8, free_gib=66.0)])
    with pytest.raises(GpuCheckFailed, match="the plan needs 72.0"):
        GpuRun(2, 8, TINYLLAMA, nvml=fake).before("pd")
    run = GpuRun(2, 8, TINYLLAMA, nvml=fake, gpu_memory_utilization=0.4)
    assert run.placement("prefill").gpu_memory_utilization == 0.4
    run.before("pd")
    with pytest.raises(ConfigError) as e:
        GpuRun(2, 8, TINYLLAMA, nvml=fake, gpu_memory_utilization=0.8)
    msg = str(e.value)
    assert (
        msg.startswith(
            "gpu_memory_utilization 0.8 (--gpu-memory-utilization or GPU_MEMORY_UTILIZATION) does not "
            "fit P TP2 + D TP8 here: GPUs 0,1 are shared"
        )
        and "\n" not in msg
    )


def test_the_plan_command_takes_the_share_and_the_simulated_box(capsys, monkeypatch):
    monkeypatch.setenv(SIMULATED_ENV, "8x80:visible=4,5,6,7")
    assert main(["plan", "--tp-p", "1", "--tp-d", "2", "--model", TINYLLAMA]) == 0
    out = capsys.readouterr().out
    assert "GPU plan: 4 GPUs (ids 4,5,6,7) x 80 GiB (NVIDIA H100 80GB HBM3)" in out and "prefill0     1  4 " in out
    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.8")
    assert main(["plan", "--gpus", "8", "--tp-p", "2", "--tp-d", "8", "--model", TINYLLAMA]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: GPUs 0,1 are shared by prefill0 and decode0") and err.count("\n") == 1
    assert main(["plan", "--gpus", "8", "--tp-p", "2", "--tp-d", "8", "--gpu-memory-utilization", "0.3"]) == 0
    assert "0.30" in capsys.readouterr().out
