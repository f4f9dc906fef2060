"""What an offline wheelhouse holds, decided from recorded metadata (pure functions, no network):

- which vLLM release fits an image's torch (its ``torch==`` pin), and which nixl backend its CUDA needs;
- the dependency graph of a pip resolution (pip's ``--report``), with markers and extras evaluated for the target;
- what the target image already has (its torch and what torch pins exactly, or a ``pip freeze``), and so what is
  left out, with the reason;
- the harness's own pins that a vLLM release does not allow (vLLM's requirements win);
- whether a folder of wheels plus the image satisfies every requirement (the ``--verify`` closure check).

The package index is read in index.py, pip and the downloads run in pip.py, the steps in build.py, the command in
cli.py.
"""

from __future__ import annotations

import re
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from itertools import islice

from packaging.markers import UndefinedEnvironmentName
from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

from harness.core.errors import ConfigError

# Files a --drop-kernels name stands for, inside the vllm wheel. FA2 is vLLM's FlashAttention-2 library: on Hopper
# (sm90) vLLM picks FA3 (vllm/v1/attention/backends/fa_utils.py) and imports FA2 inside try/except
# (vllm/vllm_flash_attn/flash_attn_interface.py), so a wheel without it still serves there.
KERNEL_GLOBS = {
    "fa2": ("vllm/vllm_flash_attn/_vllm_fa2_C*.so",),
    # Fused-MoE kernels: vllm/platforms/cuda.py imports them under contextlib.suppress(ImportError); only MoE
    # layers call torch.ops._moe_C. Dense models (Llama, TinyLlama) never do.
    "moe": ("vllm/_moe_C*.so",),
    # The Rust frontend binary: used only with VLLM_USE_RUST_FRONTEND=1 (vllm/envs.py).
    "rust-frontend": ("vllm/vllm-rs",),
}
_CUDA_LOCAL = re.compile(r"^cu(\d+)$")
_CUDA_NAME = re.compile(r"-cu(\d+)$")


def canon(name: str) -> str:
    return canonicalize_name(name)


@dataclass(frozen=True)
class Dist:
    """One distribution of a resolution (an entry of pip's ``--report``)."""

    name: str  # canonical
    version: str
    requires: tuple[str, ...]
    url: str = ""
    sha256: str = ""
    requested: bool = False
    extras: tuple[str, ...] = ()  # extras asked for on the command line (requested dists only)


def parse_report(report: dict) -> list[Dist]:
    """The install list of pip's ``install --dry-run --report`` JSON."""
    out = []
    for item in report.get("install", []):
        m = item["metadata"]
        info = item.get("download_info") or {}
        hashes = (info.get("archive_info") or {}).get("hashes") or {}
        out.append(
            Dist(
                canon(m["name"]),
                m["version"],
                tuple(m.get("requires_dist") or ()),
                info.get("url", ""),
                hashes.get("sha256", ""),
                bool(item.get("requested")),
                tuple(item.get("requested_extras") or ()),
            )
        )
    return out


def marker_env(python_version: str, machine: str) -> dict[str, str]:
    """Marker values of a Linux CPython ``python_version`` target on ``machine``."""
    return {
        "python_version": python_version,
        "python_full_version": python_version + ".0",
        "sys_platform": "linux",
        "platform_system": "Linux",
        "os_name": "posix",
        "platform_machine": machine,
        "implementation_name": "cpython",
        "platform_python_implementation": "CPython",
        "implementation_version": python_version + ".0",
        "platform_release": "",
        "platform_version": "",
    }


def applies(req: Requirement, env: dict[str, str], extras: tuple[str, ...] | frozenset[str] = ()) -> bool:
    """Does the requirement apply on the target, with these extras of its owner active?"""
    if req.marker is None:
        return True
    try:
        return any(req.marker.evaluate({**env, "extra": e}) for e in ("", *extras))
    except UndefinedEnvironmentName:
        return True


