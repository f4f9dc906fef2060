"""The doctor's checks (pure): each reads the ``Inventory`` and gives lines, ok or problem with the one thing to do.
A check this box cannot make (no GPU here) gives an ``unchecked`` line, never an ok; a probe the box gives no ground
for (fewer than 2 GPUs for an all-reduce, a simulated box) a ``skipped`` line with the reason."""

from __future__ import annotations

from dataclasses import dataclass

from harness.doctor import fabric
from harness.doctor.driver import driver_problem
from harness.doctor.inventory import EnvState, Inventory
from harness.gpu.plan import MAX_UTIL, PlanError, describe_gpus, model_memory, plan_gpus

OK, PROBLEM, UNCHECKED, SKIPPED = "ok", "problem", "unchecked", "skipped"
DISK_MARGIN_GIB = 10.0  # logs, run folders, pip's unpacking


@dataclass(frozen=True)
class Line:
    status: str  # ok / problem / unchecked
    what: str  # the subject: "NVML", "GPUs", "model Qwen/Qwen3-0.6B", ...
    detail: str
    todo: str = ""  # the one thing to do (problem lines)

    def render(self) -> str:
        return f"{self.status:<9} {self.what}: {self.detail}" + (f"; do: {self.todo}" if self.todo else "")


def check_nvml(inv: Inventory) -> Line:
    d = inv.nvml
    if not inv.gpu_present:
        return Line(UNCHECKED, "GPUs", "no NVIDIA GPU on this machine: NVML, GPUs and driver not checked")
    if not d.available:
        return Line(PROBLEM, "NVML", d.describe(), _nvml_todo(d.simulated))
    return Line(OK, "NVML", f"readable, driver {d.driver or 'unknown'}")


def _nvml_todo(simulated: str | None) -> str:
    """What to do when NVML cannot be read: load the driver, or, for a simulated box whose value describes none, give
    one that does (the simulated ``unreadable`` box stands for a machine without its driver)."""
    from harness.simbox.box import EXAMPLES, SIMULATED_ENV, parse_box

    if simulated is not None:
        try:
            parse_box(simulated)
        except ValueError:
            return f"give {SIMULATED_ENV} a box it describes (e.g. {EXAMPLES})"
    return "load the NVIDIA driver and install nvidia-ml-py (`make setup`)"


def check_gpus(inv: Inventory) -> list[Line]:
    """Count within the caller's CUDA_VISIBLE_DEVICES, their model and memory, free memory, the accuracy pairs'
    placement (the plan run/preflight.py check_gpus makes)."""
    d, want = inv.nvml, inv.needs.gpus
    if not d.available:
        return []
    gpus = d.plan_gpus()
    seen = f"{describe_gpus(gpus)}" if gpus else "no GPU"
    if d.visible is not None:
        seen += f", {d.count} of {d.host_count} visible (CUDA_VISIBLE_DEVICES={d.visible})"
    if d.count < want:
        todo = (
            "unset CUDA_VISIBLE_DEVICES (or give the night and the doctor --gpus "
            f"{d.count}: the steps needing more are skipped)"
            if d.visible is not None and d.host_count >= want
            else f"run on a box with {want} GPUs, or give the night and the doctor --gpus {d.count}"
        )
        return [Line(PROBLEM, "GPUs", f"{seen}; the night wants {want}", todo)]
    out = [Line(OK, "GPUs", seen)]
    held = [g for g in d.gpus[:want] if g.free_gib < MAX_UTIL * g.total_gib]
    if held:
        g = held[0]
        pids = f" (PIDs {', '.join(map(str, g.pids))})" if g.pids else ""
        out.append(
            Line(
                PROBLEM,
                "GPU memory",
                f"{len(held)} GPU(s) held by others, e.g. GPU {g.index}: {g.free_gib:.1f} of {g.total_gib:.1f} GiB "
                f"free{pids}",
                "stop what holds them (nvidia-smi shows it): the steps' servers need their share free",
            )
        )
    for model, tp_p, tp_d in inv.needs.pairs:
        try:
            plan_gpus(gpus[:want], tp_p, tp_d, model_memory(model))
        except PlanError as e:
            out.append(Line(PROBLEM, f"placement {model} P{tp_p}->D{tp_d}", str(e), "a box with larger GPUs"))
            continue
        out.append(Line(OK, f"placement {model} P{tp_p}->D{tp_d}", f"plans on the {want} GPUs"))
    return out


