"""python -m harness history --config FILE [--only IDS] --versions A..B: release x entry outcomes, Markdown + PNG."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import shlex
import sys
from pathlib import Path

from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.core.interrupts import catch_interrupts
from harness.core.paths import RUNS_ROOT
from harness.core.safe import load_json_object, safe_name, shown
from harness.models.rules import DEVICES
from harness.releases.history import Cell, Column, HistoryTable, render_markdown, render_png


def add_parser(sub) -> None:
    h = sub.add_parser(
        "history", help="each entry's outcome on each release (reusing stored results): history.md + history.png"
    )
    h.add_argument("--config", type=Path, help="matrix config (default: configs/gqa_replication.yaml)")
    h.add_argument("--only", help="comma-separated entry ids (default: every entry of this device)")
    h.add_argument(
        "--versions", required=True, help="A..B (every release the package index lists between, ends included) or A,B,C"
    )
    h.add_argument("--device", choices=DEVICES, help="default: gpu if an NVIDIA GPU is present, else cpu")
    h.add_argument(
        "--out", type=Path, help="folder for history.md/.png/.json and the runs (default: runs/<timestamp>-history)"
    )
    h.add_argument("--no-run", action="store_true", help="draw only stored results; run nothing (missing cells say so)")
    h.add_argument("--fresh", action="store_true", help="measure every cell again")
    h.add_argument(
        "--fresh-baseline", action="store_true", help="compute baselines again instead of reusing cached answers"
    )
    h.add_argument(
        "--import-runs", type=Path, help="first store the pairs of matrix reports (report.json) found under this folder"
    )
    h.add_argument("--keep-envs", type=int, help="after each release, prune .venvs/ to this many environments (disk)")
    h.add_argument("--run-lock", type=Path, help="hold this file's lock around each run (not installs)")


def importable_pairs(folder: Path) -> list[tuple[Path, dict]]:
    """(report, pair) for every judged pair of the matrix reports under ``folder``, all checked before any is stored:
    a report.json that is not a JSON object, or a pair whose id or vllm_version is not a safe name (they become the
    results store's folder and file names) or whose fields have another type than a matrix writes, is a ConfigError
    (one line naming the report and the pair) and nothing is imported."""
    if not folder.is_dir():
        raise ConfigError(f"--import-runs {folder}: not a folder")
    found = []
    for report in sorted(folder.rglob("report.json")):
        pairs = load_json_object(report, "report").get("pairs") or []
        if not isinstance(pairs, list):
            raise ConfigError(f"{report}: 'pairs' is not a list")
        for i, p in enumerate(pairs):
            if not isinstance(p, dict):
                raise ConfigError(f"{report}: pairs[{i}] is not a mapping")
            if not (p.get("observed") and p.get("vllm_version")):
                continue  # not judged: nothing to store
            safe_name(p.get("id"), f"{report}: pairs[{i}].id")
            safe_name(p["vllm_version"], f"{report}: pairs[{i}].vllm_version")
            for k in ("observed", "detail", "expected", "regime", "run_dir"):
                if p.get(k) is not None and not isinstance(p[k], str):
                    raise ConfigError(f"{report}: pairs[{i}].{k} {shown(p[k])} is not a string")
            found.append((report, p))
    return found


def import_runs(folder: Path, store, by: str, pairs: list[tuple[Path, dict]] | None = None) -> int:
    """Store every judged pair of the matrix reports under ``folder`` (``pairs``: those already checked by
    ``importable_pairs``); returns how many. ConfigError, before anything is stored, for a report or pair it refuses."""
    n = 0
    for report, p in importable_pairs(folder) if pairs is None else pairs:
        if (
            store.put(
                p["id"],
                p["vllm_version"],
                p["observed"],
                seconds=0.0,
                run_dir=p.get("run_dir"),
                detail=p.get("detail") or "",
                expected=p.get("expected"),
                regime=p.get("regime"),
                by=f"{by} (imported from {report})",
            )
            is not None
        ):
            n += 1
    return n


def main(a: argparse.Namespace) -> int:
    from harness.envs.vllm_env import DISTRIBUTION
    from harness.gpu.detect import default_device
    from harness.matrix.config import MATRIX_YAML, load_matrix
    from harness.matrix.plan import plan
    from harness.releases.index import list_releases, parse_range
    from harness.releases.probe import Prober
    from harness.releases.store import ResultStore

    try:
        if a.keep_envs is not None and a.keep_envs < 1:
            raise ConfigError("--keep-envs must be >= 1 (the environment in use stays)")
        imports = importable_pairs(a.import_runs) if a.import_runs else []  # refused in one line before anything runs
        matrix, models = load_matrix(a.config or MATRIX_YAML)
        device = a.device or default_device()
        only = {x.strip() for x in a.only.split(",") if x.strip()} if a.only else None
        versions = parse_range(a.versions, list_releases(DISTRIBUTION[device]))
        ids = [
            e.id for e in matrix.entries if (only is None and e.device == device) or (only is not None and e.id in only)
        ]
        if only and (unknown := sorted(only - {e.id for e in matrix.entries})):
            raise ConfigError(f"unknown matrix id(s): {', '.join(unknown)}")
        if not ids:
            raise ConfigError(f"no {device} entry to draw")
        wrong = [e.id for e in matrix.entries if e.id in ids and e.device != device]
        if wrong:
            raise ConfigError(f"{', '.join(wrong)}: not {device} entries; this run is on {device}")
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = a.out or RUNS_ROOT / f"{dt.datetime.now().strftime('%Y%m%d-%H%M%S')}-history"
    out.mkdir(parents=True, exist_ok=True)
    command = (
        "python -m harness " + shlex.join(sys.argv[1:]) if sys.argv[0].endswith("__main__.py") else shlex.join(sys.argv)
    )
    store = ResultStore()
    if a.import_runs:
        stored = import_runs(a.import_runs, store, command, imports)
        print(f"history: stored {stored} pairs from {a.import_runs}", flush=True)
    plans = {v: {p.id: p for p in plan(matrix, models, v, device, 10**6, set(ids))} for v in versions}
    first = plans[versions[0]]
    columns = [
        Column(i, f"K={first[i].kv_heads} P{first[i].tp_p}→D{first[i].tp_d} regime {first[i].regime}", first[i].regime)
        for i in ids
    ]
    table = HistoryTable(versions, columns, revision=store.revision, command=command, date=dt.date.today().isoformat())
    prober = Prober.for_command(a, matrix, models, store, out / "runs", device, command)
    print(
        f"history: {len(ids)} entries x {len(versions)} releases ({versions[0]} .. {versions[-1]}); harness revision "
        f"{store.revision}; folder {out}",
        flush=True,
    )
    catch_interrupts()  # SIGTERM too: the run in progress tears its servers down
    ran = reused = 0
    try:
        for v in versions:
            for i in ids:
                expected = plans[v][i].expected
                got = None if a.fresh else store.get(i, v)
                if got is not None:
                    table.cells[(v, i)] = Cell(got.outcome, "store", got.run_dir, expected, got.detail)
                    reused += 1
                elif not a.no_run:
                    print(f"history: {i} on vLLM {v}", flush=True)
                    o = prober.observe(i, v)
                    table.cells[(v, i)] = Cell(o.outcome, o.source, o.run_dir, expected, o.detail)
                    ran += 1
                write_table(table, out, png=False)
            if a.keep_envs is not None and not a.no_run:
                from harness.core.paths import VENVS_DIR
                from harness.envs.manage import human, prune

                r = prune(VENVS_DIR, a.keep_envs)
                if r.removed:
                    print(f"history: pruned {', '.join(r.removed)} ({human(r.freed_bytes)})", flush=True)
    except KeyboardInterrupt:
        write_table(table, out)
        print(f"interrupted; partial history: {out / 'history.md'}", file=sys.stderr)
        return 130
    write_table(table, out)
    print(
        f"history: {ran} cells run, {reused} reused, "
        f"{sum(1 for v in versions for i in ids if (v, i) not in table.cells)} not measured"
    )
    for c in columns:
        print(f"  {c.id}: " + ("; ".join(table.boundaries(c.id)) or "no change over the measured releases"))
    print(f"history: {out / 'history.md'} and {out / 'history.png'}")
    return 0


def write_table(t: HistoryTable, out: Path, png: bool = True) -> None:
    write_atomic(out / "history.json", json.dumps(t.to_dict(), indent=1) + "\n")
    write_atomic(out / "history.md", render_markdown(t, "history.png"))
    if png:
        render_png(t, out / "history.png")
