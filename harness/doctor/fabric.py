"""The box's GPU fabric as the night's P/D pairs use it: a two-GPU NCCL all-reduce (TP groups) and NIXL's UCX
transports (KV between GPUs). Each is read through ``FabricProbe``: ``SubprocessFabric`` runs short subprocesses with
the serving environment's interpreter, the tests give fakes. Whether to probe at all is decided here, purely, from what
the inventory already read: no GPU, a simulated box or too few GPUs give a skipped state with the reason, never a
pass."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from harness.gpu.nvml import Discovery
from harness.gpu.plan import CUDA_DEVICE_ORDER
from harness.gpu.visible import ORDER_ENV, VISIBLE_ENV
from harness.simbox.box import SIMULATED_ENV

PASSED, FAILED, HUNG, SKIPPED = "passed", "failed", "hung", "skipped"
NCCL_TIMEOUT_S = 120.0  # two ranks: CUDA and NCCL initialisation take seconds; a hang is what this bounds
UCX_TIMEOUT_S = 60.0
NCCL_RANKS = 2
P2P_ENV = "NCCL_P2P_DISABLE"
GPU_TRANSPORTS = ("cuda_ipc", "cuda_copy")  # KV between GPUs of one box: directly (IPC), or staged by copies
HOST_TRANSPORT = "rc"  # InfiniBand reliable connection (rc_verbs, rc_mlx5): KV between hosts
# What UCX's transport modules (libuct_<module>.so) provide, for the modules these lines name.
MODULE_TRANSPORTS = {"cuda": "cuda_copy, cuda_ipc", "ib": "rc, ud, dc"}

# One rank of the all-reduce (torch.distributed's env:// rendezvous). Each rank adds rank + 1: both must see 3.
NCCL_RANK = r"""
import datetime, json, os
import torch, torch.distributed as dist
rank = int(os.environ["RANK"])
torch.cuda.set_device(rank)
dist.init_process_group("nccl", timeout=datetime.timedelta(seconds=float(os.environ["PD_PROBE_TIMEOUT_S"])))
t = torch.full((1 << 20,), float(rank + 1), device="cuda")
dist.all_reduce(t)
torch.cuda.synchronize()
nccl = ".".join(map(str, torch.cuda.nccl.version()))
print(json.dumps({"rank": rank, "sum": float(t[0].item()), "nccl": nccl}), flush=True)
dist.destroy_process_group()
"""

# A NIXL agent with the UCX backend, what it reports, and the transport modules of NIXL's own UCX (the wheel bundles
# it: <module>.libs/ucx/libuct_<name>.so). NIXL's API reports UCX's options and memory types, no transport list.
UCX_PROBE = r"""
import json, pathlib, sys
out = {"mem": [], "bundled": [], "error": None}
try:
    from nixl._api import nixl_agent, nixl_agent_config
    agent = nixl_agent("pd-harness-doctor", nixl_agent_config(backends=["UCX"]))
    out["mem"] = [str(m) for m in agent.get_backend_mem_types("UCX")]
except Exception as e:
    out["error"] = f"{type(e).__name__}: {e}"
for name, mod in list(sys.modules.items()):
    if name.startswith(("nixl_cu", "nixl_rocm")) and "." not in name and getattr(mod, "__file__", None):
        ucx = pathlib.Path(mod.__file__).parent.parent / f"{name}.libs" / "ucx"
        out["bundled"] += [p.name.split(".")[0].removeprefix("libuct_") for p in ucx.glob("libuct_*.so*")]
