"""Build caches (models, tasks) once across processes: a file lock, a temporary folder renamed into place."""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def cache_lock_dir() -> Path:
    # Outside the cache folders, so a lock never shows up as (or inside) a cache entry.
    return Path(
        os.environ.get("PD_HARNESS_CACHE_LOCK_DIR") or Path(tempfile.gettempdir()) / "vllm-pd-harness-cache-locks"
    )


@contextlib.contextmanager
def cache_lock(target: Path) -> Iterator[None]:
    """An exclusive lock on building ``target``, across processes (``flock``: released when the holder dies)."""
    lock_dir = cache_lock_dir()
    lock_dir.mkdir(parents=True, exist_ok=True)
    key = hashlib.sha256(str(Path(target).resolve()).encode()).hexdigest()[:16]
    fd = os.open(lock_dir / f"{Path(target).name}-{key}.lock", os.O_RDWR | os.O_CREAT, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # a second builder waits here, then finds the folder built
        yield
    finally:
        os.close(fd)


def build_cached(target: Path, complete: Callable[[Path], bool], build: Callable[[Path], object]) -> Path:
    """Return ``target``, built once by ``build(folder)`` if ``complete(target)`` is false.

    Concurrent callers (threads or processes) build it once: the first takes a file lock, the others wait
    and then find it complete. The build goes into a temporary folder beside ``target`` that is renamed
    into place only when finished, so nobody ever sees a half-written cache, and a crashed build leaves
    nothing that looks cached.
    """
    target = Path(target)
    if complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with cache_lock(target):
        if complete(target):  # built by whoever held the lock before us
            return target
        if target.exists():  # not complete and nobody is building it: a leftover, never served
            shutil.rmtree(target)
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{target.name}-", dir=target.parent))
        try:
            build(tmp)
            try:
                os.rename(tmp, target)
            except OSError:
                if not complete(target):  # only a builder that ignores the lock could have put it there
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return target
