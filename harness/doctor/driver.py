"""The NVIDIA driver a CUDA build needs (pure).

Linux driver versions from NVIDIA's CUDA Toolkit release notes
(https://docs.nvidia.com/cuda/cuda-toolkit-release-notes/, the tables "CUDA Toolkit and Minimum Required Driver
Version for CUDA Minor Version Compatibility" and "CUDA Toolkit and Corresponding Driver Versions"). A torch wheel
built with CUDA X.Y runs on any driver of the X.* minor-compatibility minimum; below it, CUDA does not initialize
("CUDA driver version is insufficient") and every server fails at its first start.
"""

from __future__ import annotations

MINOR_COMPAT_MIN = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}
# The driver each toolkit release shipped with: kernels compiled at run time (Triton's PTX) may need it.
TOOLKIT_DRIVER = {
    "11.8": "520.61.05",
    "12.1": "530.30.02",
    "12.4": "550.54.14",
    "12.6": "560.28.03",
    "12.8": "570.26",
    "12.9": "575.51.03",
    "13.0": "580.65.06",
}


def version_key(v: str) -> tuple[int, ...]:
    """``"570.86.15"`` as numbers, for comparing (ValueError for a version that is not dotted numbers)."""
    return tuple(int(p) for p in v.strip().split("."))


def min_driver(cuda: str) -> str | None:
    """The oldest driver that runs a CUDA ``cuda`` (e.g. ``"12.8"``) build; None: a CUDA major the table lacks."""
    try:
        major = version_key(cuda)[0]
    except (ValueError, IndexError):
        return None
    return MINOR_COMPAT_MIN.get(major)


def driver_problem(driver: str, cuda: str) -> str | None:
    """Why ``driver`` cannot run a CUDA ``cuda`` build, one line (None: it can)."""
    need = min_driver(cuda)
    if need is None:
        return f"CUDA {cuda} is not in the driver table of harness/doctor/driver.py: add it from NVIDIA's release notes"
    try:
        old = version_key(driver) < version_key(need)
    except ValueError:
        return f"driver version {driver!r} cannot be read"
    return f"driver {driver} is older than CUDA {cuda} needs (>= {need})" if old else None