def check_driver(inv: Inventory) -> list[Line]:
    """The driver against the CUDA of the torch of each environment the night serves from."""
    d = inv.nvml
    if not d.available:
        return []
    out = []
    for e in (e for e in inv.envs if e.installed and e.problem is None):
        what = f"driver for {e.name}"
        if e.torch is None:
            out.append(Line(PROBLEM, what, f"{e.name} has no torch", "reinstall it (`make setup DEVICE=gpu`)"))
        elif e.torch_cuda is None:
            out.append(
                Line(PROBLEM, what, f"torch {e.torch} in {e.name} is a CPU build", "`make setup DEVICE=gpu` there")
            )
        elif d.driver is None:
            out.append(Line(PROBLEM, what, "NVML gives no driver version", "check the NVIDIA driver (nvidia-smi)"))
        else:
            why = driver_problem(d.driver, e.torch_cuda)
            detail = f"driver {d.driver}, torch {e.torch} (CUDA {e.torch_cuda})"
            upgrade = f"update the NVIDIA driver, or install a torch built for an older CUDA in {e.name}"
            out.append(Line(PROBLEM, what, f"{detail}: {why}", upgrade) if why else Line(OK, what, detail))
    return out


NCCL_WHAT, UCX_WHAT = "NCCL all-reduce", "NIXL UCX transports"
P2P_TODO = (
    f"run the doctor again with {fabric.P2P_ENV}=1: if it passes then, GPU peer-to-peer is what fails (check the "
    "driver, and IOMMU/ACS in the BIOS); if not, check the driver (nvidia-smi) and rerun with NCCL_DEBUG=INFO"
)


def check_nccl(inv: Inventory) -> list[Line]:
    """Two of the night's GPUs all-reduce through NCCL (what every TP group of a server does first)."""
    s = inv.nccl
    if s is None:
        return []
    if s.outcome == fabric.SKIPPED:
        return [Line(SKIPPED, NCCL_WHAT, s.detail)]
    p2p = f" with {fabric.P2P_ENV}=1" if s.p2p_disabled else ""
    if s.outcome == fabric.PASSED:
        untested = f"; peer-to-peer not tested ({fabric.P2P_ENV}=1 is set)" if s.p2p_disabled else ""
        return [Line(OK, NCCL_WHAT, s.detail + untested)]
    what = "hung" if s.outcome == fabric.HUNG else "failed"
    todo = "check the driver (nvidia-smi) and rerun with NCCL_DEBUG=INFO" if s.p2p_disabled else P2P_TODO
    return [Line(PROBLEM, NCCL_WHAT, f"{what}{p2p}: {s.detail}", todo)]


def check_ucx(inv: Inventory) -> list[Line]:
    """A NIXL agent with the UCX backend, and the transports KV takes: cuda_ipc and cuda_copy between this box's GPUs
    (a problem when listed absent), rc between hosts (only said). Which source listed them is part of the line."""
    s = inv.ucx
    if s is None:
        return []
    if s.outcome == fabric.SKIPPED:
        return [Line(SKIPPED, UCX_WHAT, s.detail)]
    if s.outcome != fabric.PASSED:
        return [Line(PROBLEM, UCX_WHAT, f"no NIXL agent with UCX: {s.detail}", "`make setup DEVICE=gpu` (nixl)")]
    agent = f"NIXL agent with UCX made ({', '.join(s.mem_types) or 'no memory types reported'})"
    if s.transports is None:
        return [
            Line(
                UNCHECKED,
                UCX_WHAT,
                f"{agent}; cuda_ipc, cuda_copy, rc not listed: NIXL's API lists no transports and ucx_info is not "
                f"on PATH; NIXL's UCX ships the modules {fabric.bundled_text(s.bundled)}",
            )
        ]
    have = {t: fabric.has_transport(s.transports, t) for t in (*fabric.GPU_TRANSPORTS, fabric.HOST_TRANSPORT)}
    said = ", ".join(f"{t} {'present' if ok else 'absent'}" for t, ok in have.items())
    if not have[fabric.HOST_TRANSPORT]:
        said += " (only KV between hosts needs rc)"
    detail = f"{said}, from {s.source}; {agent}"
    missing = [t for t in fabric.GPU_TRANSPORTS if not have[t]]
    if missing:
        todo = (
            f"KV between this box's GPUs needs {' and '.join(missing)}: check the NVIDIA driver (nvidia-smi) and, "
            "in a container, --ipc=host"
        )
        return [Line(PROBLEM, UCX_WHAT, detail, todo)]
    return [Line(OK, UCX_WHAT, detail)]


def check_envs(inv: Inventory) -> list[Line]:
    """lm-eval importable in every environment that serves an accuracy step (it runs with the serving interpreter)."""
    out = []
    for e in inv.envs:
        what = f"env {e.name}"
        if e.problem:
            out.append(Line(PROBLEM, what, e.problem, "reinstall it (`python -m harness envs`)"))
        elif not e.installed:
            ver = e.version or "the pinned vLLM"
            todo = "`make setup`" if e.version is None else f"its first step installs vLLM {e.version} there"
            status = PROBLEM if e.version is None else UNCHECKED
            out.append(Line(status, what, f"not installed (for {ver}): lm-eval and torch not checked", todo))
        elif e.torch and e.torch_wanted and not torch_fits(e.torch, e.torch_wanted):
            out.append(Line(PROBLEM, what, *_torch_mismatch(e)))
        elif inv.needs.accuracy and not e.lm_eval:
            out.append(
                Line(
                    PROBLEM,
                    what,
                    "lm-eval does not import there, and accuracy steps run it with that environment's python",
                    f'{e.name}/bin/python -m pip install "$(grep ^lm_eval requirements/harness.txt)" '
                    "(or leave the accuracy steps out with --only)",
                )
            )
        else:
            has = ", lm-eval" if e.lm_eval else ""
            out.append(Line(OK, what, f"vLLM {e.vllm or 'not installed'}, torch {e.torch or 'none'}{has}"))
    return out


