"""Writing files that readers may look at while they are written, and hashing them."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def write_atomic(path: Path, text: str) -> None:
    """Write beside the target and rename: a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def sha256_of(path: Path) -> str:
    """A file's sha256, read in 1 MiB chunks (wheels and weights can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
