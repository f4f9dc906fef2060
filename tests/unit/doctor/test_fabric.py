"""The doctor's fabric lines: a two-GPU NCCL all-reduce and NIXL's UCX transports, each through a fake probe (ok,
problem with the one thing to do, skipped), what the real probe makes of its subprocesses' output, and the
simulated boxes' fixed verdict."""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from pathlib import Path

import pytest

from harness.doctor import fabric
from harness.doctor.checks import NCCL_WHAT, OK, PROBLEM, SKIPPED, UCX_WHAT, UNCHECKED, diagnose
from harness.doctor.fabric import FAILED, HUNG, PASSED, NcclState, SubprocessFabric, UcxState
from harness.doctor.inventory import gather
from harness.doctor.needs import NightNeeds
from harness.simbox.box import SIMULATED_ENV, parse_box
from tests.unit.doctor.test_doctor import VENV, fake_repo

UCX_INFO_D = """#
# Memory domain: cuda_cpy
#     Component: cuda_cpy
#      Transport: cuda_copy
#         Device: cuda
#
# Memory domain: cuda_ipc
#      Transport: cuda_ipc
#         Device: cuda
#
# Memory domain: mlx5_0
#      Transport: rc_verbs
#         Device: mlx5_0:1
#      Transport: rc_mlx5
#         Device: mlx5_0:1
#      Transport: ud_verbs
"""
ALL = ("cuda_copy", "cuda_ipc", "rc_verbs", "rc_mlx5", "ud_verbs")
SOURCE = "`ucx_info -d` (/usr/bin/ucx_info, the system's UCX 1.18.0, not NIXL's own)"
MEM = ("DRAM_SEG", "VRAM_SEG")


class FakeFabric:
    """Answers as told and records what it was asked."""

    def __init__(self, nccl: NcclState | None = None, ucx: UcxState | None = None):
        self.nccl = nccl or NcclState(PASSED, "GPUs 0,1: both ranks summed to 3 (NCCL 2.27.3)", (0, 1))
        self.ucx = ucx or UcxState(PASSED, mem_types=MEM, transports=ALL, source=SOURCE)
        self.asked: list[tuple] = []

    def nccl_allreduce(self, gpu_ids: tuple[int, ...], env: Mapping[str, str]) -> NcclState:
        self.asked.append(("nccl", gpu_ids))
        return self.nccl

    def nixl_ucx(self, env: Mapping[str, str]) -> UcxState:
        self.asked.append(("ucx",))
        return self.ucx


@pytest.fixture
def root(tmp_path, monkeypatch):
    """A repository with .venv (a CUDA torch, as VENV says) and an HF cache."""
    monkeypatch.setattr("harness.doctor.inventory.probe_env", lambda name, version, python: VENV)
    return fake_repo(tmp_path, tmp_path / "hf", "Qwen/Qwen3-0.6B")


def lines(root: Path, probe: FakeFabric, spec: str = "8x80", **env: str) -> dict[str, tuple[str, str]]:
    """The fabric lines of a box NVML shows as ``spec`` (a real box to the doctor: no simulation switch)."""
    env = {"HF_HOME": str(root.parent / "hf"), **env}
    inv = gather(NightNeeds(()), env, nvml=parse_box(spec).module(), root=root, probe=probe)
    return {ln.what: (ln.status, ln.render()) for ln in diagnose(inv) if ln.what in (NCCL_WHAT, UCX_WHAT)}


def test_both_lines_ok_on_an_8_gpu_box_the_all_reduce_on_its_first_two(root):
    probe = FakeFabric()
    v = lines(root, probe)
    assert probe.asked == [("nccl", (0, 1)), ("ucx",)]
    assert v[NCCL_WHAT] == (OK, "ok        NCCL all-reduce: GPUs 0,1: both ranks summed to 3 (NCCL 2.27.3)")
    status, text = v[UCX_WHAT]
    assert status == OK and "cuda_ipc present, cuda_copy present, rc present, from `ucx_info -d` (" in text
    assert "not NIXL's own" in text and "NIXL agent with UCX made (DRAM_SEG, VRAM_SEG)" in text


def test_the_all_reduce_runs_on_the_callers_visible_gpus(root):
    probe = FakeFabric()
    lines(root, probe, "8x80", CUDA_VISIBLE_DEVICES="4,5,6,7")
    assert probe.asked[0] == ("nccl", (4, 5))


@pytest.mark.parametrize("outcome, word", [(FAILED, "failed"), (HUNG, "hung")])
def test_a_failed_or_hung_all_reduce_is_a_problem_that_says_to_try_without_p2p(root, outcome, word):
    status, text = lines(root, FakeFabric(NcclState(outcome, "rank 0: NCCL error", (0, 1))))[NCCL_WHAT]
    assert status == PROBLEM and text.startswith(f"problem   NCCL all-reduce: {word}: rank 0: NCCL error; do: ")
    assert "NCCL_P2P_DISABLE=1" in text and "check the driver" in text


