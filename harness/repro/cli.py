"""python -m harness repro RUN_DIR [--out DIR]: a self-contained reproduction folder from a run folder."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.core.errors import ConfigError


def add_parser(sub) -> None:
    r = sub.add_parser(
        "repro", help="write a folder that reproduces a run without this project: repro.sh, a model builder, ISSUE.md"
    )
    r.add_argument(
        "run_dir", type=Path, help="a run folder (holding report.json), e.g. runs/latest or a matrix pair's folder"
    )
    r.add_argument("--out", type=Path, help="bundle folder (default: <run_dir>/repro)")
    r.add_argument("--signature", help="the failure class repro.sh looks for (default: the run's, else assert-45330)")


def main(a: argparse.Namespace) -> int:
    from harness.repro.bundle import write_bundle

    try:
        out = write_bundle(a.run_dir, a.out, a.signature)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"repro bundle: {out}")
    print(f"  run it: bash {out / 'repro.sh'}   (from any folder; it installs into its own venv under ./repro-work)")
    print(f"  issue text: {out / 'ISSUE.md'}")
    return 0
