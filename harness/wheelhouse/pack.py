"""Pack a wheelhouse into numbered parts of at most N MiB, for a node that can only be reached through small
transfers: wheels re-stored without zip compression (so one xz stream over all of them compresses far better than
deflate did), one tar, xz (which the node's Python reads with its standard library), split.

On the node the parts go back together with ``cat`` and Python's tarfile (UNPACK.txt in the parts folder has the
line); ``make setup WHEELHOUSE=...`` then installs from the folder as from any wheelhouse.
"""

from __future__ import annotations

import contextlib
import json
import lzma
import os
import shlex
import shutil
import subprocess
import tarfile
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from harness.core.files import sha256_of
from harness.core.notrack import with_no_track

MIB = 1 << 20
# xz writes its output a block (24 MiB of input) at a time: seconds apart; estimated ~20 s on 2 busy cores from the
# 26 min a 480 MiB pack took there (docs/offline-install.md). This long without a byte it has hung: killed.
XZ_STALL_S = 300.0


class XzFailed(RuntimeError):
    """The xz command failed or hung: one line naming it."""


def restore_stored(src: Path, dst: Path) -> None:
    """The same wheel with every member stored (no deflate): same files, same RECORD, installs the same."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_STORED) as zout:
        for info in zin.infolist():
            out = zipfile.ZipInfo(info.filename, info.date_time)
            out.external_attr = info.external_attr
            out.compress_type = zipfile.ZIP_STORED
            with zin.open(info) as r, zout.open(out, "w", force_zip64=info.file_size > 0x7FFFFFFF) as w:
                shutil.copyfileobj(r, w, 1 << 20)


@dataclass(frozen=True)
class Packed:
    parts: tuple[Path, ...]
    bytes: int
    unpack: str  # the command that reassembles the folder on the node


@contextlib.contextmanager
def _xz_writer(path: Path, threads: int) -> Iterator[IO[bytes]]:
    """A writable stream that xz-compresses into ``path``: the xz command (multi-threaded) when there is one,
    else Python's lzma (one thread). Raises XzFailed when xz fails or writes nothing for ``XZ_STALL_S``."""
    xz = shutil.which("xz")
    if not xz:
        with lzma.open(path, "wb", preset=6) as f:
            yield f
        return
    cmd = [xz, "-6", f"-T{threads}", "-c"]
    with open(path, "wb") as out:
        proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=out, env=with_no_track(os.environ))
    stalled = threading.Event()
    watch = threading.Thread(target=_watch_xz, args=(proc, path, stalled), name="xz-watch", daemon=True)
    watch.start()
    assert proc.stdin is not None  # stdin=PIPE
    try:
        yield proc.stdin
    finally:
        with contextlib.suppress(BrokenPipeError):  # xz is gone: said below
            proc.stdin.close()
        rc = proc.wait()
        watch.join()
        # raised here, it replaces what writing to a killed xz raised (BrokenPipeError): the cause, in one line
        if stalled.is_set():
            raise XzFailed(f"{shlex.join(cmd)}: wrote nothing for {XZ_STALL_S:g} s (killed)")
        if rc:
            raise XzFailed(f"{shlex.join(cmd)} failed with exit code {rc}")


def _watch_xz(proc: subprocess.Popen[bytes], path: Path, stalled: threading.Event) -> None:
    """Kill ``proc`` (xz) once ``path``, its output, has not grown for ``XZ_STALL_S``; return when it exits."""
    size, since = -1, time.monotonic()
    while True:
        try:
            proc.wait(timeout=min(1.0, XZ_STALL_S / 4))
            return
        except subprocess.TimeoutExpired:
            pass
        now = path.stat().st_size
        if now != size:
            size, since = now, time.monotonic()
        elif time.monotonic() - since >= XZ_STALL_S:
            stalled.set()
            proc.kill()
            return


def pack(folder: Path, out: Path, part_mib: int = 60, threads: int = 2) -> Packed:
    """``folder`` (a wheelhouse) as ``out/<name>.tar.xz.000``, ``.001``... each at most ``part_mib`` MiB."""
    manifest = json.loads((folder / "manifest.json").read_text())
    out.mkdir(parents=True, exist_ok=True)
    stage = out / ".stage" / folder.name
    shutil.rmtree(out / ".stage", ignore_errors=True)
    stage.mkdir(parents=True)
    for w in manifest["wheels"]:
        dst = stage / w["file"]
        restore_stored(folder / w["file"], dst)
        w.setdefault("deflated_sha256", w["sha256"])
        w["sha256"], w["size"] = sha256_of(dst), dst.stat().st_size
    manifest["packed"] = {"stored": True, "note": "wheels re-stored without zip compression for the xz parts"}
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    for name in ("requirements.txt", "requirements-nodeps.txt"):
        if (folder / name).exists():
            shutil.copyfile(folder / name, stage / name)
    whole = out / ".stage" / f"{folder.name}.tar.xz"
    with _xz_writer(whole, threads) as stream, tarfile.open(fileobj=stream, mode="w|") as tar:
        tar.add(stage, arcname=folder.name)
    for old in out.glob(f"{folder.name}.tar.xz.*"):
        old.unlink()
    parts = []
    with open(whole, "rb") as f:
        for i, chunk in enumerate(iter(lambda: f.read(part_mib * MIB), b"")):
            p = out / f"{folder.name}.tar.xz.{i:03d}"
            p.write_bytes(chunk)
            parts.append(p)
    size = whole.stat().st_size
    shutil.rmtree(out / ".stage", ignore_errors=True)
    unpack = (
        f'cat {folder.name}.tar.xz.* | python3 -c "import sys, tarfile; '
        f"tarfile.open(fileobj=sys.stdin.buffer, mode='r|xz').extractall(sys.argv[1], filter='data')\" DEST"
    )
    (out / "UNPACK.txt").write_text(
        f"# {len(parts)} parts, {size / MIB:.1f} MiB; put them in one folder, then (DEST: where {folder.name}/ goes):\n"
        f"{unpack}\n# then: make setup WHEELHOUSE=DEST/{folder.name}\n"
    )
    return Packed(tuple(parts), size, unpack)
