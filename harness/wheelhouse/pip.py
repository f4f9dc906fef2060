"""The pip side of a wheelhouse: resolve for a target without installing (``pip install --dry-run --report``),
build wheels for sdist-only packages, download the resolved files, and check a folder with pip itself.

pip runs with no configuration file and none of this machine's PIP_* settings except TLS/proxy ones, so the
sources are exactly the ones named (index, find-links) and the result does not depend on the machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import urllib.request
import zipfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import InvalidWheelFilename, canonicalize_name, parse_wheel_filename
from packaging.version import InvalidVersion, Version

from harness.core.files import sha256_of
from harness.core.notrack import with_no_track
from harness.core.redact import redact_text
from harness.envs.pip_limits import SubprocessTimedOut, log_name, pip_network_args, run_bounded, wall_timeout_s
from harness.wheelhouse.index import (
    Index,
    IndexFile,
    expand_platform,
    file_version,
    min_glibc,
    platform_machine,
    target_tags,
    wheel_rank,
)

# PIP_* settings that only say how to reach an index, not which packages to take.
_PIP_ENV_KEPT = (
    "PIP_CERT",
    "PIP_CLIENT_CERT",
    "PIP_TRUSTED_HOST",
    "PIP_DEFAULT_TIMEOUT",
    "PIP_PROXY",
    "PIP_RETRIES",
    "PIP_CACHE_DIR",
    "PIP_NO_CACHE_DIR",
)
_NO_MATCH = re.compile(r"No matching distribution found for (.+?)\s*$", re.MULTILINE)


class PipFailed(RuntimeError):
    pass


class Unservable(PipFailed):
    """pip found no distribution of a requirement for the target, and the index has none that would do."""

    def __init__(self, message: str, requirement: str):
        super().__init__(message)
        self.requirement = requirement  # "flashinfer-python==0.7.3"


def isolated_env(base: dict[str, str] | None = None) -> dict[str, str]:
    """The environment pip runs in: no config file (PIP_CONFIG_FILE=os.devnull skips global, user and site files),
    no PIP_* variables but the TLS/proxy ones."""
    env = {
        k: v
        for k, v in (os.environ if base is None else base).items()
        if not k.startswith("PIP_") or k in _PIP_ENV_KEPT
    }
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    return env


@dataclass(frozen=True)
class Sources:
    index_url: str | None = "https://pypi.org/simple"  # None: --no-index
    extra_index_urls: tuple[str, ...] = ()
    find_links: tuple[str, ...] = ()

    def args(self) -> list[str]:
        out = ["--index-url", self.index_url] if self.index_url else ["--no-index"]
        for u in self.extra_index_urls:
            out += ["--extra-index-url", u]
        for f in self.find_links:
            out += ["--find-links", f]
        return out


@dataclass(frozen=True)
class PipTarget:
    """The interpreter pip runs on (its version decides ``python_version`` markers, which pip does not take from
    --python-version) and the target's wheel tags."""

    python: str
    python_version: str
    platform: str

    @property
    def platforms(self) -> list[str]:
        return expand_platform(self.platform)

    @property
    def machine(self) -> str:
        return platform_machine(self.platform)

    def args(self) -> list[str]:
        out = ["--python-version", self.python_version, "--implementation", "cp", "--only-binary=:all:"]
        for p in self.platforms:
            out += ["--platform", p]
        return out


