import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from tests.helpers import FULL  # noqa: E402  (the repository root on sys.path first)


def pytest_configure(config):
    # The CPU tests are CPU tests on any host: a command they run without --device takes cpu (harness/gpu/detect.py
    # default_device). GPU tests name --device gpu themselves.
    os.environ["PD_HARNESS_DEVICE"] = "cpu"  # the markers are in pyproject.toml
    # As in `python -m harness`: a test that sets PD_HARNESS_SIMULATED_GPUS gets the simulated box from discovery.
    from harness.simbox.box import install_source

    install_source()


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
    if not FULL:
        for item in items:
            m = item.get_closest_marker("full")
            if m is not None:
                what = m.args[0] if m.args else "beyond CI's cut"
                item.add_marker(pytest.mark.skip(reason=f"{what}: not in CI's cut; `make test-full` runs it"))
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


# Seconds per test module (setup, call and teardown summed), printed at the end of the run in a few lines: CI shows
# only the tail of its output, and this is where its time went.
_MODULE_S: dict[str, float] = {}


def pytest_runtest_logreport(report):
    module = report.nodeid.split("::")[0].removeprefix("tests/").removesuffix(".py")
    _MODULE_S[module] = _MODULE_S.get(module, 0.0) + report.duration


def pytest_terminal_summary(terminalreporter):
    slow = sorted(((s, m) for m, s in _MODULE_S.items() if s >= 10), reverse=True)
    if slow:
        rest = sum(_MODULE_S.values()) - sum(s for s, _ in slow)
        listed = ", ".join(f"{m.replace('integration/', '')} {s:.0f}" for s, m in slow)
        terminalreporter.write_line(f"seconds per module (10 s or more): {listed}; all others {rest:.0f}")
