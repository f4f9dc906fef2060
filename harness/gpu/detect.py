"""Is there an NVIDIA GPU, and how many, without loading a driver library."""

from __future__ import annotations

from pathlib import Path

PROC_GPUS = Path("/proc/driver/nvidia/gpus")


def has_nvidia_gpu() -> bool:
    return Path("/dev/nvidia0").exists() or PROC_GPUS.is_dir()


def count_gpus() -> int:
    return len(list(PROC_GPUS.iterdir())) if PROC_GPUS.is_dir() else 0
