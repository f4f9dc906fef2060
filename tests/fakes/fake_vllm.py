"""A stand-in for ``python -m vllm.entrypoints.openai.api_server`` in fault tests (no real server).

Launched by the ``python-<mode>`` wrappers next to this file, which replace the vLLM interpreter
(the e2e CLI's ``--python``). Every vLLM argument is ignored except ``--port``.

Modes:
- ``never-ready``: listens on 127.0.0.1:PORT, answers 503 to everything (so /health is never 200).
- ``exit-at-start``: prints a recognisable error after ~1 s and exits 1.

Both start one child process first (like vLLM's engine core) that outlives a dying parent, so a
test also proves the harness stops a server's descendants. Every process here stops on its own
after ``FAKE_VLLM_MAX_LIFE_S`` (default 300 s), so a failing harness cannot leave it forever.
"""

from __future__ import annotations

import argparse
import http.server
import os
import subprocess
import sys
import threading
import time

MODES = ("never-ready", "exit-at-start")
CRASH_LINE = "FAKE_VLLM_STARTUP_CRASH: the stand-in API server died during start-up (exit code 1)"
MAX_LIFE_S = float(os.environ.get("FAKE_VLLM_MAX_LIFE_S", "300"))


class NotReady(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802
        body = b"fake vLLM: never ready\n"
        self.send_response(503)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_POST = do_GET

    def log_message(self, fmt: str, *args) -> None:
        pass


def start_child() -> subprocess.Popen:
    # Same session and process group as this process; inherits the environment (the harness's run tag).
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({MAX_LIFE_S})"], stdin=subprocess.DEVNULL)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--mode", required=True, choices=MODES)
    ap.add_argument("--port", type=int, required=True)
    a, _ = ap.parse_known_args(argv)
    child = start_child()
    print(f"fake vLLM ({a.mode}) pid {os.getpid()}, child {child.pid}, port {a.port}", flush=True)
    if a.mode == "exit-at-start":
        time.sleep(1.0)
        print(CRASH_LINE, flush=True)
        return 1
    server = http.server.ThreadingHTTPServer(("127.0.0.1", a.port), NotReady)
    server.daemon_threads = True
    threading.Timer(MAX_LIFE_S, server.shutdown).start()
    print(f"fake vLLM listening on 127.0.0.1:{a.port}; /health answers 503", flush=True)
    server.serve_forever(poll_interval=0.2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
