"""Writing files that readers may look at while they are written, hashing them, and the folders runs write into."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from collections.abc import Sequence
from pathlib import Path

from harness.core.errors import ConfigError

# What a harness run leaves in its folder (glob patterns: an e2e's report and logs, a matrix's pair folders): a folder
# holding one is an earlier run's, refused for a new run and the only kind --overwrite-run-dir empties. Anything else
# in it (a Ray task's task.log, a note) is left alone: it cannot feed the run's failure classification.
RUN_MARKERS = ("report.json", "logs", "vllm-*")
OVERWRITE_FLAG = "--overwrite-run-dir"


def write_atomic(path: Path, text: str) -> None:
    """Write beside the target under a name of this call's own, then rename: a reader never sees half a file, and two
    writers (threads or processes) each replace it whole."""
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        # mkstemp's 0600 would hide reports from other users: keep the file's mode, or what write_text would give
        os.chmod(tmp, path.stat().st_mode & 0o7777 if path.exists() else 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def sha256_of(path: Path) -> str:
    """A file's sha256, read in 1 MiB chunks (wheels and weights can be large)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def run_dir_problem(
    path: Path, overwrite: bool = False, flag: str = OVERWRITE_FLAG, markers: Sequence[str] = RUN_MARKERS
) -> str | None:
    """Why ``path`` cannot be a new run's folder (None: it can). A folder an earlier run left (one of ``markers``) is
    refused (its logs would feed the new run's failure classification) unless ``overwrite``; ``overwrite`` of a folder
    that holds something else is refused, so that emptying never deletes anything but a run."""
    try:
        if not path.exists():
            return None
        if not path.is_dir():
            return f"{path} exists and is not a folder"
        used = any(any(path.glob(m)) for m in markers)
        if used and not overwrite:
            return f"{path} holds an earlier run: a run folder is never reused (a new folder, or {flag} to empty it)"
        if overwrite and not used and any(path.iterdir()):
            return f"{path} does not look like a run folder (no {' or '.join(markers)}): {flag} empties only those"
    except OSError as e:
        return f"{path}: {e.strerror or e}"
    return None


def claim_run_dir(
    path: Path, overwrite: bool = False, flag: str = OVERWRITE_FLAG, markers: Sequence[str] = RUN_MARKERS
) -> None:
    """Make ``path`` a new run's folder: ConfigError (one line) for what ``run_dir_problem`` refuses; with
    ``overwrite``, an earlier run's folder is emptied (the folder itself stays: it may be a link someone follows)."""
    problem = run_dir_problem(path, overwrite, flag, markers)
    if problem:
        raise ConfigError(problem)
    if overwrite and path.is_dir() and any(any(path.glob(m)) for m in markers):
        for entry in path.iterdir():
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()


def new_folder(base: Path) -> Path:
    """``base``, or ``base-2``, ``base-3``, ... : the first that does not exist yet, created here (mkdir claims it, so
    two callers at once never get the same folder)."""
    base.parent.mkdir(parents=True, exist_ok=True)
    for n in range(1, 10_000):
        folder = base if n == 1 else base.with_name(f"{base.name}-{n}")
        try:
            folder.mkdir()
        except FileExistsError:
            continue
        return folder
    raise ConfigError(f"{base}: no free folder name left beside it")
