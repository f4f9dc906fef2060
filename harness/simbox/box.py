"""Simulated GPU boxes: the switch that describes one, a stand-in ``pynvml`` module, and the box as the source GPU
discovery reads in the real NVML's place (harness/gpu/source.py).

``PD_HARNESS_SIMULATED_GPUS`` is off unless set (never a default). Its value describes the box:

  8x80                        eight 80 GiB GPUs (named as H100s), nothing running on them
  8x40                        eight 40 GiB GPUs (named as A100-SXM4-40GB)
  8x80:visible=4,5,6,7        the same box, the caller's CUDA_VISIBLE_DEVICES being 4,5,6,7 (indices or UUIDs)
  8x80:free=30                every GPU with only 30 GiB free (someone else holds the rest)
  8x80:name=NVIDIA H200       another model name
  8x80:driver=525.60.13       another driver version (default: DRIVER)
  8x80:torch=2.11.0+cu130     the torch build the box's environments hold (the image's torch), as torch.__version__
                              prints it: its version and, from its local tag, the CUDA it was built for (+cpu: a CPU
                              build); default: each environment's own torch version, built for CUDA (TORCH_CUDA)
  8x80:no-lm-eval=0.21.0      lm-eval does not import in the environment of these vLLM versions (comma-separated; the
                              pinned one by its number), where it is installed
  unreadable                  NVML cannot be read (nvmlInit fails, as with no driver loaded)

Options join with ``:`` (``8x80:driver=570.86.15:torch=2.13.0+cu130``). torch= and no-lm-eval= describe the box's
software, not its GPUs: what the doctor (harness/doctor/inventory.py) reads of the night's environments on the box. The
environments themselves are the repository's (``.venv``, ``.venvs/vllm-<version>``): whether one is installed, its
vLLM and the torch its vLLM requires are read there; the box says what torch it holds and where lm-eval is missing.
A model missing from the box, gated or not, is a hub cache without it (``HF_HOME``), which the runs read too.

Without ``visible=`` the real environment's CUDA_VISIBLE_DEVICES applies. Simulated UUIDs are
``GPU-00000000-0000-4000-8000-<index as 12 hex digits>``. ``FakeNvml`` is also what the unit tests
script changing GPU states with (tests/unit/gpu/fake_nvml.py).

What runs on the box is what the stand-in servers (standin.py) registered in its state folder (claims.py): each
one's PID is listed on its GPUs and its memory is taken from their free memory while it lives.

The switch means something to discovery only in a process that called ``install_source`` (``python -m harness``,
a stand-in, the test session); it is read again at every discovery, with the environment discovery was given.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import SimpleNamespace

from harness.gpu.source import NvmlSource, use_source
from harness.simbox.claims import Claim, live_claims, state_dir

SIMULATED_ENV = "PD_HARNESS_SIMULATED_GPUS"
UNREADABLE = "unreadable"
GIB = 2**30
# Names nvidia-smi prints for the usual sizes, so dry runs read like the real box.
NAMES = {80: "NVIDIA H100 80GB HBM3", 40: "NVIDIA A100-SXM4-40GB", 141: "NVIDIA H200", 24: "NVIDIA L4"}
_BOX = re.compile(r"^(\d+)x(\d+(?:\.\d+)?)$")
EXAMPLES = (
    "8x80, 8x40, 8x80:visible=4,5,6,7, 8x80:free=30, 8x80:driver=525.60.13, 8x80:torch=2.11.0+cu130, "
    "8x80:no-lm-eval=0.21.0, unreadable"
)
DRIVER = "580.65.06"  # what a simulated box's NVML reports as its driver version, unless driver= says otherwise
# The CUDA the box's environments' torch is built for, unless torch= says otherwise (DRIVER runs it).
TORCH_CUDA = "13.0"
_TORCH = re.compile(r"\d+(\.\d+)+\+(cu(\d+)(\d)|cpu)")  # 2.11.0+cu130 (CUDA 13.0), 2.13.0+cu128, 2.13.0+cpu
_VERSION = re.compile(r"\d+(\.\d+)+[a-z0-9.]*")  # a vLLM version: 0.21.0, 0.11.0rc1


class NVMLError(Exception):
    pass


def sim_uuid(index: int) -> str:
    return f"GPU-00000000-0000-4000-8000-{index:012x}"


@dataclass
class FakeGpu:
    total_gib: float = 80.0
    free_gib: float = 79.0
    pids: list[int] = field(default_factory=list)
    name: str = "NVIDIA H100 80GB HBM3"
    procs_error: bool = False  # nvmlDeviceGetComputeRunningProcesses raises (as in some containers)
    uuid: str = ""  # empty: sim_uuid(index)


class FakeNvml:
    """``FakeNvml([state0, state1, ...])``: each state is a list of ``FakeGpu``; every nvmlInit moves to the
    next state and the last one stays, so a test scripts what a poller sees over time."""

    NVMLError = NVMLError

    def __init__(
        self,
        states: list[list[FakeGpu]] | None = None,
        init_error: str | None = None,
        bytes_names: bool = False,
        driver: str = DRIVER,
    ):
        self.states = states or [[]]
        self.driver = driver
        self.init_error = init_error
        self.bytes_names = bytes_names
        self.sessions = 0  # nvmlInit calls that succeeded
        self.open = 0  # sessions not yet shut down

    @property
    def _gpus(self) -> list[FakeGpu]:
        return self.states[min(self.sessions, len(self.states)) - 1]

    def _need_init(self) -> None:
        if self.open < 1:
            raise NVMLError("Uninitialized")

    def nvmlInit(self) -> None:
        if self.init_error:
            raise NVMLError(self.init_error)
        self.sessions += 1
        self.open += 1

    def nvmlShutdown(self) -> None:
        self._need_init()
        self.open -= 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._need_init()
        return self.driver

    def nvmlDeviceGetCount(self) -> int:
        self._need_init()
        return len(self._gpus)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> FakeGpu:
        self._need_init()
        return self._gpus[i]

    def nvmlDeviceGetName(self, h: FakeGpu):
        return h.name.encode() if self.bytes_names else h.name

    def nvmlDeviceGetUUID(self, h: FakeGpu):
        uuid = h.uuid or sim_uuid(next(i for i, g in enumerate(self._gpus) if g is h))
        return uuid.encode() if self.bytes_names else uuid

    def nvmlDeviceGetMemoryInfo(self, h: FakeGpu):
        total, free = int(h.total_gib * GIB), int(h.free_gib * GIB)
        return SimpleNamespace(total=total, free=free, used=total - free)

    def nvmlDeviceGetComputeRunningProcesses(self, h: FakeGpu):
        if h.procs_error:
            raise NVMLError("Not Supported")
        return [SimpleNamespace(pid=p, usedGpuMemory=GIB) for p in h.pids]


@dataclass(frozen=True)
class SimulatedBox:
    """One value of PD_HARNESS_SIMULATED_GPUS, parsed."""

    spec: str
    count: int = 0
    mem_gib: float = 0.0
    free_gib: float | None = None  # None: all but 0.5 GiB (a driver's own use)
    name: str | None = None  # None: NAMES by size
    visible: str | None = None  # the caller's CUDA_VISIBLE_DEVICES on that box; None: the real environment's
    unreadable: bool = False
    driver: str = DRIVER  # the NVIDIA driver version NVML reports
    torch: str | None = None  # the torch every environment on the box holds; None: its own version, for TORCH_CUDA
    no_lm_eval: tuple[str, ...] = ()  # vLLM versions whose environment on the box has no lm-eval

    def env_torch(self, own: str | None) -> tuple[str | None, str | None]:
        """(torch version, the CUDA it is built for) of an environment on the box whose torch here is ``own`` (None:
        it has none): torch= when given, else ``own``'s version built for TORCH_CUDA."""
        if self.torch is not None:
            return self.torch, torch_cuda(self.torch)
        if own is None:
            return None, None
        return f"{own.split('+')[0]}+cu{TORCH_CUDA.replace('.', '')}", TORCH_CUDA

    def has_lm_eval(self, version: str, own: bool) -> bool:
        """Whether lm-eval imports in the box's environment of vLLM ``version``, where it does here as ``own``."""
        return own and version not in self.no_lm_eval

    def module(self, claims: Sequence[Claim] = ()) -> FakeNvml:
        """The box as NVML shows it with ``claims`` (live processes) running: their PIDs on their GPUs, their
        memory taken from the free memory."""
        if self.unreadable:
            return FakeNvml(init_error="Driver Not Loaded (simulated)")
        name = self.name or NAMES.get(round(self.mem_gib), f"Simulated GPU {self.mem_gib:g}GB")
        free = self.mem_gib - 0.5 if self.free_gib is None else self.free_gib
        gpus = []
        for i in range(self.count):
            on = [c for c in claims if i in c.gpus]
            held = sum(c.gib_per_gpu for c in on)
            gpus.append(FakeGpu(self.mem_gib, max(0.0, free - held), sorted(c.pid for c in on), name, uuid=sim_uuid(i)))
        return FakeNvml([gpus], driver=self.driver)

    def for_child(self) -> str:
        """The switch's value for a process given its own CUDA_VISIBLE_DEVICES (a server, a nightly step): the same
        box without ``visible=``, so that the child's CUDA_VISIBLE_DEVICES applies, as it does for CUDA."""
        return ":".join(p for p in self.spec.strip().split(":") if not p.startswith("visible="))