def parse_requirement(line: str) -> Requirement | None:
    try:
        return Requirement(line)
    except InvalidRequirement:
        return None


@dataclass(frozen=True)
class Edge:
    src: str  # "" for a root requirement (the command line)
    dst: str
    spec: str  # the specifier text, "" when any version does
    line: str  # the requirement as written


@dataclass
class Graph:
    """Who needs whom in a resolution, for one target."""

    dists: dict[str, Dist]
    edges: list[Edge]
    extras: dict[str, set[str]] = field(default_factory=dict)  # extras active on each dist

    def into(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.dst == name]

    def out_of(self, name: str) -> list[Edge]:
        return [e for e in self.edges if e.src == name]

    def reachable(self, start: list[str], blocked: AbstractSet[str] = frozenset()) -> set[str]:
        """Dists reachable from ``start`` without passing through ``blocked`` (those are not expanded)."""
        seen: set[str] = set()
        todo = deque(n for n in start if n in self.dists)
        while todo:
            n = todo.popleft()
            if n in seen:
                continue
            seen.add(n)
            if n in blocked:
                continue
            todo.extend(e.dst for e in self.out_of(n) if e.dst not in seen)
        return seen


def build_graph(dists: list[Dist], env: dict[str, str], roots: Sequence[str] = ()) -> Graph:
    """Edges of the resolution: each dist's requirements that apply on the target with its active extras (an
    extra is active when a root or a dependent asks for it). ``roots`` are the command-line requirement lines
    (their edges come from ""); requested dists without a line are roots too."""
    by_name = {d.name: d for d in dists}
    extras: dict[str, set[str]] = {d.name: set(d.extras) for d in dists}
    edges: list[Edge] = []
    root_reqs = [r for r in (parse_requirement(x) for x in roots) if r is not None]
    for root in root_reqs:
        if canon(root.name) in by_name and applies(root, env):
            extras[canon(root.name)] |= set(root.extras)
            edges.append(Edge("", canon(root.name), str(root.specifier), str(root)))
    named = {canon(root.name) for root in root_reqs}
    for d in dists:
        if d.requested and d.name not in named:
            edges.append(Edge("", d.name, "", d.name))
    # Extras switch on requirements that may switch on further extras: iterate to a fixed point.
    changed = True
    while changed:
        changed = False
        for d in dists:
            for line in d.requires:
                r = parse_requirement(line)
                if r is None or canon(r.name) not in by_name or not applies(r, env, tuple(extras[d.name])):
                    continue
                new = set(r.extras) - extras[canon(r.name)]
                if new:
                    extras[canon(r.name)] |= new
                    changed = True
    seen = set()
    for d in dists:
        for line in d.requires:
            r = parse_requirement(line)
            if r is None or canon(r.name) not in by_name or not applies(r, env, tuple(extras[d.name])):
                continue
            key = (d.name, canon(r.name), str(r.specifier))
            if key not in seen:
                seen.add(key)
                edges.append(Edge(d.name, canon(r.name), str(r.specifier), line))
    return Graph(by_name, edges, extras)


# --- the vLLM release and the CUDA of the image's torch ---------------------------------------------------------


def torch_requirement(requires: list[str], env: dict[str, str]) -> str | None:
    """The specifier a dist puts on torch for the target (``==2.11.0``), None when it has none."""
    for line in requires:
        r = parse_requirement(line)
        if r is not None and canon(r.name) == "torch" and applies(r, env):
            return str(r.specifier)
    return None


def torch_fit(requires: list[str], torch_version: str, env: dict[str, str]) -> tuple[str | None, bool]:
    """A release's torch specifier for the target, and whether it admits the image's torch (a local label such as
    ``+cu130`` is ignored by a specifier without one, as pip does)."""
    spec = torch_requirement(requires, env)
    return spec, spec is not None and SpecifierSet(spec).contains(torch_version, prereleases=True)