def torch_fits(torch: str, wanted: str) -> bool:
    """Whether torch ``torch`` (``2.11.0+cu130``) is the version ``wanted`` (vLLM's requirement, ``==2.13.0+cpu``)
    asks for; local tags (the CUDA or CPU build) aside: which build it is, the driver check says."""
    from packaging.specifiers import InvalidSpecifier, SpecifierSet
    from packaging.version import InvalidVersion, Version

    try:
        spec = SpecifierSet(",".join(f"{s.operator}{s.version.split('+')[0]}" for s in SpecifierSet(wanted)))
        return spec.contains(Version(torch).public, prereleases=True)
    except (InvalidSpecifier, InvalidVersion):
        return True  # what cannot be read is not claimed to mismatch


def _torch_mismatch(e: EnvState) -> tuple[str, str]:
    """The detail and the one thing to do for an environment whose torch is not the one its vLLM was built against
    (an image's torch kept under a vLLM that pins another: its compiled kernels do not load)."""
    detail = (
        f"torch {e.torch} there, but its vLLM {e.vllm} requires torch{e.torch_wanted}: vLLM's compiled "
        "kernels are built against that torch and do not load with another"
    )
    if e.name == ".venv":  # the pinned (or an offline install's) vLLM, whatever version the night names it by
        todo = (
            "`make setup DEVICE=gpu` (it installs the torch vLLM pins); on an image whose torch must stay, install "
            "from a wheelhouse built for that torch (docs/offline-install.md)"
        )
    else:
        todo = f"remove {e.name}: the first step of vLLM {e.version} installs it again with the torch it pins"
    return detail, todo


def check_models(inv: Inventory) -> list[Line]:
    """Every model of the night in the hub cache with its weights; gated ones named, with or without a token."""
    out = []
    for m in inv.models:
        what = f"model {m.repo}" + (" (gated)" if m.gated else "")
        if m.problem is None:
            out.append(Line(OK, what, "in the hub cache with its weights"))
        elif m.gated and not inv.token:
            out.append(
                Line(
                    PROBLEM,
                    what,
                    "not in the hub cache, and gated: the hub answers 401 without a token",
                    f"accept its license on huggingface.co/{m.repo} and set HF_TOKEN (or `hf auth login`)",
                )
            )
        elif inv.needs.before_prefetch:
            out.append(Line(OK, what, f"not cached yet: prefetch/{m.repo} fetches it"))
        else:  # availability's first clause (the rest names the command, given here as the thing to do)
            why = m.problem.split("; ")[0].removeprefix(f"model {m.repo} ")
            out.append(Line(PROBLEM, what, why, f"`hf download {m.repo}`"))
    return out


def check_dataset(inv: Inventory) -> Line:
    from harness.accuracy.settings import HUB_DATASET

    if inv.dataset_cached:
        return Line(OK, f"dataset {HUB_DATASET}", "in the hub cache")
    if inv.needs.before_prefetch:
        return Line(OK, f"dataset {HUB_DATASET}", f"not cached yet: prefetch/{HUB_DATASET} fetches it")
    return Line(
        PROBLEM,
        f"dataset {HUB_DATASET}",
        "not in the hub cache: accuracy steps fall back to the offline task, and no published score is checked",
        f"`hf download {HUB_DATASET} --repo-type dataset`",
    )


def check_disk(inv: Inventory) -> list[Line]:
    out = []
    for d in inv.disks:
        need = d.need_gib + DISK_MARGIN_GIB
        detail = f"{d.free_gib:.0f} GiB free in {d.path}, {d.what} need about {need:.0f} GiB"
        if d.free_gib < need:
            out.append(Line(PROBLEM, "disk", detail, "free space (`python -m harness envs prune --keep N`)"))
        else:
            out.append(Line(OK, "disk", detail))
    return out


def diagnose(inv: Inventory) -> list[Line]:
    """Every line, in the order a person fixes them: GPUs, driver, fabric, environments, models, dataset, disk."""
    return [
        check_nvml(inv),
        *check_gpus(inv),
        *check_driver(inv),
        *check_nccl(inv),
        *check_ucx(inv),
        *check_envs(inv),
        *check_models(inv),
        check_dataset(inv),
        *check_disk(inv),
    ]


def problems(lines: list[Line]) -> list[Line]:
    return [line for line in lines if line.status == PROBLEM]
