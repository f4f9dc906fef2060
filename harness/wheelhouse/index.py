"""Reading a package index: a project's files (PEP 691 JSON simple API), which of them install on a target
(wheel tags), and a wheel's METADATA (the PEP 658 ``.metadata`` file, else read out of the remote zip).

The parsing and tag logic are pure; ``Index`` is the only part that touches the network.
"""

from __future__ import annotations

import io
import json
import re
import urllib.error
import urllib.request
import zipfile
from dataclasses import dataclass
from email.parser import HeaderParser

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.tags import Tag, compatible_tags, cpython_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

PYPI = "https://pypi.org/simple"
_MANYLINUX = re.compile(r"^manylinux_(\d+)_(\d+)_(\w+)$")
# The legacy manylinux names and the glibc they stand for (PEP 600).
_LEGACY = {"manylinux2014": (2, 17), "manylinux2010": (2, 12), "manylinux1": (2, 5)}


@dataclass(frozen=True)
class IndexFile:
    filename: str
    url: str
    size: int | None
    sha256: str | None
    requires_python: str | None
    yanked: bool

    @property
    def is_wheel(self) -> bool:
        return self.filename.endswith(".whl")


def parse_project_page(data: dict) -> list[IndexFile]:
    """The files of a PEP 691 JSON project page."""
    out = []
    for f in data.get("files", []):
        out.append(
            IndexFile(
                filename=f["filename"],
                url=f["url"],
                size=f.get("size"),
                sha256=(f.get("hashes") or {}).get("sha256"),
                requires_python=f.get("requires-python"),
                yanked=bool(f.get("yanked")),
            )
        )
    return out


def expand_platform(platform: str) -> list[str]:
    """``manylinux_2_31_x86_64`` and every older manylinux tag it implies, newest first; pip (23.x) takes
    ``--platform`` literally, so a wheel tagged only ``manylinux_2_17`` would otherwise be missed."""
    m = _MANYLINUX.match(platform)
    if not m:
        return [platform]
    major, minor, arch = int(m.group(1)), int(m.group(2)), m.group(3)
    out = [f"manylinux_{major}_{n}_{arch}" for n in range(minor, 4, -1)] if major == 2 else [platform]
    out += [f"{legacy}_{arch}" for legacy, (_, lo) in _LEGACY.items() if major == 2 and lo <= minor]
    return out


def platform_machine(platform: str) -> str:
    """The ``platform_machine`` marker value a platform tag implies (x86_64, aarch64)."""
    for prefix in ("manylinux_", "musllinux_"):
        if platform.startswith(prefix):
            return platform.split("_", 3)[3]
    for legacy in _LEGACY:
        if platform.startswith(legacy + "_"):
            return platform[len(legacy) + 1 :]
    return platform.split("_", 1)[1] if platform.startswith("linux_") else platform


def target_tags(python_version: str, platforms: list[str]) -> list[Tag]:
    """Tags a CPython ``python_version`` (``3.12``) interpreter on ``platforms`` accepts, best first."""
    pv = tuple(int(x) for x in python_version.split(".")[:2])
    abi = f"cp{pv[0]}{pv[1]}"
    return [*cpython_tags(pv, abis=[abi], platforms=platforms), *compatible_tags(pv, abi, platforms)]


def wheel_rank(filename: str, tags: list[Tag]) -> int | None:
    """Position of the wheel's best tag in ``tags`` (lower is better); None when it does not install there."""
    try:
        _, _, _, wtags = parse_wheel_filename(filename)
    except InvalidWheelFilename:
        return None
    index = {t: i for i, t in enumerate(tags)}
    ranks = [index[t] for t in wtags if t in index]
    return min(ranks) if ranks else None


def wheel_version(filename: str) -> Version | None:
    try:
        return parse_wheel_filename(filename)[1]
    except (InvalidWheelFilename, InvalidVersion):
        return None


def file_version(filename: str) -> Version | None:
    """A wheel's or an sdist's version from its file name (packaging's rules); None for a name they refuse."""
    try:
        return (parse_wheel_filename(filename) if filename.endswith(".whl") else parse_sdist_filename(filename))[1]
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        return None


def _admits_python(f: IndexFile, python_version: str) -> bool:
    if not f.requires_python:
        return True
    try:
        return SpecifierSet(f.requires_python).contains(python_version + ".0")
    except InvalidSpecifier:
        return True


def served_versions(files: list[IndexFile], python_version: str, platforms: list[str]) -> list[Version]:
    """The versions of a project that a resolution for the target can take from these files, newest first: a wheel
    whose tags install there, or an sdist (a wheelhouse build makes a pure-Python wheel of it), not yanked, with a
    Requires-Python that admits the target's Python. Pre-releases included: whether they count is the specifier's
    business, as in pip."""
    tags = target_tags(python_version, platforms)
    out: set[Version] = set()
    for f in files:
        if f.yanked or not _admits_python(f, python_version):
            continue
        if f.is_wheel and wheel_rank(f.filename, tags) is None:
            continue
        v = file_version(f.filename)
        if v is not None:
            out.add(v)
    return sorted(out, reverse=True)


