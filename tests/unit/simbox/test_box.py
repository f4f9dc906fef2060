"""The simulated box as discovery's source (harness/simbox/box.py): what it finds in the environment, and that a
`python -m harness` process installs it at its top (the test session does the same, so the tests beside these rely
on it)."""

from __future__ import annotations

import os
import subprocess
import sys

from harness.core.paths import REPO_ROOT
from harness.simbox.box import SIMULATED_ENV, simulated_source
from harness.simbox.claims import STATE_ENV


def test_the_source_is_the_switch_read_at_each_call():
    assert simulated_source({}) is None and simulated_source({SIMULATED_ENV: "  "}) is None
    src = simulated_source({SIMULATED_ENV: " 8x40:visible=1,2 "})
    assert src is not None and src.setting == f"{SIMULATED_ENV}=8x40:visible=1,2" and src.value == "8x40:visible=1,2"
    assert src.visible == "1,2" and src.nvml is not None and src.problem is None
    bad = simulated_source({SIMULATED_ENV: "8x80:colour=red"})
    assert bad is not None and bad.nvml is None and bad.value == "8x80:colour=red"
    assert bad.problem is not None and "'colour=red' is not visible=IDS" in bad.problem


def test_python_m_harness_reads_the_simulated_box(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER")}
    env.update({SIMULATED_ENV: "4x40:visible=2,3", STATE_ENV: str(tmp_path / "box")})
    got = subprocess.run(
        [sys.executable, "-m", "harness", "plan", "--tp-p", "1", "--tp-d", "1", "--weights-gib", "1"],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert got.returncode == 0, got.stderr
    assert "GPU plan: 2 GPUs (ids 2,3) x 40 GiB (NVIDIA A100-SXM4-40GB)" in got.stdout