@dataclass(frozen=True)
class VllmCandidate:
    version: str
    torch: str | None  # its torch specifier
    fits: bool


def choose_vllm(
    candidates: Iterable[tuple[str, list[str]]], torch_version: str, env: dict[str, str], forced: str | None = None
) -> tuple[str, list[VllmCandidate]]:
    """The newest release (``candidates`` newest first: version, Requires-Dist) whose torch specifier admits the
    image's torch; with ``forced``, that release, which must admit it too. Returns the choice and the releases
    looked at. A local label (``+cu130``) is ignored by a specifier without one, as pip does."""
    checked = []
    for version, requires in candidates:
        if forced is not None and Version(version) != Version(forced):
            continue
        spec, fits = torch_fit(requires, torch_version, env)
        checked.append(VllmCandidate(version, spec, fits))
        if fits:
            return version, checked
        if forced is not None:
            raise ConfigError(
                f"vllm {version} requires torch{spec or ' (none)'}, not the image's torch {torch_version}"
            )
    if forced is not None:
        raise ConfigError(f"vllm {forced} has no wheel for this target on the index")
    seen = ", ".join(f"{c.version} (torch{c.torch})" for c in checked[:6])
    raise ConfigError(f"no vllm release on the index pins a torch that admits {torch_version}; newest seen: {seen}")


def cuda_major(torch_version: str | None = None, requires: Sequence[str] = ()) -> int | None:
    """The CUDA major of a torch build: from its local label (``+cu130`` -> 13, ``+cu128`` -> 12), else from the
    CUDA wheels its metadata requires (``cuda-toolkit==13.0.2``, ``nvidia-cudnn-cu13``); None for a CPU build or
    when nothing tells."""
    if torch_version and "+" in torch_version:
        local = torch_version.split("+", 1)[1]
        m = _CUDA_LOCAL.match(local)
        if m:
            return int(m.group(1)[:-1])
        return None  # +cpu, +rocm...: no CUDA
    for line in requires:
        r = parse_requirement(line)
        if r is None:
            continue
        name = canon(r.name)
        if name == "cuda-toolkit":
            for s in r.specifier:
                try:
                    return Version(s.version.rstrip(".*")).major
                except InvalidVersion:
                    pass
        m = _CUDA_NAME.search(name)
        if name.startswith("nvidia-") and m:
            return int(m.group(1))
    return None


def base_version(version: str) -> str:
    return version.split("+", 1)[0]


# --- when the chosen release cannot be installed: an older one that can --------------------------------------------

# How many releases older than the one that cannot be installed are looked at (each costs one metadata read).
OLDER_RELEASES = 8


@dataclass(frozen=True)
class Unserved:
    """A requirement of a release that no file the index serves for the target meets."""

    requirement: str  # "flashinfer-python==0.7.3"
    nearest: tuple[str, ...] = ()  # the served versions nearest to it: the newest below, the oldest above

    def why(self) -> str:
        name = canon(Requirement(self.requirement).name)
        if not self.nearest:
            return f"it needs {self.requirement}, and the index serves no {name} for that target"
        return (
            f"it needs {self.requirement}, which the index does not serve for that target "
            f"(nearest there: {', '.join(self.nearest)})"
        )


def _nearest(versions: list[Version], spec: SpecifierSet) -> tuple[str, ...]:
    """The served versions on either side of what the specifier names (its highest bound), finals first."""
    pivots = []
    for s in spec:
        try:
            pivots.append(Version(s.version.removesuffix(".*")))
        except InvalidVersion:
            continue
    finals = [v for v in versions if not v.is_prerelease] or versions
    if not pivots:
        return tuple(str(v) for v in sorted(finals, reverse=True)[:1])
    pivot = max(pivots)
    below = [v for v in finals if v < pivot]
    above = [v for v in finals if v > pivot]
    return tuple(str(v) for v in ([max(below)] if below else []) + ([min(above)] if above else []))


