"""Is there an NVIDIA GPU, and how many may this process use, without loading a driver library.

The count is the caller's: the GPUs of /proc/driver/nvidia/gpus (one folder per GPU, by PCI bus id, so in
NVML's order) that its CUDA_VISIBLE_DEVICES names (visible.py; UUIDs are read from each GPU's
``information`` file). A source installed in NVML's place (source.py: the simulated box, when
PD_HARNESS_SIMULATED_GPUS is set) answers instead.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from harness.core.errors import ConfigError
from harness.gpu.source import NvmlSource, source_for
from harness.gpu.visible import VISIBLE_ENV, resolve_visible
from harness.models.rules import DEVICES

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def _source(env: Mapping[str, str]) -> NvmlSource | None:
    src = source_for(env)
    return src if src is not None and src.nvml is not None else None  # a setting that describes no GPUs: nvml.py


def _source_uuids(src: NvmlSource) -> list[str] | None:
    """The UUIDs of the source's GPUs, in NVML's order; None when its NVML cannot be read."""
    from harness.gpu.nvml import read_host  # here, not above: the real path loads nothing of NVML's

    host = read_host(src.nvml)
    return None if isinstance(host, str) else [g.uuid for g in host[0]]


def has_nvidia_gpu(env: Mapping[str, str] | None = None) -> bool:
    env = os.environ if env is None else env
    src = _source(env)
    if src is not None:
        uuids = _source_uuids(src)
        return uuids is None or len(uuids) > 0  # unreadable: the driver's files are there, NVML fails
    return Path("/dev/nvidia0").exists() or PROC_GPUS.is_dir()


def _proc_uuid(folder: Path) -> str:
    try:
        for line in (folder / "information").read_text().splitlines():
            key, _, value = line.partition(":")
            if key.strip() == "GPU UUID":
                return value.strip()
    except OSError:
        pass
    return ""


def count_gpus(env: Mapping[str, str] | None = None) -> int:
    """GPUs this process may use: as many as CUDA would show it (entries CUDA drops are not counted)."""
    env = os.environ if env is None else env
    src = _source(env)
    if src is not None:
        uuids = _source_uuids(src)
        if uuids is None:
            return 0
        raw = src.visible if src.visible is not None else env.get(VISIBLE_ENV)
    else:
        folders = sorted(PROC_GPUS.iterdir()) if PROC_GPUS.is_dir() else []
        uuids, raw = [_proc_uuid(f) for f in folders], env.get(VISIBLE_ENV)
    return len(resolve_visible(raw, uuids).indices)


DEVICE_ENV = "PD_HARNESS_DEVICE"  # the default --device: a test suite or a node pins it; unset, the host decides


def default_device(env: Mapping[str, str] | None = None) -> str:
    """``cpu`` or ``gpu`` for a command given no --device: $PD_HARNESS_DEVICE, else gpu where an NVIDIA GPU is."""
    env = os.environ if env is None else env
    pinned = env.get(DEVICE_ENV, "").strip()
    if pinned:
        if pinned not in DEVICES:
            raise ConfigError(f"{DEVICE_ENV}={pinned!r}: give cpu or gpu")
        return pinned
    return "gpu" if has_nvidia_gpu(env) else "cpu"
