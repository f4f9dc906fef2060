"""What a CI file's timeouts must hold, shared by the tests of ci/nightly-gpu.yml (tests/unit/test_nightly.py) and
ci/buildkite/ (test_buildkite.py): one vLLM version's night at its worst case, on the simulated 8-GPU boxes a
nightly runner is (8 x 40 and 8 x 80 GiB), the larger of the two."""

from __future__ import annotations

from pathlib import Path

from harness import nightly
from harness.gpu.nvml import Discovery, discover
from harness.simbox.box import parse_box

BOXES = ("8x40", "8x80")  # PD_HARNESS_SIMULATED_GPUS values
PY = "/opt/py/bin/python"
SETUP_S = 60 * 60  # `make setup DEVICE=gpu`: the workflow's timeout for that step, which each Buildkite step repeats


def box(spec: str) -> Discovery:
    """A simulated box as NVML shows it, the caller's CUDA_VISIBLE_DEVICES unset."""
    return discover(parse_box(spec).module(), {})


def worst_case_night_s(version: str | None = None) -> float:
    """The longest one version's night (None: the pinned one) can take, on the larger of its worst cases on BOXES."""
    versions = [version] if version else []
    return max(
        nightly.worst_case_s(nightly.build_steps(box(b).plan_gpus(), PY, Path("/runs/n"), versions)) for b in BOXES
    )