def unserved(requires: Iterable[str], env: dict[str, str], served: Callable[[str], list[Version]]) -> Unserved | None:
    """The first requirement of a release, among those that apply on the target, that no version the index serves
    for the target (``served``: canonical name -> versions) meets; None when each is met by some version. Like pip,
    a pre-release counts where the specifier names one or nothing else meets it. Only the release's own
    requirements are looked at, not theirs: what pip then finds further down is for pip to say."""
    for line in requires:
        r = parse_requirement(line)
        if r is None or r.url or not applies(r, env):
            continue
        versions = served(canon(r.name))
        if not list(r.specifier.filter(versions)):
            return Unserved(f"{canon(r.name)}{r.specifier}", _nearest(versions, r.specifier))
    return None


@dataclass(frozen=True)
class ReleaseCheck:
    """An older release looked at for the image's torch and the target."""

    version: str
    torch: str | None  # its torch specifier
    blocker: str | None  # why it cannot be installed; None: nothing in the index data stops it

    def line(self) -> str:
        return f"{self.version}: {self.blocker}" if self.blocker else f"{self.version}: nothing stops it"


def older_releases(
    candidates: Iterable[tuple[str, list[str]]],
    torch_version: str,
    env: dict[str, str],
    served: Callable[[str], list[Version]],
    limit: int = OLDER_RELEASES,
) -> Iterator[ReleaseCheck]:
    """Each of at most ``limit`` releases (``candidates``: version and Requires-Dist, newest first, all older than
    the release that cannot be installed), checked as that one was: its torch specifier must admit the image's
    torch, and the index must serve something for each of its requirements on the target. A check with no
    ``blocker`` is a release that can be installed as far as the index's data shows; a caller that asks pip
    and hears otherwise goes on with the next one. Lazy: release metadata is read only down to where the caller
    stops."""
    for version, requires in islice(candidates, limit):
        spec, fits = torch_fit(requires, torch_version, env)
        if not fits:
            yield ReleaseCheck(version, spec, f"it needs torch{spec or ' (none)'}, not {torch_version}")
            continue
        missing = unserved(requires, env, served)
        yield ReleaseCheck(version, spec, missing.why() if missing else None)


def installable_release(
    candidates: Iterable[tuple[str, list[str]]],
    torch_version: str,
    env: dict[str, str],
    served: Callable[[str], list[Version]],
    limit: int = OLDER_RELEASES,
) -> tuple[str | None, list[ReleaseCheck]]:
    """The newest of at most ``limit`` older releases that the index data lets install (None when none does), and
    the releases looked at."""
    checked = []
    for c in older_releases(candidates, torch_version, env, served, limit):
        checked.append(c)
        if c.blocker is None:
            return c.version, checked
    return None, checked


def release_advice(
    failed: str,
    torch_version: str,
    where: str,
    why: str,
    checked: list[ReleaseCheck],
    suggestion: str | None,
    command: str,
    limit: int = OLDER_RELEASES,
) -> str:
    """The one message for a release that cannot be installed: why, and which older release can, with the command
    that picks it (``command`` ends in ``--vllm`` plus that version), or that none of those looked at can."""
    head = f"vllm {failed} cannot be installed for torch {torch_version} on {where}: {why}"
    if suggestion is not None:
        skipped = [c.line() for c in checked if c.version != suggestion]
        also = f" ({'; '.join(skipped)})" if skipped else ""
        return f"{head}; vllm {suggestion} can{also}: {command}"
    if not checked:
        return f"{head}; the index has no older vllm release for that target"
    looked = "; ".join(c.line() for c in checked)
    return (
        f"{head}; no older release can (looked at {len(checked)}, at most {limit}: {looked}); give --vllm VERSION "
        "for an older one, or use an index that serves what it needs (--index-url, --find-links)"
    )


# --- what the image has, what the wheelhouse holds ----------------------------------------------------------------