def interpreter_version(python: str) -> str | None:
    """``3.12`` for an interpreter that runs and has pip, else None."""
    try:
        got = subprocess.run(
            [python, "-c", "import sys, pip; print('%d.%d' % sys.version_info[:2])"],
            capture_output=True,
            text=True,
            timeout=60,
            env=with_no_track(os.environ),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return got.stdout.strip() if got.returncode == 0 else None


def find_python(version: str, given: str | None = None) -> str | None:
    """An interpreter of ``version`` with pip: ``given``, this one, ``python<version>`` on PATH, a pyenv or uv
    install. None when there is none."""
    candidates = [given] if given else [sys.executable, shutil.which(f"python{version}") or ""]
    if not given:
        home = Path.home()
        candidates += sorted(str(p) for p in (home / ".pyenv" / "versions").glob(f"{version}*/bin/python{version}"))
        candidates += sorted(
            str(p)
            for p in (home / ".local" / "share" / "uv" / "python").glob(f"cpython-{version}*/bin/python{version}")
        )
        candidates.append(f"/usr/bin/python{version}")
    for c in candidates:
        if c and interpreter_version(c) == version:
            return c
    return None


def pip_command(python: str, args: list[str], env: dict[str, str]) -> list[str]:
    """``python -m pip`` with the network bounds (envs/pip_limits.py; ``env``'s PIP_DEFAULT_TIMEOUT and PIP_RETRIES
    win)."""
    return [python, "-m", "pip", *pip_network_args(env), *args]


def run_pip(
    python: str, args: list[str], log, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess:
    # isolated_env() (or the caller's), with usage reporting off on top: a caller cannot turn it back on.
    env = with_no_track(env or isolated_env())
    cmd = pip_command(python, args, env)
    log.write("$ " + redact_text(" ".join(cmd)) + "\n")  # an index URL may carry credentials
    log.flush()
    try:
        got = run_bounded(cmd, wall_timeout_s(), log_name(log), capture_output=True, text=True, env=env)
    except SubprocessTimedOut as e:
        log.write(f"# {e}\n")
        log.flush()
        raise PipFailed(str(e)) from None
    log.write(redact_text(got.stdout + got.stderr))
    log.flush()
    if check and got.returncode:
        raise PipFailed(_pip_error(got.stdout + got.stderr) or f"pip {args[0]} failed with exit code {got.returncode}")
    return got


def _pip_error(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.startswith("ERROR:")]
    return " ".join(lines[-3:])[:800]


def dry_run(
    target: PipTarget,
    sources: Sources,
    requirements: list[str],
    constraints: list[str],
    work: Path,
    log,
    extra_find_links: Sequence[Path] = (),
) -> tuple[int, str, Path]:
    """One ``pip install --dry-run --report`` for the target; returns (exit code, output, report path)."""
    work.mkdir(parents=True, exist_ok=True)
    reqs, cons, report = work / "requirements.in", work / "constraints.in", work / "report.json"
    reqs.write_text("".join(r + "\n" for r in requirements))
    cons.write_text("".join(c + "\n" for c in constraints))
    report.unlink(missing_ok=True)
    args = [
        "install",
        "--dry-run",
        "--ignore-installed",
        "--report",
        str(report),
        "--target",
        str(work / "target"),
        *target.args(),
        *sources.args(),
        *[a for d in extra_find_links for a in ("--find-links", str(d))],
        "-r",
        str(reqs),
    ]
    if constraints:
        args += ["-c", str(cons)]
    got = run_pip(target.python, args, log, check=False)
    return got.returncode, got.stdout + got.stderr, report


def pip_resolves(
    target: PipTarget, sources: Sources, requirements: list[str], work: Path, log, find_links: Sequence[Path] = ()
) -> str | None:
    """None when pip resolves ``requirements`` for the target (one dry run, nothing built), else what it says."""
    rc, out, _ = dry_run(target, sources, requirements, [], work, log, find_links)
    if rc == 0:
        return None
    m = _NO_MATCH.search(out)
    if m:
        return f"pip finds no distribution of {m.group(1)} for that target"
    return f"pip cannot resolve it for that target: {_pip_error(out) or f'exit code {rc}'}"


@dataclass
class Resolved:
    report: Path
    built: list[Path] = field(default_factory=list)  # wheels built here from sdists


def resolve(
    target: PipTarget,
    sources: Sources,
    requirements: list[str],
    constraints: list[str],
    work: Path,
    built_dir: Path,
    log,
    index: Index | None = None,
    max_builds: int = 20,
) -> Resolved:
    """Resolve with pip for the target (wheels only, as pip requires for another platform). A release that has only
    an sdist on the index gets a pure-Python wheel built here, so the folder installs without building: pinned
    ones before resolving (rouge-score==0.1.2 in cpu.lock), ones pip reports missing (sqlitedict, word2number for
    lm_eval), and, once, releases newer than pip's pick that only lack a wheel (pip would otherwise settle for
    rouge-score 0.0.4, the last release with one)."""
    built_dir.mkdir(parents=True, exist_ok=True)
    index = index or Index(sources.index_url or "https://pypi.org/simple")
    built = [
        build_wheel(target, sources, line, built_dir, log)
        for line in pinned_sdist_only(requirements + constraints, target, index, built_dir)
    ]
    newer_checked = False
    for _ in range(max_builds + 1):
        rc, out, report = dry_run(target, sources, requirements, constraints, work, log, [built_dir])
        if rc == 0:
            if newer_checked:
                return Resolved(report, built)
            newer_checked = True
            newer = newer_sdist_only(report, target, index, built_dir)
            for line in newer:
                try:
                    built.append(build_wheel(target, sources, line, built_dir, log))
                except PipFailed as e:  # pip's older wheel stays
                    log.write(f"# kept pip's choice: {e}\n")
            if not newer:
                return Resolved(report, built)
            continue
        m = _NO_MATCH.search(out)
        if not m:
            raise PipFailed(
                f"pip could not resolve for python {target.python_version} {target.platform}: {_pip_error(out)}"
            )
        built.append(_build_missing(target, sources, m.group(1), built_dir, log, index))
    raise PipFailed(f"more than {max_builds} sdist-only requirements")


def _in_spec_files(files: list[IndexFile], spec: SpecifierSet) -> list[IndexFile]:
    return [
        f
        for f in files
        if not f.yanked and (v := file_version(f.filename)) is not None and spec.contains(v, prereleases=True)
    ]


def _has_target_wheel(files: list[IndexFile], target: PipTarget) -> bool:
    tags = target_tags(target.python_version, target.platforms)
    return any(f.is_wheel and wheel_rank(f.filename, tags) is not None for f in files)


def _already_built(built_dir: Path, name: str, version: str) -> bool:
    want = (canonicalize_name(name), Version(version))
    return any(_wheel_id(p.name) == want for p in built_dir.glob("*.whl"))


def _wheel_id(filename: str) -> tuple[str, Version] | None:
    try:
        name, version, _, _ = parse_wheel_filename(filename)
    except (InvalidWheelFilename, InvalidVersion):
        return None
    return canonicalize_name(name), version


def pinned_sdist_only(lines: list[str], target: PipTarget, index: Index, built_dir: Path) -> list[str]:
    """``name==version`` lines whose release has an sdist but no wheel for the target on the index."""
    pins = []
    for line in lines:
        try:
            r = Requirement(line)
        except InvalidRequirement:
            continue
        exact = [s.version for s in r.specifier if s.operator == "==" and "*" not in s.version]
        if exact and not _already_built(built_dir, r.name, exact[0]):
            pins.append((r.name, exact[0]))

    def check(pin):
        name, version = pin
        try:
            files = _in_spec_files(index.project(name), SpecifierSet(f"=={version}"))
        except OSError:
            return None
        sdist = any(not f.is_wheel for f in files)
        return f"{name}=={version}" if sdist and not _has_target_wheel(files, target) else None

    with ThreadPoolExecutor(16) as ex:
        return [x for x in ex.map(check, pins) if x]


def newer_sdist_only(report: Path, target: PipTarget, index: Index, built_dir: Path) -> list[str]:
    """Releases newer than pip's pick that every requirement on the package admits but that have only an sdist."""
    import json

    from harness.wheelhouse import plan as wh

    dists = wh.parse_report(json.loads(report.read_text()))
    graph = wh.build_graph(dists, wh.marker_env(target.python_version, target.machine))
    py = target.python_version + ".0"

    def check(d: wh.Dist):
        if d.url.startswith("file://"):
            return None
        spec = SpecifierSet(",".join(e.spec for e in graph.into(d.name) if e.spec))
        try:
            files = _in_spec_files(index.project(d.name), spec)
        except OSError:
            return None
        newer: dict[Version, list[IndexFile]] = {}
        for f in files:
            v = file_version(f.filename)
            if (
                v is not None
                and v > wh.Version(d.version)
                and not v.is_prerelease
                and (not f.requires_python or SpecifierSet(f.requires_python).contains(py))
            ):
                newer.setdefault(v, []).append(f)
        if not newer or any(_has_target_wheel(fs, target) for fs in newer.values()):
            return None
        best = max(newer)
        return None if _already_built(built_dir, d.name, str(best)) else f"{d.name}=={best}"

    with ThreadPoolExecutor(16) as ex:
        return [x for x in ex.map(check, dists) if x]


def build_wheel(target: PipTarget, sources: Sources, line: str, built_dir: Path, log) -> Path:
    """A pure-Python wheel of ``line`` built from its sdist into ``built_dir``."""
    with tempfile.TemporaryDirectory() as tmp:
        run_pip(target.python, ["wheel", "--no-deps", "--no-binary", ":all:", "-w", tmp, *sources.args(), line], log)
        made = sorted(Path(tmp).glob("*.whl"))
        if len(made) != 1 or not made[0].name.endswith("-none-any.whl"):
            raise PipFailed(
                f"{line} has only an sdist, and it builds {[p.name for p in made]}, not one pure-Python wheel"
            )
        dest = built_dir / made[0].name
        shutil.move(str(made[0]), dest)
    log.write(f"# built {dest.name} from the sdist: the index has no wheel of {line} for the target\n")
    return dest


def _build_missing(target: PipTarget, sources: Sources, line: str, built_dir: Path, log, index: Index) -> Path:
    """pip found nothing for ``line``: build it when the index has only an sdist; else explain (a glibc too old
    for the wheels there is the usual case)."""
    try:
        req = Requirement(line)
    except InvalidRequirement:
        raise PipFailed(f"no distribution of {line!r} for the target") from None
    files = index.project(req.name) if sources.index_url else []
    in_spec = _in_spec_files(files, SpecifierSet(str(req.specifier)))
    if _has_target_wheel(in_spec, target):
        raise PipFailed(f"pip found no {line} for the target although the index has a wheel (see the log)")
    glibc = min_glibc(files, target.python_version, target.machine, str(req.specifier))
    if any(f.is_wheel for f in in_spec) and glibc:
        raise Unservable(
            f"{req.name}{req.specifier} has no wheel for {target.platform}: its wheels need manylinux_"
            f"{glibc[0]}_{glibc[1]} (glibc {glibc[0]}.{glibc[1]}); if the target's glibc (`ldd --version`) "
            f"is at least that, give --platform manylinux_{glibc[0]}_{glibc[1]}_{target.machine}",
            f"{req.name}{req.specifier}",
        )
    if not any(not f.is_wheel for f in in_spec):
        raise Unservable(
            f"no distribution of {line} on the index for python {target.python_version} {target.platform}",
            f"{req.name}{req.specifier}",
        )
    return build_wheel(target, sources, f"{req.name}{req.specifier}", built_dir, log)


def fetch(url: str, sha256: str, dest: Path, timeout: float = 300.0) -> Path:
    """Download (or copy a file:// URL) to ``dest``, checking the sha256 the resolution recorded."""
    part = dest.with_name(dest.name + ".part")
    if url.startswith("file://"):
        shutil.copyfile(urllib.request.url2pathname(url[len("file://") :]), part)
    else:
        with urllib.request.urlopen(url, timeout=timeout) as r, open(part, "wb") as out:
            shutil.copyfileobj(r, out, 1 << 20)
    got = sha256_of(part)
    if sha256 and got != sha256:
        part.unlink()
        raise PipFailed(f"{dest.name}: sha256 {got} does not match the index's {sha256}")
    part.replace(dest)
    return dest


def fetch_all(items: list[tuple[str, str, Path]], threads: int = 8) -> list[Path]:
    """Fetch (url, sha256, dest) items in parallel; a file already there with the right hash is kept."""

    def one(item):
        url, sha, dest = item
        if dest.exists() and sha and sha256_of(dest) == sha:
            return dest
        return fetch(url, sha, dest)

    with ThreadPoolExecutor(threads) as ex:
        return list(ex.map(one, items))


def stub_wheel_name(name: str, version: str) -> str:
    return f"{re.sub(r'[-_.]+', '_', name)}-{version}-py3-none-any.whl"


def stub_wheel(folder: Path, name: str, version: str) -> Path:
    """A wheel with no files and no requirements that stands for a package the image has, so pip can check the
    folder without the real thing (``torch-2.11.0+cu130-py3-none-any.whl``)."""
    dist = re.sub(r"[-_.]+", "_", name)
    path = folder / stub_wheel_name(name, version)
    info = f"{dist}-{version}.dist-info"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
        z.writestr(
            f"{info}/WHEEL",
            "Wheel-Version: 1.0\nGenerator: harness-wheelhouse-stub\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
        )
        z.writestr(f"{info}/RECORD", f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def pip_check(target: PipTarget, folder: Path, image: dict[str, str], requirements: Path, work: Path, log) -> list[str]:
    """Problems pip itself finds when resolving ``requirements`` from ``folder`` alone (no index) with stub wheels
    for what the image has; also flags a dist pip would take from anywhere else."""
    stubs = work / "image-stubs"
    shutil.rmtree(stubs, ignore_errors=True)
    stubs.mkdir(parents=True)
    for name, version in image.items():
        stub_wheel(stubs, name, version)
    rc, out, report = dry_run(
        target, Sources(index_url=None, find_links=(str(folder), str(stubs))), [f"-r {requirements}"], [], work, log
    )
    if rc:
        return [f"pip --no-index: {_pip_error(out)}"]
    import json

    problems = []
    for item in json.loads(report.read_text()).get("install", []):
        url = (item.get("download_info") or {}).get("url", "")
        where = Path(urllib.request.url2pathname(url[len("file://") :])).parent if url.startswith("file://") else None
        if where is None or where.resolve() not in (folder.resolve(), stubs.resolve()):
            problems.append(f"pip took {item['metadata']['name']} from {url}")
    return problems
