"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import psutil

from harness.run.launch import RUN_TAG_ENV


def processes_tagged(logs_dir: Path) -> list[int]:
    """PIDs of live processes that a harness run with this logs folder started."""
    tag = str(logs_dir)
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.environ().get(RUN_TAG_ENV) == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            pass
    return out


def tiny_server_setup() -> tuple:
    """(config, tiny model path, block size, P's and D's CPU binding) for tests that start their own servers."""
    import os
    import sys

    from harness.run.config import E2EConfig
    from harness.models.tiny import ensure_tiny_model
    from harness.serve.vllm_cmd import plan_cpu_binding

    cfg = E2EConfig(python=sys.executable)
    return cfg, str(ensure_tiny_model()), cfg.block_sizes()[0], plan_cpu_binding(os.cpu_count() or 1, [1, 1])


def config_error(load, path: Path, text: str) -> str:
    """The ConfigError message that ``load`` gives for a config file holding ``text``."""
    import pytest

    from harness.core.errors import ConfigError

    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(path)
    return str(e.value)