def torch_pins(graph: Graph, torch: str = "torch") -> dict[str, str]:
    """Dists that torch pins exactly, directly or through other exact pins (``triton==3.6.0``,
    ``cuda-toolkit[cublas]==13.0.2`` -> ``nvidia-cublas==13.1.0.3.*``): an image with this torch has them at
    exactly the resolved version."""
    out: dict[str, str] = {}
    todo = deque([torch])
    while todo:
        n = todo.popleft()
        for e in graph.out_of(n):
            if e.dst in out or e.dst == torch:
                continue
            ops = [s.operator for s in SpecifierSet(e.spec)]
            if ops and all(op in ("==", "===") for op in ops):
                out[e.dst] = graph.dists[e.dst].version
                todo.append(e.dst)
    return out


@dataclass(frozen=True)
class LeftOut:
    name: str
    version: str | None  # the image's version; None when only "some version" is known
    why: str
    provided: bool  # the image has it (else: needed only through what the image has)


@dataclass(frozen=True)
class Kept:
    name: str
    version: str
    note: str = ""  # why a dist the image may have is in the folder anyway


def split_by_image(
    graph: Graph, image: dict[str, str | None], roots: list[str], why_image: dict[str, str]
) -> tuple[list[Kept], list[LeftOut]]:
    """Kept (to download) and left-out (the image has them) dists.

    ``image`` maps names the image has to its version (None: not known; then it does only where no requirement
    names a version). A dist is left out when the image has it at a version every requirement on it admits, or when
    it is needed only through dists the image has. ``roots`` are the requirement lines the install starts from."""
    provides: set[str] = set()
    notes: dict[str, str] = {}
    for name, version in image.items():
        if name not in graph.dists:
            continue
        if version is None:  # a version not known: it does only where nothing asks for a particular one
            asks = [e for e in graph.into(name) if e.spec]
            if asks:
                notes[name] = "the image has it at a version not known here, and " + "; ".join(
                    f"{e.src or 'the install'} needs {name}{e.spec}" for e in asks[:3]
                )
            else:
                provides.add(name)
            continue
        bad = [e for e in graph.into(name) if e.spec and not SpecifierSet(e.spec).contains(version, prereleases=True)]
        if bad:
            notes[name] = f"the image has {version}, but " + "; ".join(
                f"{e.src or 'the install'} needs {name}{e.spec}" for e in bad[:3]
            )
        else:
            provides.add(name)
    start = [canon(r.name) for r in (parse_requirement(x) for x in roots) if r is not None]
    keep = graph.reachable(start, blocked=provides) - provides
    kept, left = [], []
    for name in sorted(graph.dists):
        d = graph.dists[name]
        if name in keep:
            note = notes.get(name, "")
            image_users = sorted({e.src for e in graph.into(name) if e.src in provides})
            if not note and image_users:
                users = sorted({e.src or "the install" for e in graph.into(name) if e.src not in provides})
                note = (
                    f"the image's {', '.join(image_users[:3])} needs it too, at a version not known here; "
                    f"kept for {', '.join(users[:3])}"
                )
            kept.append(Kept(name, d.version, note))
        elif name in provides:
            why = why_image.get(name, "the image has it")
            if image.get(name) is None:
                why += " (version not known here; nothing asks for a particular one)"
            left.append(LeftOut(name, image.get(name), why, True))
        else:
            users = sorted(e.src for e in graph.into(name) if e.src)
            left.append(LeftOut(name, None, f"needed only by what is left out ({', '.join(users[:3])})", False))
    return kept, left