out["bundled"] = sorted(set(out["bundled"]))
print(json.dumps(out))
"""


@dataclass(frozen=True)
class NcclState:
    outcome: str  # passed / failed / hung / skipped
    detail: str  # what the ranks said, or why it was not probed
    gpus: tuple[int, ...] = ()  # the physical GPU ids it ran on
    p2p_disabled: bool = False  # NCCL_P2P_DISABLE=1 was set: peer-to-peer was not what it tested


@dataclass(frozen=True)
class UcxState:
    outcome: str  # passed (an agent with UCX was made) / failed (it was not) / skipped
    detail: str = ""  # the agent's error, or why it was not probed
    mem_types: tuple[str, ...] = ()  # what NIXL's UCX backend registers (DRAM_SEG, VRAM_SEG)
    transports: tuple[str, ...] | None = None  # what ucx_info listed; None: no source listed any
    source: str = ""  # where ``transports`` came from
    bundled: tuple[str, ...] = ()  # transport modules shipped with NIXL's own UCX (cuda, ib, cma, ...)


class FabricProbe(Protocol):
    """What the doctor asks of the box's fabric; the real one runs subprocesses, a test's fake answers directly."""

    def nccl_allreduce(self, gpu_ids: tuple[int, ...], env: Mapping[str, str]) -> NcclState: ...

    def nixl_ucx(self, env: Mapping[str, str]) -> UcxState: ...


def skip_reason(discovery: Discovery, gpu_present: bool, python_problem: str | None) -> str | None:
    """Why neither probe can run on this box (None: they can); ``python_problem``: why the interpreter cannot."""
    if not gpu_present:
        return "no NVIDIA GPU on this machine"
    if discovery.simulated:
        return f"simulated box ({SIMULATED_ENV}={discovery.simulated}): no NCCL or UCX behind it"
    if not discovery.available:
        return "NVML cannot be read"
    if discovery.count < 1:
        return "no GPU visible"
    return python_problem


def probe_fabric(
    discovery: Discovery,
    gpu_present: bool,
    python_problem: str | None,
    torch_cuda: bool,
    probe: FabricProbe | None,
    env: Mapping[str, str],
) -> tuple[NcclState, UcxState]:
    """Both states: probed where the box allows, else skipped with the reason (``torch_cuda``: the interpreter's
    torch is a CUDA build, which the all-reduce needs; ``probe`` None: no interpreter to probe with)."""
    why = skip_reason(discovery, gpu_present, python_problem)
    if why or probe is None:
        why = why or "no interpreter to probe with"
        return NcclState(SKIPPED, why), UcxState(SKIPPED, why)
    if discovery.count < NCCL_RANKS:
        nccl = NcclState(SKIPPED, f"needs {NCCL_RANKS} GPUs, {discovery.count} visible")
    elif not torch_cuda:
        nccl = NcclState(SKIPPED, "the probing environment's torch is not a CUDA build")
    else:
        nccl = probe.nccl_allreduce(tuple(g.index for g in discovery.gpus[:NCCL_RANKS]), env)
    return nccl, probe.nixl_ucx(env)


def nccl_outcome(
    ranks: Sequence[tuple[int | None, str, str]], gpu_ids: tuple[int, ...], timeout_s: float, p2p_disabled: bool
) -> NcclState:
    """The all-reduce's state from each rank's (exit code, stdout, stderr); exit code None: still running at the
    timeout."""
    ids = ",".join(map(str, gpu_ids))
    if any(rc is None for rc, _, _ in ranks):
        return NcclState(HUNG, f"no result within {timeout_s:g} s on GPUs {ids}", gpu_ids, p2p_disabled)
    sums, nccl = [], ""
    for rank, (rc, out, err) in enumerate(ranks):
        got = _last_json(out)
        if rc != 0 or got is None:
            last = _last_line(err) or _last_line(out) or "no output"
            return NcclState(FAILED, f"rank {rank} on GPUs {ids}: exit code {rc}: {last}", gpu_ids, p2p_disabled)
        sums.append(got.get("sum"))
        nccl = str(got.get("nccl") or "")
    want = float(sum(range(1, len(ranks) + 1)))
    if any(s != want for s in sums):
        return NcclState(FAILED, f"GPUs {ids}: sums {sums}, {want:g} expected", gpu_ids, p2p_disabled)
    ver = f" (NCCL {nccl})" if nccl else ""
    return NcclState(PASSED, f"GPUs {ids}: both ranks summed to {want:g}{ver}", gpu_ids, p2p_disabled)


_TRANSPORT = re.compile(r"^#\s*Transport:\s*(\S+)", re.M)
_UCX_VERSION = re.compile(r"version[:=]\s*([\d.]+)", re.I)


def ucx_info_transports(text: str) -> tuple[str, ...]:
    """The transports ``ucx_info -d`` lists (``#      Transport: cuda_ipc``), each once, in order."""
    return tuple(dict.fromkeys(_TRANSPORT.findall(text)))


def has_transport(transports: Sequence[str], name: str) -> bool:
    """``rc`` is there as rc_verbs or rc_mlx5 too."""
    return any(t == name or t.startswith(f"{name}_") for t in transports)


def ucx_outcome(probe_out: str, ucx_info: tuple[str, str, str] | None) -> UcxState:
    """The UCX state from the NIXL probe's stdout and, when ucx_info ran, (its path, ``-v`` output, ``-d`` output)."""
    got = _last_json(probe_out)
    if got is None:
        return UcxState(FAILED, f"the NIXL probe gave no answer: {_last_line(probe_out) or 'no output'}")
    bundled = tuple(got.get("bundled") or ())
    if got.get("error"):
        return UcxState(FAILED, str(got["error"])[:300], bundled=bundled)
    mem = tuple(got.get("mem") or ())
    if ucx_info is None:
        return UcxState(PASSED, mem_types=mem, bundled=bundled)
    path, version_text, devices = ucx_info
    m = _UCX_VERSION.search(version_text)
    source = f"`ucx_info -d` ({path}, the system's UCX{' ' + m.group(1) if m else ''}, not NIXL's own)"
    return UcxState(PASSED, mem_types=mem, transports=ucx_info_transports(devices), source=source, bundled=bundled)


class SubprocessFabric:
    """The real probes: the all-reduce as two rank processes and the NIXL agent as one, each with ``python`` (the
    serving environment's interpreter), and ``ucx_info`` when it is on PATH."""

    def __init__(self, python: Path, nccl_timeout_s: float = NCCL_TIMEOUT_S, ucx_timeout_s: float = UCX_TIMEOUT_S):
        self.python = python
        self.nccl_timeout_s = nccl_timeout_s
        self.ucx_timeout_s = ucx_timeout_s

    def nccl_allreduce(self, gpu_ids: tuple[int, ...], env: Mapping[str, str]) -> NcclState:
        base = {
            **env,
            VISIBLE_ENV: ",".join(map(str, gpu_ids)),
            ORDER_ENV: CUDA_DEVICE_ORDER,
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(_free_port()),
            "WORLD_SIZE": str(len(gpu_ids)),
            "PD_PROBE_TIMEOUT_S": f"{self.nccl_timeout_s:g}",
        }
        argvs = [[str(self.python), "-c", NCCL_RANK] for _ in gpu_ids]
        envs = [{**base, "RANK": str(r), "LOCAL_RANK": str(r)} for r in range(len(gpu_ids))]
        try:
            ranks = run_together(argvs, envs, self.nccl_timeout_s)
        except OSError as e:
            return NcclState(FAILED, f"{self.python} cannot be started: {e}", gpu_ids)
        return nccl_outcome(ranks, gpu_ids, self.nccl_timeout_s, env.get(P2P_ENV) == "1")

    def nixl_ucx(self, env: Mapping[str, str]) -> UcxState:
        try:
            ((rc, out, err),) = run_together([[str(self.python), "-c", UCX_PROBE]], [dict(env)], self.ucx_timeout_s)
        except OSError as e:
            return UcxState(FAILED, f"{self.python} cannot be started: {e}")
        if rc is None:
            return UcxState(FAILED, f"creating a NIXL agent with UCX gave no answer within {self.ucx_timeout_s:g} s")
        if rc != 0 and _last_json(out) is None:
            return UcxState(FAILED, f"the NIXL probe exited {rc}: {_last_line(err) or 'no output'}")
        return ucx_outcome(out, self._ucx_info(env))

    def _ucx_info(self, env: Mapping[str, str]) -> tuple[str, str, str] | None:
        path = shutil.which("ucx_info", path=env.get("PATH"))
        if path is None:
            return None
        try:
            ((_, version, _),) = run_together([[path, "-v"]], [dict(env)], self.ucx_timeout_s)
            ((rc, devices, _),) = run_together([[path, "-d"]], [dict(env)], self.ucx_timeout_s)
        except OSError:
            return None
        return (path, version, devices) if rc == 0 else None


def bundled_text(modules: Sequence[str]) -> str:
    """NIXL's UCX modules, with the transports of those that carry KV: ``cma, cuda (cuda_copy, cuda_ipc), ib (...)``."""
    return ", ".join(f"{m} ({MODULE_TRANSPORTS[m]})" if m in MODULE_TRANSPORTS else m for m in modules) or "none found"


def run_together(
    argvs: Sequence[Sequence[str]], envs: Sequence[Mapping[str, str]], timeout_s: float
) -> list[tuple[int | None, str, str]]:
    """Start every command at once (each its own process group), wait for all up to ``timeout_s``, stop what is left;
    (exit code or None when it was stopped, stdout, stderr) each. Output goes to files: a chatty rank never blocks on
    a full pipe while the other is waited for."""
    with tempfile.TemporaryDirectory(prefix="pd-doctor-") as tmp, contextlib.ExitStack() as files:
        procs: list[subprocess.Popen] = []
        outs = []
        for i, (argv, env) in enumerate(zip(argvs, envs, strict=True)):
            out = files.enter_context(Path(tmp, f"{i}.out").open("w+"))
            err = files.enter_context(Path(tmp, f"{i}.err").open("w+"))
            outs.append((out, err))
            try:
                procs.append(subprocess.Popen(argv, stdout=out, stderr=err, env=dict(env), start_new_session=True))
            except OSError:
                for p in procs:
                    _stop(p)
                raise
        deadline = time.monotonic() + timeout_s
        codes: list[int | None] = []
        for p in procs:
            try:
                codes.append(p.wait(timeout=max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                codes.append(None)
                _stop(p)
        result = []
        for rc, (out, err) in zip(codes, outs, strict=True):
            out.seek(0)
            err.seek(0)
            result.append((rc, out.read(), err.read()))
        return result


def _stop(p: subprocess.Popen) -> None:
    """SIGKILL to the process group this probe started (a hung NCCL rank ignores SIGTERM while it waits)."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(p.pid, signal.SIGKILL)
    p.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _last_json(text: str) -> dict | None:
    for line in reversed(text.strip().splitlines()):
        if line.startswith("{"):
            try:
                got = json.loads(line)
            except ValueError:
                return None
            return got if isinstance(got, dict) else None
    return None


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.strip().splitlines() if ln.strip()]
    return lines[-1][:300] if lines else ""