def releases(
    files: list[IndexFile], python_version: str, platforms: list[str], pre: bool = False
) -> dict[Version, IndexFile]:
    """The best wheel of each release that installs on the target, newest release first (yanked and, unless
    ``pre``, pre-releases left out)."""
    tags = target_tags(python_version, platforms)
    best: dict[Version, tuple[int, IndexFile]] = {}
    for f in files:
        if not f.is_wheel or f.yanked:
            continue
        v = wheel_version(f.filename)
        rank = wheel_rank(f.filename, tags)
        if v is None or rank is None or (v.is_prerelease and not pre):
            continue
        if not _admits_python(f, python_version):
            continue
        if v not in best or rank < best[v][0]:
            best[v] = (rank, f)
    return {v: best[v][1] for v in sorted(best, reverse=True)}


def requires_dist(metadata: str) -> list[str]:
    """The Requires-Dist lines of a METADATA file."""
    return [v.strip() for v in HeaderParser().parsestr(metadata).get_all("Requires-Dist") or []]


def min_glibc(files: list[IndexFile], python_version: str, arch: str, specifier: str = "") -> tuple[int, int] | None:
    """The oldest glibc any wheel of a release in ``specifier`` needs for the Python and machine: used to explain
    why none matched a ``--platform`` (e.g. llguidance 1.7 ships only manylinux_2_31 wheels for x86_64)."""
    spec = SpecifierSet(specifier)
    tags = target_tags(python_version, expand_platform(f"manylinux_2_99_{arch}"))
    best = None
    for f in files:
        v = wheel_version(f.filename) if f.is_wheel else None
        if v is None or not spec.contains(v, prereleases=True) or wheel_rank(f.filename, tags) is None:
            continue
        for t in parse_wheel_filename(f.filename)[3]:
            m = _MANYLINUX.match(t.platform)
            glibc = (
                (int(m.group(1)), int(m.group(2)))
                if m
                else next((_LEGACY[k] for k in _LEGACY if t.platform.startswith(k + "_")), None)
            )
            if glibc and t.platform.endswith(arch) and (best is None or glibc < best):
                best = glibc
    return best


class _HttpRangeFile(io.RawIOBase):
    """A seekable read-only view of a remote file through HTTP range requests, so zipfile reads only the central
    directory and the members asked for (a 300 MB wheel costs a few hundred KB)."""

    def __init__(self, url: str, size: int, timeout: float):
        self.url, self.size, self.timeout, self.pos = url, size, timeout, 0

    def seekable(self) -> bool:
        return True

    def readable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = 0) -> int:
        self.pos = {0: offset, 1: self.pos + offset, 2: self.size + offset}[whence]
        return self.pos

    def tell(self) -> int:
        return self.pos

    def read(self, n: int = -1) -> bytes:
        end = self.size if n is None or n < 0 else min(self.size, self.pos + n)
        if end <= self.pos:
            return b""
        req = urllib.request.Request(self.url, headers={"Range": f"bytes={self.pos}-{end - 1}"})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            data = r.read()
        if len(data) != end - self.pos:
            raise OSError(f"range request to {self.url} returned {len(data)} bytes, not {end - self.pos}")
        self.pos = end
        return data

    def readinto(self, b) -> int:
        data = self.read(len(b))
        b[: len(data)] = data
        return len(data)


class Index:
    """A PEP 691 index (PyPI by default)."""

    def __init__(self, url: str = PYPI, timeout: float = 60.0):
        self.url = url.rstrip("/")
        self.timeout = timeout

    def _get(self, url: str, accept: str | None = None) -> bytes:
        req = urllib.request.Request(url, headers={"Accept": accept} if accept else {})
        with urllib.request.urlopen(req, timeout=self.timeout) as r:
            return r.read()

    def project(self, name: str) -> list[IndexFile]:
        data = self._get(f"{self.url}/{canonicalize_name(name)}/", "application/vnd.pypi.simple.v1+json")
        return parse_project_page(json.loads(data))

    def metadata(self, f: IndexFile) -> str:
        """A wheel's METADATA: PyPI serves it beside the wheel (PEP 658) even where the index page does not say
        so; other indexes may not, and then the wheel's zip directory is read through range requests."""
        try:
            return self._get(f.url.split("#")[0] + ".metadata").decode()
        except urllib.error.HTTPError as e:
            if e.code != 404:
                raise
        with self.remote_wheel(f) as z:
            name = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
            return z.read(name).decode()

    def remote_wheel(self, f: IndexFile) -> zipfile.ZipFile:
        size = f.size
        if size is None:
            req = urllib.request.Request(f.url, method="HEAD")
            with urllib.request.urlopen(req, timeout=self.timeout) as r:
                size = int(r.headers["Content-Length"])
        return zipfile.ZipFile(io.BufferedReader(_HttpRangeFile(f.url.split("#")[0], size, self.timeout), 1 << 16))