def torch_cuda(torch: str) -> str | None:
    """The CUDA a torch build's local tag names: ``2.11.0+cu130`` -> ``13.0``, ``+cu128`` -> ``12.8``; None: a CPU
    build (``+cpu``)."""
    m = _TORCH.fullmatch(torch)
    return f"{m.group(3)}.{m.group(4)}" if m and m.group(3) else None


def parse_box(spec: str) -> SimulatedBox:
    """``8x80[:visible=...][:free=G][:name=...][:driver=V][:torch=T][:no-lm-eval=V,...]`` or ``unreadable``;
    ValueError saying what is wrong."""
    head, *opts = spec.strip().split(":")
    if head == UNREADABLE and not opts:
        return SimulatedBox(spec, unreadable=True)
    m = _BOX.match(head)
    if not m or int(m.group(1)) < 1 or float(m.group(2)) <= 0:
        raise ValueError(f"{SIMULATED_ENV}={spec!r} is not a GPU box (e.g. {EXAMPLES})")
    kw: dict = {}
    for opt in opts:
        key, _, value = opt.partition("=")
        if key == "visible":
            kw["visible"] = value
        elif key == "free" and _is_number(value) and 0 <= float(value) <= float(m.group(2)):
            kw["free_gib"] = float(value)
        elif key == "name" and value:
            kw["name"] = value
        elif key == "driver" and re.fullmatch(r"\d+(\.\d+)*", value):
            kw["driver"] = value
        elif key == "torch" and _TORCH.fullmatch(value):
            kw["torch"] = value
        elif key == "no-lm-eval" and value and all(_VERSION.fullmatch(v) for v in value.split(",")):
            kw["no_lm_eval"] = tuple(value.split(","))
        else:
            raise ValueError(
                f"{SIMULATED_ENV}={spec!r}: {opt!r} is not visible=IDS, free=GIB (<= the GPU's), name=NAME, "
                "driver=VERSION, torch=VERSION+cuNNN|+cpu (e.g. 2.11.0+cu130) or no-lm-eval=VLLM_VERSIONS"
            )
    return SimulatedBox(spec, int(m.group(1)), float(m.group(2)), **kw)


def _is_number(v: str) -> bool:
    try:
        float(v)
    except ValueError:
        return False
    return True


def simulated_box(env: Mapping[str, str]) -> SimulatedBox | None:
    """The box the switch describes, None when it is not set; ValueError for a value that describes none."""
    spec = env.get(SIMULATED_ENV, "").strip()
    return parse_box(spec) if spec else None


def simulated_source(env: Mapping[str, str]) -> NvmlSource | None:
    """The box the switch describes, as discovery's source, with the stand-ins registered in its state folder
    running on it; None when the switch is not set (the real NVML); a value that describes no box, with the reason."""
    try:
        box = simulated_box(env)
    except ValueError as e:
        raw = env.get(SIMULATED_ENV, "")
        return NvmlSource(f"{SIMULATED_ENV}={raw}", raw, problem=str(e))
    if box is None:
        return None
    return NvmlSource(
        f"{SIMULATED_ENV}={box.spec}", box.spec, box.module(live_claims(state_dir(env))), visible=box.visible
    )


def install_source() -> None:
    """From now on in this process, GPU discovery reads the simulated box wherever the switch is set."""
    use_source(simulated_source)
