import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_configure(config):
    # The CPU tests are CPU tests on any host: a command they run without --device takes cpu (harness/gpu/detect.py
    # default_device). GPU tests name --device gpu themselves.
    os.environ["PD_HARNESS_DEVICE"] = "cpu"  # the markers are in pyproject.toml


def gpus_present() -> tuple[int, str]:
    """How many NVIDIA GPUs this machine has, and how that was found: NVML when a driver answers, else /proc."""
    from harness.gpu.nvml import discover

    d = discover()
    if d.available:
        return d.count, "NVML"
    proc = Path("/proc/driver/nvidia/gpus")
    n = len(list(proc.iterdir())) if proc.is_dir() else 0
    return n, f"{d.reason}; /proc/driver/nvidia/gpus lists {n}"


def gpus_needed(marker) -> int:
    n = marker.args[0] if marker.args else marker.kwargs.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise pytest.UsageError(f"gpu marker needs a positive GPU count, got {n!r}")
    return n


def pytest_collection_modifyitems(config, items):
    marked = [(item, item.get_closest_marker("gpu")) for item in items]
    marked = [(item, m) for item, m in marked if m is not None]
    if not marked:
        return
    present, how = gpus_present()
    for item, m in marked:
        n = gpus_needed(m)
        if present < n:
            what = "an NVIDIA GPU" if n == 1 else f"{n} NVIDIA GPUs"
            item.add_marker(pytest.mark.skip(reason=f"needs {what}; {present} on this machine ({how})"))
