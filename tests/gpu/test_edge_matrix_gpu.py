"""Every GPU entry of configs/edge_cases.yaml (GPU-only axes: host buffer, fp8 KV, attention backends, ...) as one
collected test, skipped where GPUs are too few."""

import subprocess
import sys

import pytest

from harness.core.paths import REPO_ROOT
from harness.matrix.config import EDGE_YAML, load_matrix
from tests.gpu.test_gqa_matrix_gpu import PAIR_TIMEOUT_S


def gpu_entries():
    matrix, _ = load_matrix(EDGE_YAML)
    return [e for e in matrix.entries if e.device == "gpu"]


@pytest.mark.vllm
@pytest.mark.slow
@pytest.mark.timeout(PAIR_TIMEOUT_S + 120)  # the run's own limit first, so it is the one that reports
@pytest.mark.parametrize(
    "entry_id", [pytest.param(e.id, id=e.id, marks=pytest.mark.gpu(e.gpus)) for e in gpu_entries()]
)
def test_edge_matrix_entry_on_gpu(entry_id, tmp_path):
    argv = [
        sys.executable,
        "-m",
        "harness",
        "matrix",
        str(EDGE_YAML),
        "--only",
        entry_id,
        "--device",
        "gpu",
        "--run-dir",
        str(tmp_path / entry_id),
    ]
    r = subprocess.run(argv, cwd=REPO_ROOT, capture_output=True, text=True, timeout=PAIR_TIMEOUT_S)
    assert r.returncode == 0, f"{entry_id}: exit {r.returncode}\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
