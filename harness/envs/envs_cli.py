"""python -m harness envs list|prune [--keep N]: the vLLM environments under .venvs/ (never .venv)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.core.paths import VENVS_DIR
from harness.envs.manage import ago, disk_usage, human, list_envs, prune


def add_parser(sub) -> None:
    p = sub.add_parser("envs", help="vLLM environments under .venvs/: list (size, version, last use) and prune")
    esub = p.add_subparsers(dest="envs_cmd", required=True)
    ls = esub.add_parser("list", help="each environment's size, version and last use")
    ls.add_argument("--json", action="store_true")
    ls.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)  # tests: a folder of fake environments
    pr = esub.add_parser("prune", help="remove all but the most recently used environments")
    pr.add_argument("--keep", type=int, default=2, help="environments to keep, most recently used first (default 2)")
    pr.add_argument("--dry-run", action="store_true", help="say what would go; remove nothing")
    pr.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)


def main(a: argparse.Namespace) -> int:
    venvs = a.dir or VENVS_DIR
    if a.envs_cmd == "list":
        envs = list_envs(venvs)
        if a.json:
            print(json.dumps([e.to_dict() for e in envs], indent=2))
            return 0
        if not envs:
            print(f"no environments under {venvs}")
            return 0
        print(f"{'environment':<24} {'version':<10} {'size':>10} {'frees':>10}  {'last use':<12} state")
        for e in envs:
            print(
                f"{e.name:<24} {e.version:<10} {human(e.size_bytes):>10} {human(e.frees_bytes):>10}  "
                f"{ago(e.last_use):<12} {'ready' if e.ready else 'incomplete'}"
            )
        total, _ = disk_usage(venvs)
        print(f"total under {venvs} (shared files counted once, wheels and caches included): {human(total)}")
        return 0
    if a.keep < 0:
        print("error: --keep must be >= 0", file=sys.stderr)
        return 2
    r = prune(venvs, a.keep, a.dry_run)
    verb = "would remove" if a.dry_run else "removed"
    print(
        f"{verb} {len(r.removed)}: {', '.join(r.removed) or '-'}; kept {len(r.kept)}: {', '.join(r.kept) or '-'}; "
        f"{'would free' if a.dry_run else 'freed'} {human(r.freed_bytes)}"
    )
    for why in r.refused:
        print(f"not removed: {why}")
    return 0
