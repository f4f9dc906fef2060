"""python -m harness bisect ENTRY --good V --bad V: the first release where a matrix entry's outcome changes."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import sys
import time
from pathlib import Path

from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.core.interrupts import catch_interrupts
from harness.core.paths import RUNS_ROOT
from harness.models.rules import DEVICES
from harness.releases.bisect import BisectError, BisectResult, Observation, bisect


def add_parser(sub) -> None:
    b = sub.add_parser(
        "bisect",
        help="binary-search the releases between --good and --bad for the first where an entry's outcome changes",
    )
    b.add_argument("entry", help="an entry id of the matrix config, e.g. tiny-k1-p1-d2")
    b.add_argument("--good", required=True, help="a release where the entry shows the good outcome")
    b.add_argument("--bad", required=True, help="a release where it shows the bad outcome")
    b.add_argument(
        "--versions",
        help="comma-separated releases to search (default: every release the package index lists between the ends)",
    )
    b.add_argument("--config", type=Path, help="matrix config (default: configs/gqa_replication.yaml)")
    b.add_argument("--good-outcome", default="ok", help="the good outcome (default ok)")
    b.add_argument(
        "--bad-outcome",
        help="the bad outcome (default: the failure the entry expects of a version family, e.g. assert-45330)",
    )
    b.add_argument("--device", choices=DEVICES, help="default: gpu if an NVIDIA GPU is present, else cpu")
    b.add_argument("--run-dir", type=Path, help="default: runs/<timestamp>-bisect-<entry>")
    b.add_argument("--max-probes", type=int, default=8, help="most releases to run (default 8)")
    b.add_argument("--fresh", action="store_true", help="measure again instead of reusing stored results")
    b.add_argument(
        "--fresh-baseline", action="store_true", help="compute baselines again instead of reusing cached answers"
    )
    b.add_argument(
        "--run-lock",
        type=Path,
        help="hold this file's lock around each run (not installs): a machine shared with other runs",
    )
    b.add_argument("--json", action="store_true", help="print bisect.json instead of the line")


def default_bad_outcome(entry) -> str | None:
    """The failure the entry expects of one of its version families (None: it expects no failure anywhere)."""
    for o in (entry.expected.pre_fix, entry.expected.fixed):
        if o not in ("ok", "invalid"):
            return o
    return None


def aliases_for(entry) -> dict[str, str]:
    """A known intermittent failure counts as the outcome its entry expects of that family (it is recorded as seen)."""
    kf = entry.known_failure
    return {kf.cls: entry.expected.for_family(kf.family)} if kf is not None and kf.intermittent else {}


def main(a: argparse.Namespace) -> int:
    from packaging.version import InvalidVersion, Version

    from harness.envs.vllm_env import DISTRIBUTION, check_version
    from harness.gpu.detect import default_device
    from harness.matrix.config import MATRIX_YAML, load_matrix
    from harness.releases.index import between, list_releases
    from harness.releases.probe import Prober
    from harness.releases.store import ResultStore

    try:
        good, bad = check_version(a.good), check_version(a.bad)
        if a.max_probes < 1:
            raise ConfigError("--max-probes must be >= 1")
        try:
            if Version(good) == Version(bad):
                raise ConfigError("--good and --bad are the same release")
        except InvalidVersion:
            raise ConfigError(f"{good} or {bad} is not a release number") from None
        matrix, models = load_matrix(a.config or MATRIX_YAML)
        entry = matrix.get(a.entry)
        if entry is None:
            raise ConfigError(f"unknown matrix entry {a.entry!r} (known: {', '.join(e.id for e in matrix.entries)})")
        device = a.device or default_device()
        if entry.device != device:
            raise ConfigError(f"{a.entry} is a {entry.device} entry; this run is on {device}")
        lo, hi = sorted((good, bad), key=Version)
        if a.versions:
            listed = [check_version(v.strip()) for v in a.versions.split(",") if v.strip()]
            versions = sorted({lo, hi, *(v for v in listed if Version(lo) < Version(v) < Version(hi))}, key=Version)
        else:
            versions = between(list_releases(DISTRIBUTION[device]), lo, hi)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    bad_outcome = a.bad_outcome or default_bad_outcome(entry)
    fix = Version(good) > Version(bad)  # searching for a fix (old releases bad) or a regression (old releases good)
    old_outcome, new_outcome = (bad_outcome, a.good_outcome) if fix else (a.good_outcome, bad_outcome)
    if new_outcome is None:  # a regression to an unnamed failure: judge by "not the good outcome" from the old side
        print("error: give --bad-outcome (the entry expects no failure to search for)", file=sys.stderr)
        return 2
    store = ResultStore()
    run_dir = a.run_dir or RUNS_ROOT / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-bisect-{a.entry}"
    command = (
        "python -m harness " + shlex.join(sys.argv[1:]) if sys.argv[0].endswith("__main__.py") else shlex.join(sys.argv)
    )
    prober = Prober.for_command(a, matrix, models, store, run_dir / "probes", device, command)
    aliases = aliases_for(entry)
    ends: dict[str, Observation] = {}
    for v, outcome in ((versions[0], old_outcome), (versions[-1], new_outcome)):
        got = None if a.fresh else store.get(a.entry, v)
        if got is not None:
            ends[v] = Observation(got.outcome, "store", 0.0, got.run_dir, got.detail)
        elif outcome is not None:
            ends[v] = Observation(outcome, "given")
    print(
        f"bisect {a.entry} over {len(versions)} releases ({versions[0]} .. {versions[-1]}): "
        f"{len(versions) - 2} between the ends; "
        f"old outcome {old_outcome or '(what ' + versions[0] + ' shows)'}, new outcome {new_outcome}"
        + (f"; {', '.join(f'{k} counts as {v}' for k, v in aliases.items())} (known intermittent)" if aliases else "")
        + f"; harness revision {store.revision}; folder {run_dir}",
        flush=True,
    )
    catch_interrupts()  # SIGTERM too: the run in progress tears its servers down
    t0 = time.monotonic()
    try:
        result = bisect(
            a.entry,
            versions,
            lambda v: prober.observe(a.entry, v),
            old_outcome,
            new_outcome,
            ends,
            aliases,
            a.max_probes,
        )
    except BisectError as e:
        print(f"bisect: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    wall = time.monotonic() - t0
    write_bisect(result, run_dir, command, wall, store.revision, aliases)
    if a.json:
        print((run_dir / "bisect.json").read_text())
    else:
        print(result.line())
        print(f"{len(result.runs)} probes run in {wall:.0f} s; report {run_dir / 'bisect.md'}")
    return 0


def write_bisect(
    result: BisectResult, run_dir: Path, command: str, wall_s: float, revision: str, aliases: dict[str, str]
) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    d = {
        **result.to_dict(),
        "command": command,
        "date": dt.date.today().isoformat(),
        "wall_s": round(wall_s, 1),
        "harness_revision": revision,
        "aliases": aliases,
    }
    write_atomic(run_dir / "bisect.json", json.dumps(d, indent=2) + "\n")
    lines = [
        f"# Bisect: {result.entry}",
        "",
        f"**{result.line()}**",
        "",
        f"- command: `{command}`",
        f"- date: {d['date']}; harness revision {revision}",
        f"- releases searched ({len(result.versions)}): {', '.join(result.versions)}",
        f"- probes run: {len(result.runs)} in {wall_s:.0f} s wall"
        + (
            f"; counted as their expected outcome: {', '.join(f'{k} -> {v}' for k, v in aliases.items())}"
            if aliases
            else ""
        ),
        "",
        "| release | outcome | verdict | source | seconds | run folder | detail |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in result.probes:
        o = p.observation
        run = (
            os.path.relpath(o.run_dir, run_dir)
            if o.run_dir and o.run_dir.startswith(str(run_dir))
            else (o.run_dir or "")
        )
        lines.append(
            f"| {p.version} | {o.outcome} | {p.verdict} | {o.source} | {o.seconds:.0f} | {run} | "
            f"{o.detail.replace('|', '/').replace(chr(10), ' ')[:200]} |"
        )
    write_atomic(run_dir / "bisect.md", "\n".join(lines) + "\n")
