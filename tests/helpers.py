"""Shared test helpers."""

from __future__ import annotations

from pathlib import Path

import psutil

from harness.pipeline import RUN_TAG_ENV


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



def config_error(load, path: Path, text: str) -> str:
    """The ConfigError message that ``load`` gives for a config file holding ``text``."""
    import pytest

    from harness.config import ConfigError

    path.write_text(text)
    with pytest.raises(ConfigError) as e:
        load(path)
    return str(e.value)