def test_with_p2p_disabled_a_failure_says_check_the_driver_and_a_pass_says_p2p_untested(root):
    status, text = lines(root, FakeFabric(NcclState(FAILED, "boom", (0, 1), p2p_disabled=True)))[NCCL_WHAT]
    assert status == PROBLEM and "failed with NCCL_P2P_DISABLE=1: boom" in text
    assert text.endswith("do: check the driver (nvidia-smi) and rerun with NCCL_DEBUG=INFO")
    status, text = lines(root, FakeFabric(NcclState(PASSED, "GPUs 0,1: ok", (0, 1), p2p_disabled=True)))[NCCL_WHAT]
    assert status == OK and "peer-to-peer not tested (NCCL_P2P_DISABLE=1 is set)" in text


def test_cuda_ipc_listed_absent_is_a_problem_rc_absent_is_only_said(root):
    no_ipc = UcxState(PASSED, mem_types=MEM, transports=("cuda_copy", "tcp"), source=SOURCE)
    status, text = lines(root, FakeFabric(ucx=no_ipc))[UCX_WHAT]
    assert status == PROBLEM
    assert "cuda_ipc absent, cuda_copy present, rc absent (only KV between hosts needs rc)" in text
    assert "do: KV between this box's GPUs needs cuda_ipc: check the NVIDIA driver" in text
    no_rc = UcxState(PASSED, mem_types=MEM, transports=("cuda_copy", "cuda_ipc", "tcp"), source=SOURCE)
    status, text = lines(root, FakeFabric(ucx=no_rc))[UCX_WHAT]
    assert status == OK and "rc absent (only KV between hosts needs rc)" in text


def test_no_transport_source_is_unchecked_naming_nixls_bundled_modules(root):
    unlisted = UcxState(PASSED, mem_types=MEM, bundled=("cma", "cuda", "ib"))
    status, text = lines(root, FakeFabric(ucx=unlisted))[UCX_WHAT]
    assert status == UNCHECKED and "ucx_info is not on PATH" in text
    assert "NIXL's UCX ships the modules cma, cuda (cuda_copy, cuda_ipc), ib (rc, ud, dc)" in text


def test_no_nixl_agent_is_a_problem(root):
    no_nixl = UcxState(FAILED, "ModuleNotFoundError: No module named 'nixl'")
    status, text = lines(root, FakeFabric(ucx=no_nixl))[UCX_WHAT]
    assert status == PROBLEM and "no NIXL agent with UCX: ModuleNotFoundError" in text
    assert text.endswith("do: `make setup DEVICE=gpu` (nixl)")


def test_one_gpu_skips_the_all_reduce_with_the_reason_and_still_probes_ucx(root):
    probe = FakeFabric()
    v = lines(root, probe, "1x80")
    assert v[NCCL_WHAT] == (SKIPPED, "skipped   NCCL all-reduce: needs 2 GPUs, 1 visible")
    assert probe.asked == [("ucx",)] and v[UCX_WHAT][0] == OK


def test_a_cpu_torch_skips_the_all_reduce(root, monkeypatch):
    from dataclasses import replace

    monkeypatch.setattr("harness.doctor.inventory.probe_env", lambda *a: replace(VENV, torch_cuda=None))
    v = lines(root, FakeFabric())
    assert v[NCCL_WHAT][0] == SKIPPED and "not a CUDA build" in v[NCCL_WHAT][1]


def test_no_gpu_and_a_simulated_box_skip_both_lines_without_probing(root, monkeypatch):
    probe = FakeFabric()
    hf = str(root.parent / "hf")
    monkeypatch.setattr("harness.gpu.detect.has_nvidia_gpu", lambda env=None: bool(env and env.get(SIMULATED_ENV)))
    no_gpu = gather(NightNeeds(()), {"HF_HOME": hf}, root=root, probe=probe)
    sim = gather(NightNeeds(()), {"HF_HOME": hf, SIMULATED_ENV: "8x80"}, root=root, probe=probe)
    assert probe.asked == []
    for inv, why in ((no_gpu, "no NVIDIA GPU on this machine"), (sim, f"simulated box ({SIMULATED_ENV}=8x80)")):
        fab = [ln for ln in diagnose(inv) if ln.what in (NCCL_WHAT, UCX_WHAT)]
        assert [ln.status for ln in fab] == [SKIPPED, SKIPPED] and all(ln.detail.startswith(why) for ln in fab)


def test_no_venv_skips_both_lines(tmp_path):
    probe = FakeFabric()
    root = tmp_path / "repo"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "gpu.txt").write_text("vllm==0.32.0\nnixl==1.5.1\n")
    inv = gather(NightNeeds(()), {"HF_HOME": str(tmp_path)}, nvml=parse_box("8x80").module(), root=root, probe=probe)
    assert probe.asked == [] and inv.nccl and inv.nccl.outcome == fabric.SKIPPED
    assert inv.nccl.detail == ".venv is not installed: nothing to probe with"


# The real probe's reading of its subprocesses (pure), then its wiring with stand-in interpreters.


