"""P/D routing proxy for vLLM's NixlConnector (FastAPI + aiohttp).

python toy_proxy_server.py --port 8000 --prefill http://127.0.0.1:8100 --decode http://127.0.0.1:8200
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from harness.core.argtypes import HarnessArgumentParser
from harness.proxy.app import (
    DEFAULT_MAX_BODY_BYTES,
    corrupt_block_ids,
    create_app,
    hold_until_released,
    wrong_engine_id,
)

# Fault injection for tests that must see the harness fail a run; "no-remote-decode" skips the transfer.
# "hold-between-hops" holds a request after P's answer until the harness has put a network fault in place (--hold-dir).
FAULTS = {
    "none": None,
    "corrupt-block-ids": corrupt_block_ids,
    "wrong-engine-id": wrong_engine_id,
    "no-remote-decode": None,
    "hold-between-hops": None,
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = HarnessArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", nargs="+", default=[], metavar="URL", help="prefill base URLs")
    ap.add_argument("--decode", nargs="+", default=[], metavar="URL", help="decode base URLs")
    ap.add_argument("--prefiller-hosts", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--prefiller-ports", nargs="+", type=int, default=[])
    ap.add_argument("--decoder-hosts", nargs="+", default=["127.0.0.1"])
    ap.add_argument("--decoder-ports", nargs="+", type=int, default=[])
    ap.add_argument("--timeout", type=float, default=300.0, help="seconds per backend request")
    ap.add_argument(
        "--max-body-mib",
        type=float,
        default=DEFAULT_MAX_BODY_BYTES / 2**20,
        help="larger request bodies get 413 (default %(default)g MiB)",
    )
    ap.add_argument("--fault", choices=sorted(FAULTS), default="none", help="fault injection for tests")
    ap.add_argument(
        "--fault-every",
        type=int,
        default=1,
        metavar="N",
        help="apply the fault to every N-th request only (default 1: all)",
    )
    ap.add_argument("--hold-dir", type=Path, help="with --fault hold-between-hops: where held requests are marked")
    ap.add_argument("--log-level", default="info")
    args = ap.parse_args(argv)
    try:
        backend_urls(args)
    except ValueError as e:
        ap.error(str(e))
    if args.max_body_mib <= 0:
        ap.error("--max-body-mib must be > 0")
    if args.fault_every < 1:
        ap.error("--fault-every must be >= 1")
    if (args.fault == "hold-between-hops") != (args.hold_dir is not None):
        ap.error("--fault hold-between-hops and --hold-dir go together")
    return args


def _urls(hosts: list[str], ports: list[int], what: str) -> list[str]:
    if not ports:
        return []
    if len(hosts) == 1:
        hosts = hosts * len(ports)
    if len(hosts) != len(ports):
        raise ValueError(f"{len(hosts)} {what} hosts but {len(ports)} ports")
    return [f"http://{h}:{p}" for h, p in zip(hosts, ports, strict=False)]


def backend_urls(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    prefill = list(args.prefill) + _urls(args.prefiller_hosts, args.prefiller_ports, "prefiller")
    decode = list(args.decode) + _urls(args.decoder_hosts, args.decoder_ports, "decoder")
    if not prefill:
        raise ValueError("no prefill backend: give --prefill URL or --prefiller-ports")
    if not decode:
        raise ValueError("no decode backend: give --decode URL or --decoder-ports")
    return prefill, decode


def main(argv: list[str] | None = None) -> None:
    import uvicorn

    args = parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stdout
    )
    prefill, decode = backend_urls(args)
    app = create_app(
        prefill,
        decode,
        timeout_s=args.timeout,
        kv_params_hook=FAULTS[args.fault],
        max_body_bytes=int(args.max_body_mib * 2**20),
        skip_transfer=args.fault == "no-remote-decode",
        fault_every=args.fault_every,
        between_hops=hold_until_released(args.hold_dir) if args.hold_dir is not None else None,
    )
    # uvloop and httptools (pinned in requirements/harness.txt) when installed; uvicorn's pure-Python fallbacks
    # otherwise.
    uvicorn.run(
        app, host=args.host, port=args.port, log_level=args.log_level, access_log=False, loop="auto", http="auto"
    )


if __name__ == "__main__":
    main()
