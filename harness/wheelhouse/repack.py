"""Repack a wheel without some of its files (kernel libraries the target GPU never loads), keeping its RECORD
true so pip installs and uninstalls it cleanly."""

from __future__ import annotations

import fnmatch
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class DroppedFile:
    path: str
    size: int  # installed bytes
    compressed: int  # bytes in the wheel


def matching(infos: list[zipfile.ZipInfo], patterns: list[str]) -> list[DroppedFile]:
    """Members of a wheel that the glob ``patterns`` name (pure: works on a remote wheel's directory too)."""
    return [
        DroppedFile(i.filename, i.file_size, i.compress_size)
        for i in infos
        if any(fnmatch.fnmatchcase(i.filename, p) for p in patterns)
    ]


def record_without(record: str, dropped: set[str]) -> str:
    """RECORD text minus the lines of dropped files (a path may be quoted when it holds a comma)."""
    out = []
    for line in record.splitlines():
        path = line[1 : line.index('"', 1)] if line.startswith('"') else line.split(",", 1)[0]
        if path not in dropped:
            out.append(line)
    return "\n".join(out) + "\n"


def drop_files(wheel: Path, patterns: list[str]) -> list[DroppedFile]:
    """Rewrite ``wheel`` in place without the members ``patterns`` name; returns what was dropped (nothing
    rewritten when nothing matches)."""
    with zipfile.ZipFile(wheel) as src:
        dropped = matching(src.infolist(), patterns)
        if not dropped:
            return []
        gone = {d.path for d in dropped}
        tmp = wheel.with_name(wheel.name + ".repack")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as dst:
            for info in src.infolist():
                if info.filename in gone:
                    continue
                if info.filename.endswith(".dist-info/RECORD"):
                    dst.writestr(info, record_without(src.read(info).decode(), gone))
                    continue
                with src.open(info) as r, dst.open(info, "w", force_zip64=info.file_size > 0x7FFFFFFF) as w:
                    shutil.copyfileobj(r, w, 1 << 20)
    os.replace(tmp, wheel)
    return dropped