def parse_freeze(text: str) -> dict[str, str | None]:
    """``pip freeze`` output: name -> version (None for ``name @ URL`` lines, whose version the freeze omits, and
    for bare names: a list of what an image holds without versions)."""
    out: dict[str, str | None] = {}
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line or line.startswith("-"):
            continue
        if " @ " in line:
            out[canon(line.split(" @ ", 1)[0].split("[")[0])] = None
            continue
        if re.match(r"^[A-Za-z0-9][A-Za-z0-9._-]*$", line):
            out[canon(line)] = None
            continue
        m = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)(\[[^\]]*\])?\s*===?\s*(\S+)$", line)
        if not m:
            raise ConfigError(f"image freeze: not a `name==version` line: {raw.strip()!r}")
        out[canon(m.group(1))] = m.group(3)
    return out


# --- harness pins against vLLM's requirements -------------------------------------------------------------------


@dataclass(frozen=True)
class PinConflict:
    pin: str  # the harness line, e.g. "tokenizers==0.23.3"
    resolved: str  # the version the resolution without the pin chose
    needed_by: tuple[str, ...]  # "transformers: tokenizers<=0.23.0,>=0.22.0"


def pin_conflicts(pins: list[str], graph: Graph) -> list[PinConflict]:
    """Harness pins that some other dist's requirement on the same package excludes (read off a resolution made
    without the pins): vLLM's side wins for those."""
    out = []
    for line in pins:
        r = parse_requirement(line)
        if r is None or canon(r.name) not in graph.dists:
            continue
        name = canon(r.name)
        pinned = [s.version for s in r.specifier if s.operator == "=="]
        if not pinned:
            continue
        bad = tuple(
            f"{e.src}: {name}{e.spec}"
            for e in graph.into(name)
            if e.src and e.spec and not SpecifierSet(e.spec).contains(pinned[0], prereleases=True)
        )
        if bad:
            out.append(PinConflict(line.strip(), graph.dists[name].version, bad))
    return out


def unpin(line: str) -> str:
    """``lm_eval[api]==0.4.13`` -> ``lm_eval[api]`` (markers kept)."""
    r = parse_requirement(line)
    if r is None:
        return line
    extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
    return f"{r.name}{extras}" + (f"; {r.marker}" if r.marker else "")


# --- completeness ---------------------------------------------------------------------------------------------


def check_closure(
    roots: list[str],
    wheels: dict[str, tuple[str, list[str]]],
    image: dict[str, str | None],
    env: dict[str, str],
    no_deps: AbstractSet[str] = frozenset(),
) -> list[str]:
    """Problems that would stop ``pip install --no-index`` from the folder: a requirement reachable from the roots
    that no wheel (name -> version, Requires-Dist) and nothing of the image (name -> version or None: any)
    satisfies. Requirements of ``no_deps`` dists are not followed (they are installed with --no-deps)."""
    problems = []
    todo: deque[tuple[str, str, frozenset[str]]] = deque()
    for line in roots:
        r = parse_requirement(line)
        if r is None:
            problems.append(f"unreadable requirement {line!r}")
        elif applies(r, env):
            todo.append(("the install", line, frozenset(r.extras)))
    done: set[tuple[str, frozenset[str]]] = set()
    while todo:
        src, line, _ = todo.popleft()
        r = Requirement(line)
        name = canon(r.name)
        if name in wheels:
            version, requires = wheels[name]
            if r.specifier and not r.specifier.contains(version, prereleases=True):
                problems.append(f"{src} needs {line.split(';')[0].strip()}, the folder has {name} {version}")
                continue
            key = (name, frozenset(r.extras))
            if key in done or name in no_deps:
                continue
            done.add(key)
            for dep in requires:
                d = parse_requirement(dep)
                if d is not None and applies(d, env, tuple(r.extras)):
                    todo.append((f"{name} {version}", dep, frozenset(d.extras)))
        elif name in image:
            v = image[name]
            if v is not None and r.specifier and not r.specifier.contains(v, prereleases=True):
                problems.append(f"{src} needs {line.split(';')[0].strip()}, the image has {name} {v}")
        else:
            problems.append(f"{src} needs {line.split(';')[0].strip()}: not in the folder, not in the image")
    return sorted(set(problems))
