"""Where GPU discovery reads the GPUs from: the real NVML, or a source put in its place for the whole process.

Discovery (nvml.py, detect.py) asks the installed source, if any, at each call with the environment it was given; a
source that answers None leaves the real NVML in place. The simulated GPU box (harness/simbox, switched on by
PD_HARNESS_SIMULATED_GPUS) is such a source, installed at the top of a process (``python -m harness``, a stand-in
server, the test session): discovery itself never imports it. Standard library only: ``python -m harness`` imports
this at start-up.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class NvmlSource:
    """GPUs to read in place of the real NVML, as a source found them described in the environment."""

    setting: str  # what described them, as NAME=VALUE: discovery's one-line description names it
    value: str  # the setting's value, kept as Discovery.simulated
    nvml: Any = None  # a module with pynvml's functions; None: the setting describes no GPUs, ``problem`` says why
    problem: str | None = None
    visible: str | None = None  # the caller's CUDA_VISIBLE_DEVICES on those GPUs; None: the environment's


# The environment -> a source, or None for the real NVML.
Picker = Callable[[Mapping[str, str]], NvmlSource | None]

_picker: Picker | None = None


def use_source(picker: Picker | None) -> Picker | None:
    """Install ``picker`` for this process (None: the real NVML only); returns the one it replaces."""
    global _picker
    before, _picker = _picker, picker
    return before


def source_for(env: Mapping[str, str]) -> NvmlSource | None:
    """What the installed picker finds in ``env``; None when none is installed or it leaves the real NVML."""
    return _picker(env) if _picker is not None else None
