"""What the processes on a simulated GPU box hold: one small file per live process, in the box's state folder.

Real NVML sees every process on a GPU and the memory it took; a simulated box (PD_HARNESS_SIMULATED_GPUS) sees
the stand-in servers (standin.py) that registered here: each writes ``<pid>.json`` (its physical GPU ids and the
GiB it holds on each) once it has "loaded", and removes it when it exits. A file whose process is gone, or whose
PID now belongs to another process (another start time), counts for nothing, so a stand-in killed with SIGKILL
releases its memory as a real process's would.

The folder is ``$PD_HARNESS_SIMULATED_GPUS_STATE``. The outermost harness process that simulates a box names one
(``box_state``) and exports it, so its stand-ins and its child harnesses (nightly steps) share that one box; two
test runs on one machine get two boxes. Nothing here imports more than the standard library: stand-ins start fast.
"""

from __future__ import annotations

import atexit
import json
import os
import shutil
import tempfile
from collections.abc import Mapping, MutableMapping
from dataclasses import asdict, dataclass
from pathlib import Path

STATE_ENV = "PD_HARNESS_SIMULATED_GPUS_STATE"
_STAT_STATE, _STAT_START = 0, 19  # /proc/<pid>/stat fields after "(comm)"


@dataclass(frozen=True)
class Claim:
    pid: int
    start: str  # the process's start time (/proc/<pid>/stat): a PID reused later is another process
    gpus: tuple[int, ...]  # physical NVML ids
    gib_per_gpu: float  # what it holds on each of them
    name: str = ""  # for people reading the folder: the server's role and port

    def to_json(self) -> str:
        return json.dumps({**asdict(self), "gpus": list(self.gpus)})


def proc_start(pid: int) -> str | None:
    """The start time of a live process, None when it is gone or a zombie (exited, not yet reaped)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    fields = raw[raw.rfind(b")") + 2 :].decode().split()
    return None if fields[_STAT_STATE] in ("Z", "X") else fields[_STAT_START]


def state_dir(env: Mapping[str, str]) -> Path | None:
    raw = env.get(STATE_ENV, "").strip()
    return Path(raw) if raw else None


def box_state(env: MutableMapping[str, str] | None = None) -> Path:
    """The box's state folder: the one ``env`` (default os.environ) names, else a new one for this process and its
    children, exported in ``env`` and removed when this process exits."""
    env = os.environ if env is None else env
    known = state_dir(env)
    if known is not None:
        return known
    me = f"{os.getpid()}-{proc_start(os.getpid())}"  # this process, not a later one with its PID
    path = Path(tempfile.gettempdir()) / f"pd-harness-simulated-gpus-{os.getuid()}" / me
    env[STATE_ENV] = str(path)
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


def register(folder: Path, claim: Claim) -> Path:
    """Write ``claim`` atomically (a reader never sees half a file)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{claim.pid}.json"
    tmp = folder / f".{claim.pid}.json.tmp"
    tmp.write_text(claim.to_json())
    tmp.replace(path)
    return path


def release(folder: Path, pid: int) -> None:
    (folder / f"{pid}.json").unlink(missing_ok=True)


def live_claims(folder: Path | None) -> list[Claim]:
    """The claims of processes still alive (the same process: same start time); others and bad files are ignored."""
    if folder is None or not folder.is_dir():
        return []
    out = []
    for path in sorted(folder.glob("*.json")):
        try:
            d = json.loads(path.read_text())
            claim = Claim(
                int(d["pid"]),
                str(d["start"]),
                tuple(int(g) for g in d["gpus"]),
                float(d["gib_per_gpu"]),
                str(d.get("name", "")),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue  # removed meanwhile, or not ours
        if proc_start(claim.pid) == claim.start:
            out.append(claim)
    return out