def test_nccl_outcome_reads_the_ranks():
    ok = '{"rank": %d, "sum": 3.0, "nccl": "2.27.3"}'
    passed = fabric.nccl_outcome([(0, ok % 0, ""), (0, "log\n" + ok % 1, "")], (2, 3), 120, False)
    assert passed == NcclState(PASSED, "GPUs 2,3: both ranks summed to 3 (NCCL 2.27.3)", (2, 3))
    err = "Traceback ...\ntorch.distributed.DistBackendError: NCCL error: unhandled cuda error\n"
    failed = fabric.nccl_outcome([(1, "", err), (0, ok % 1, "")], (0, 1), 120, False)
    assert failed.outcome == FAILED and failed.detail.endswith(
        "exit code 1: torch.distributed.DistBackendError: NCCL error: unhandled cuda error"
    )
    hung = fabric.nccl_outcome([(0, ok % 0, ""), (None, "", "")], (0, 1), 120, True)
    assert hung == NcclState(HUNG, "no result within 120 s on GPUs 0,1", (0, 1), True)
    wrong = fabric.nccl_outcome([(0, '{"sum": 2.0}', ""), (0, '{"sum": 2.0}', "")], (0, 1), 120, False)
    assert wrong.outcome == FAILED and "3 expected" in wrong.detail


def test_ucx_info_transports_are_read_once_each_in_order():
    assert fabric.ucx_info_transports(UCX_INFO_D + "#      Transport: cuda_ipc\n") == ALL
    assert fabric.has_transport(ALL, "rc") and not fabric.has_transport(("tcp", "rcx"), "rc")


def script(folder: Path, name: str, body: str) -> Path:
    p = folder / name
    p.write_text("#!/bin/sh\n" + body)
    p.chmod(p.stat().st_mode | stat.S_IXUSR)
    return p


def test_the_real_all_reduce_probe_runs_two_ranks_on_the_given_gpus(tmp_path):
    # each rank answers with what it was given: its rank, and the GPUs and world it sees
    said = "$CUDA_VISIBLE_DEVICES/$WORLD_SIZE/$CUDA_DEVICE_ORDER"
    py = script(tmp_path, "python", f'echo "{{\\"rank\\": $RANK, \\"sum\\": 3.0, \\"nccl\\": \\"{said}\\"}}"\n')
    got = SubprocessFabric(py).nccl_allreduce((4, 5), {"PATH": os.environ["PATH"]})
    assert got == NcclState(PASSED, "GPUs 4,5: both ranks summed to 3 (NCCL 4,5/2/PCI_BUS_ID)", (4, 5))


def test_a_hung_rank_is_stopped_and_said(tmp_path):
    py = script(tmp_path, "python", '[ "$RANK" = 1 ] && exec sleep 600\necho "{\\"sum\\": 3.0}"\n')
    env = {"PATH": os.environ["PATH"], "NCCL_P2P_DISABLE": "1"}
    got = SubprocessFabric(py, nccl_timeout_s=1).nccl_allreduce((0, 1), env)
    assert got == NcclState(HUNG, "no result within 1 s on GPUs 0,1", (0, 1), True)


def test_the_real_ucx_probe_names_ucx_info_as_its_source(tmp_path):
    py = script(tmp_path, "python", 'echo \'{"mem": ["DRAM_SEG", "VRAM_SEG"], "bundled": ["cuda"], "error": null}\'\n')
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    d = tmp_path / "ucx_info_d.txt"
    d.write_text(UCX_INFO_D)
    script(bin_, "ucx_info", f'[ "$1" = -v ] && echo "# Library version: 1.18.0" && exit 0\ncat {d}\n')
    got = SubprocessFabric(py).nixl_ucx({"PATH": f"{bin_}:/usr/bin:/bin"})
    src = f"`ucx_info -d` ({bin_ / 'ucx_info'}, the system's UCX 1.18.0, not NIXL's own)"
    assert got == UcxState(PASSED, mem_types=MEM, transports=ALL, source=src, bundled=("cuda",))
    assert SubprocessFabric(py).nixl_ucx({"PATH": "/nonexistent"}).transports is None


def test_the_real_ucx_probe_says_why_no_agent(tmp_path):
    py = script(tmp_path, "python", 'echo \'{"mem": [], "bundled": [], "error": "RuntimeError: no UCX"}\'\n')
    assert SubprocessFabric(py).nixl_ucx({"PATH": ""}) == UcxState(FAILED, "RuntimeError: no UCX")
    crash = script(tmp_path, "crash", "echo 'ImportError: libucp.so.0' >&2; exit 1\n")
    got = SubprocessFabric(crash).nixl_ucx({"PATH": ""})
    assert got == UcxState(FAILED, "the NIXL probe exited 1: ImportError: libucp.so.0")


def test_the_probe_scripts_compile():
    for src in (fabric.NCCL_RANK, fabric.UCX_PROBE):
        compile(src, "probe", "exec")  # they run under the serving environment's interpreter, never imported here
