"""Shared by the wheelhouse tests: recorded index data (data/), small wheels and wheelhouse folders made on the
spot."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

from harness.core.files import sha256_of
from harness.wheelhouse.build import Request, wheel_metadata
from harness.wheelhouse.pip import Sources

DATA = Path(__file__).parent / "data"
PLATFORM = "manylinux_2_31_x86_64"


def gpu_request(**kw) -> Request:
    """A dry-run GPU wheelhouse request for this test machine's Python; ``kw`` overrides a field."""
    args = dict(
        out=None,
        device="gpu",
        python_version="3.12",
        platform=PLATFORM,
        resolver_python=sys.executable,
        sources=Sources(),
        torch="2.14.0+cu130",
        dry_run=True,
    )
    return Request(**{**args, **kw})


def load(name: str):
    return json.loads((DATA / name).read_text())


def make_wheel(
    folder: Path,
    name: str,
    version: str,
    requires: tuple[str, ...] | list[str] = (),
    files: dict[str, bytes] | None = None,
) -> Path:
    """A small wheel with METADATA (these requirements), WHEEL and RECORD."""
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    files = dict(files or {f"{dist}/__init__.py": b""})
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(
        f"Requires-Dist: {r}\n" for r in requires
    )
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(
            f"{info}/RECORD",
            "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items())
            + f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n",
        )
    return path


def write_manifest(folder: Path, wheels: list[Path], roots: list[str], left_out: list[dict], no_deps=()) -> None:
    """manifest.json and requirements.txt of a wheelhouse holding ``wheels``, for this interpreter's Python."""
    entries = []
    for p in wheels:
        name, version, _ = wheel_metadata(p)
        entries.append(
            {"name": name, "version": version, "file": p.name, "sha256": sha256_of(p), "size": p.stat().st_size}
        )
    py = "{}.{}".format(*sys.version_info[:2])
    (folder / "manifest.json").write_text(
        json.dumps(
            {
                "format": 1,
                "device": "gpu",
                "target": {"python": py, "platform": "manylinux_2_31_x86_64"},
                "wheels": entries,
                "left_out": left_out,
                "no_deps": list(no_deps),
            }
        )
    )
    (folder / "requirements.txt").write_text("".join(r + "\n" for r in roots))
