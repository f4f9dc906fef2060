"""python -m harness bench {proxy, e2e, lifecycle, startup, explore}: overhead measurements, and explore's throughput
from a finished or running explore's folder. Targets are printed, never enforced: the exit code is 0 whenever the
measurement completed."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.core.argtypes import positive


def _concurrency(s: str) -> list[int]:
    try:
        levels = [int(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: give comma-separated integers, e.g. 1,10,100") from None
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(f"{s!r}: levels must be >= 1")
    return levels


def add_parser(sub) -> None:
    b = sub.add_parser(
        "bench", help="proxy, harness and process-lifecycle overhead, and explore throughput measurements"
    )
    bsub = b.add_subparsers(dest="bench_cmd", required=True)

    p = bsub.add_parser(
        "proxy", help="latency and throughput of toy_proxy_server.py against an upstream-design reference proxy"
    )
    p.add_argument("--requests", type=positive(int), default=2000, help="requests per measurement (default 2000)")
    p.add_argument("--time-limit", type=positive(float), default=20.0, help="seconds per measurement (default 20)")
    p.add_argument(
        "--concurrency", type=_concurrency, default=[1, 10, 100], help="throughput levels (default 1,10,100)"
    )
    p.add_argument(
        "--rounds", type=positive(int), default=3, help="throughput repeats per level; the median counts (default 3)"
    )
    p.add_argument("--warmup", type=int, default=50, help="requests per target before the latency measurement")
    p.add_argument("--log-dir", type=Path, help="process logs (default: a new temporary folder)")
    p.add_argument("--json", action="store_true")

    e = bsub.add_parser("e2e", help="timing breakdown of a run's report.json and the harness's own share")
    src = e.add_mutually_exclusive_group()
    src.add_argument("--run-dir", type=Path, help="a run folder (default: runs/latest)")
    src.add_argument("--report", type=Path, help="a report.json")
    e.add_argument("--json", action="store_true")

    st = bsub.add_parser("startup", help="real vLLM P and D servers started in parallel vs one after another")
    st.add_argument("--repeats", type=positive(int), default=1)
    st.add_argument("--tp-p", type=positive(int), default=1)
    st.add_argument("--tp-d", type=positive(int), default=1)
    st.add_argument("--log-dir", type=Path)
    st.add_argument("--json", action="store_true")

    lc = bsub.add_parser("lifecycle", help="readiness-detection delay and teardown time of managed processes")
    lc.add_argument("--repeats", type=positive(int), default=3)
    lc.add_argument("--ready-after", type=positive(float), default=3.0, help="seconds before the backend turns ready")
    lc.add_argument("--log-dir", type=Path)
    lc.add_argument("--json", action="store_true")

    ex = bsub.add_parser(
        "explore", help="an explore's samples per hour and where their time went, from its folder (runs nothing)"
    )
    ex.add_argument("--dir", type=Path, required=True, help="the explore folder (holding explore.json)")
    ex.add_argument("--json", action="store_true")


def _print(d: dict, as_json: bool, render) -> None:
    print(json.dumps(d, indent=2) if as_json else render(d))


def _measured(what: str, measure, render, as_json: bool, errors: tuple = ()) -> int:
    """Run one benchmark; a server or process that failed means no figures (exit 1), never half a result."""
    from harness.serve.procs import ProcessFailed

    try:
        d = measure()
    except (ProcessFailed, *errors) as e:
        print(f"error: the {what} benchmark did not complete: {e}", file=sys.stderr)
        return 1
    _print(d, as_json, render)
    return 0


def proxy_main(a: argparse.Namespace) -> int:
    from harness.bench.proxy import render, run_proxy_bench

    return _measured(
        "proxy",
        lambda: run_proxy_bench(a.requests, a.concurrency, a.rounds, a.time_limit, a.warmup, a.log_dir),
        render,
        a.json,
        (RuntimeError,),
    )


def e2e_main(a: argparse.Namespace) -> int:
    from harness.run.config import E2EConfig
    from harness.run.timing import breakdown, render

    path = a.report or (a.run_dir or E2EConfig().runs_root / "latest") / "report.json"
    try:
        report = json.loads(Path(path).read_text())
        staggered = bool(((report.get("config") or {}).get("gpu_plan") or {}).get("stagger_start"))
        b = breakdown(report.get("timings_s") or {}, staggered=staggered)
    except (OSError, ValueError) as e:
        print(f"error: {path}: {e}", file=sys.stderr)
        return 2
    if a.json:
        print(json.dumps({"report": str(path), **b.to_dict()}, indent=2))
    else:
        print(render(b, str(path)))
    return 0


def lifecycle_main(a: argparse.Namespace) -> int:
    from harness.bench.lifecycle import render, run_lifecycle_bench

    return _measured("lifecycle", lambda: run_lifecycle_bench(a.repeats, a.ready_after, a.log_dir), render, a.json)


def startup_main(a: argparse.Namespace) -> int:
    from harness.bench.startup import render, run_startup_bench

    return _measured("start-up", lambda: run_startup_bench(a.repeats, a.tp_p, a.tp_d, a.log_dir), render, a.json)


def explore_main(a: argparse.Namespace) -> int:
    from harness.bench.explore_rate import ExploreRateError, explore_rate, render

    try:
        r = explore_rate(a.dir)
    except ExploreRateError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    _print(r.to_dict(), a.json, lambda _: render(r))
    return 0


def main(args: argparse.Namespace) -> int:
    return {
        "proxy": proxy_main,
        "e2e": e2e_main,
        "lifecycle": lifecycle_main,
        "startup": startup_main,
        "explore": explore_main,
    }[args.bench_cmd](args)
