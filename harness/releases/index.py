"""The releases of a vLLM distribution, as the package index lists them (PyPI's JSON API): no hard-coded list.

A release counts when it is final (no pre- or dev release), not yanked, and has a wheel this
interpreter can install (its tags match); ``.postN`` rebuilds count as releases of their own.
Selecting and ordering is pure (``installable``, ``between``, ``parse_range``); only ``fetch_index`` talks
to the network.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable

from packaging.tags import Tag, sys_tags
from packaging.utils import InvalidWheelFilename, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from harness.core.errors import ConfigError

INDEX_URL = os.environ.get("PD_HARNESS_INDEX_URL", "https://pypi.org/pypi")


def fetch_index(distribution: str, timeout_s: float = 60.0) -> dict:
    """The index's JSON document of ``distribution`` (``{"releases": {version: [file, ...]}}``)."""
    import requests

    url = f"{INDEX_URL.rstrip('/')}/{distribution}/json"
    try:
        r = requests.get(url, timeout=timeout_s)
        r.raise_for_status()
        return r.json()
    except (requests.RequestException, ValueError) as e:
        raise ConfigError(f"cannot list the releases of {distribution} from {url}: {e}") from None


def installable(doc: dict, tags: Iterable[Tag] | None = None) -> list[str]:
    """Final, not yanked releases with a wheel for ``tags`` (default: this interpreter's), oldest first (pure)."""
    ok_tags = set(tags if tags is not None else sys_tags())
    out = []
    for raw, files in (doc.get("releases") or {}).items():
        try:
            v = Version(raw)
        except InvalidVersion:
            continue
        if v.is_prerelease or v.is_devrelease:
            continue
        for f in files or []:
            if f.get("yanked") or not str(f.get("filename", "")).endswith(".whl"):
                continue
            try:
                _, _, _, wheel_tags = parse_wheel_filename(f["filename"])
            except InvalidWheelFilename:
                continue
            if wheel_tags & ok_tags:
                out.append(raw)
                break
    return sorted(out, key=Version)


def list_releases(distribution: str, fetch: Callable[[str], dict] = fetch_index) -> list[str]:
    releases = installable(fetch(distribution))
    if not releases:
        raise ConfigError(f"the index lists no installable release of {distribution} for this interpreter")
    return releases


def between(releases: list[str], lo: str, hi: str) -> list[str]:
    """The releases from ``lo`` to ``hi``, both included, oldest first (pure). The ends must be releases."""
    for end in (lo, hi):
        if end not in releases:
            raise ConfigError(f"{end} is not a release the index lists (nearest: {', '.join(nearest(releases, end))})")
    a, b = sorted((Version(lo), Version(hi)))
    return [r for r in releases if a <= Version(r) <= b]


def nearest(releases: list[str], v: str, n: int = 3) -> list[str]:
    try:
        target = Version(v)
    except InvalidVersion:
        return releases[-n:]
    return sorted(releases, key=lambda r: abs(_num(Version(r)) - _num(target)))[:n]


def _num(v: Version) -> float:
    parts = list(v.release) + [0, 0, 0]
    return parts[0] * 1e6 + parts[1] * 1e3 + parts[2]


def parse_range(spec: str, releases: list[str]) -> list[str]:
    """``A..B`` (every release between, ends included) or ``A,B,C`` (those, each a release), oldest first (pure)."""
    spec = spec.strip()
    if ".." in spec and "," not in spec:
        lo, _, hi = spec.partition("..")
        return between(releases, lo.strip(), hi.strip())
    picked = [s.strip() for s in spec.split(",") if s.strip()]
    if not picked:
        raise ConfigError("--versions needs A..B or a comma-separated list of releases")
    unknown = [p for p in picked if p not in releases]
    if unknown:
        raise ConfigError(
            f"{unknown[0]} is not a release the index lists (nearest: {', '.join(nearest(releases, unknown[0]))})"
        )
    return sorted(set(picked), key=Version)
