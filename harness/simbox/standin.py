"""The stand-in server of a simulated GPU box: ``python -m harness.simbox.standin <vLLM's server arguments>``.

Under PD_HARNESS_SIMULATED_GPUS (a test switch, see box.py) harness/run/launch.py starts this instead of
``vllm.entrypoints.openai.api_server``, with the arguments and environment vLLM would have got. It does what the
harness needs of a server on a GPU box, and no more:

- GPUs: it takes the first TP of the GPUs its CUDA_VISIBLE_DEVICES names (physical ids, read against the box as
  CUDA would), refuses to start as vLLM does when one has less free memory than ``gpu_memory_utilization`` x total
  (so colocated servers started together would collide, staggered ones fit), then registers that memory on them
  (claims.py): the simulated NVML shows its PID there and the memory taken until it exits.
- HTTP: /health, /v1/models, /tokenize, /metrics and /v1/completions (logprobs, token ids, streaming, P's
  kv_transfer_params) with deterministic answers (standin_model.py). Nothing is computed and no KV moves.

Standard library only (plus the harness's GPU discovery): it starts in a fraction of a second.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
from collections.abc import Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from harness.core.argtypes import HarnessArgumentParser
from harness.gpu.nvml import GpuInfo, discover
from harness.gpu.visible import ORDER_ENV, VISIBLE_ENV
from harness.models.rules import VLLM_DEFAULT_BLOCK_SIZE
from harness.simbox import standin_model as model
from harness.simbox.box import SIMULATED_ENV, install_source, simulated_box
from harness.simbox.claims import STATE_ENV, Claim, box_state, proc_start, register, release

VLLM_DEFAULT_UTIL = 0.9
DEFAULT_POOL_BLOCKS = 4096  # what "the rest of the memory" would hold; only reported, never enforced
TAG = "[stand-in]"


def parse(argv: list[str]) -> argparse.Namespace:
    """The vLLM server arguments a stand-in uses; the others (dtype, attention backend, ...) are accepted unread."""
    p = HarnessArgumentParser(prog="python -m harness.simbox.standin", add_help=False)
    p.add_argument("--model", required=True)
    p.add_argument("--served-model-name")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tensor-parallel-size", type=int, default=1)
    p.add_argument("--gpu-memory-utilization", type=float, default=VLLM_DEFAULT_UTIL)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--block-size", type=int, default=VLLM_DEFAULT_BLOCK_SIZE)
    p.add_argument("--num-gpu-blocks-override", type=int)
    p.add_argument("--enable-log-requests", action="store_true")
    p.add_argument("--kv-transfer-config")
    a, _ = p.parse_known_args(argv)
    a.served_model_name = a.served_model_name or a.model
    a.kv_role = (json.loads(a.kv_transfer_config) if a.kv_transfer_config else {}).get("kv_role")
    return a


def take_gpus(a: argparse.Namespace, env: Mapping[str, str]) -> tuple[tuple[GpuInfo, ...], str | None]:
    """The GPUs of this server's TP ranks (rank i on the i-th of its CUDA_VISIBLE_DEVICES), or vLLM's refusal."""
    box = simulated_box(env)
    if box is None:
        return (), f"RuntimeError: {TAG} runs only on a simulated GPU box ({SIMULATED_ENV} is not set)"
    # The box as this process sees it: its own CUDA_VISIBLE_DEVICES, not the harness's visible= option.
    child = {
        SIMULATED_ENV: box.for_child(),
        STATE_ENV: env.get(STATE_ENV, ""),
        **{k: env[k] for k in (VISIBLE_ENV, ORDER_ENV) if k in env},
    }
    d = discover(env=child)
    if not d.available:
        return (), f"RuntimeError: No CUDA GPUs are available ({d.describe()})"
    tp = a.tensor_parallel_size
    if d.count < tp:
        return (), (
            f"ValueError: tensor parallel size {tp} needs {tp} GPUs, {d.count} visible "
            f"({VISIBLE_ENV}={env.get(VISIBLE_ENV)})"
        )
    ranks = d.gpus[:tp]
    for rank, g in enumerate(ranks):
        want = a.gpu_memory_utilization * g.total_gib
        if g.free_gib < want:  # vLLM's own start-up check (worker memory profiling)
            return (), (
                f"ValueError: Free memory on device cuda:{rank} ({g.free_gib:.2f}/{g.total_gib:.2f} GiB) on "
                f"startup is less than desired GPU memory utilization ({a.gpu_memory_utilization}, "
                f"{want:.2f} GiB). Decrease GPU memory utilization or reduce GPU memory used by other "
                f"processes. [GPU {g.index}, held by PIDs {', '.join(map(str, g.pids)) or 'none'}]"
            )
    return ranks, None


class StandIn:
    """What the HTTP handlers share: the settings, the counters, the requests in flight."""

    def __init__(self, a: argparse.Namespace, simulated: str):
        self.a = a
        self.simulated = simulated
        self.lock = threading.Lock()
        self.running = 0
        self.counters = {
            "vllm:prompt_tokens_total": 0.0,
            "vllm:generation_tokens_total": 0.0,
            "vllm:request_success_total": 0.0,
        }
        self.engine_id = f"standin-{os.getpid()}"
        self.side_port = int(os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT", "0") or 0)

    def models(self) -> dict:
        a = self.a
        return {
            "object": "list",
            "data": [
                {
                    "id": a.served_model_name,
                    "object": "model",
                    "root": a.model,
                    "owned_by": "pd-harness stand-in",
                    "max_model_len": a.max_model_len,
                }
            ],
        }

    def metrics(self) -> str:
        a = self.a
        with self.lock:
            running, counters = self.running, dict(self.counters)
        return model.metrics_text(
            a.served_model_name,
            running,
            a.num_gpu_blocks_override or DEFAULT_POOL_BLOCKS,
            a.block_size,
            counters,
            self.simulated,
        )

    def too_long(self, req: model.Request) -> str | None:
        total = len(req.ids) + req.max_tokens
        if total <= self.a.max_model_len:
            return None
        return (
            f"This model's maximum context length is {self.a.max_model_len} tokens. However, you requested "
            f"{total} tokens ({len(req.ids)} in the messages, {req.max_tokens} in the completion)."
        )

    def begin(self) -> None:
        with self.lock:
            self.running += 1

    def end(self, req: model.Request, generated: int, ok: bool) -> None:
        with self.lock:
            self.running -= 1
            self.counters["vllm:prompt_tokens_total"] += len(req.ids)
            self.counters["vllm:generation_tokens_total"] += generated
            self.counters["vllm:request_success_total"] += ok

    def answer(self, rid: str, req: model.Request) -> tuple[list[model.Step], dict | None]:
        steps = model.generate(req.ids, req.max_tokens, req.top_k or 1)
        a = self.a
        kv = model.prefill_params(req, self.engine_id, a.block_size, a.host, self.side_port, a.tensor_parallel_size)
        return steps, kv


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive, as the proxy's connection pools expect
    standin: StandIn

    def log_message(self, format: str, *args) -> None:  # noqa: A002 - the base class's name
        pass  # no access log: the harness reads servers' logs, and nothing here is worth a line per request

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, obj) -> None:
        self._send(status, json.dumps(obj).encode())

    def _error(self, status: int, message: str) -> None:
        self._json(status, {"error": {"message": message, "type": "BadRequestError", "code": status}})

    def do_GET(self) -> None:
        s = self.standin
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/v1/models":
            self._json(200, s.models())
        elif self.path == "/metrics":
            self._send(200, s.metrics().encode(), "text/plain; version=0.0.4")
        elif self.path == "/version":
            self._json(200, {"version": f"stand-in (simulated GPUs {s.simulated})"})
        else:
            self._error(404, f"{TAG} has no GET {self.path}")

    def do_POST(self) -> None:
        try:
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        except ValueError as e:
            self._error(400, f"request body is not JSON: {e}")
            return
        if self.path == "/tokenize":
            ids = model.tokenize(str(body.get("prompt", "")), bool(body.get("add_special_tokens", True)))
            self._json(200, {"count": len(ids), "max_model_len": self.standin.a.max_model_len, "tokens": ids})
        elif self.path == "/v1/completions":
            self._completion(body)
        else:
            self._error(404, f"{TAG} has no POST {self.path}")

    def _completion(self, body: dict) -> None:
        s = self.standin
        try:
            req = model.Request.from_body(body)
        except (KeyError, TypeError, ValueError) as e:
            self._error(400, f"bad completion request: {type(e).__name__}: {e}")
            return
        why = s.too_long(req)
        if why:
            self._error(400, why)
            return
        rid = self.headers.get("X-Request-Id") or f"{os.getpid()}-{id(req)}"
        s.begin()
        steps: list[model.Step] = []
        ok = False
        try:
            steps, kv = s.answer(rid, req)
            if req.stream:
                ok = self._stream(rid, req, steps)
            else:
                self._json(200, model.completion_body(rid, s.a.served_model_name, req, steps, kv))
                ok = True
        finally:
            s.end(req, len(steps), ok)
            if s.a.enable_log_requests:
                print(
                    f"{TAG} request {rid}: {len(req.ids)} prompt tokens, {len(steps)} generated, "
                    f"{'answered' if ok else 'client went away'}",
                    flush=True,
                )

    def _stream(self, rid: str, req: model.Request, steps: list[model.Step]) -> bool:
        """Server-sent events, one chunk per token; False when the client went away meanwhile."""
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Connection", "close")  # the end of the body is the end of the connection
        self.end_headers()
        self.close_connection = True
        try:
            for chunk in model.stream_chunks(rid, self.standin.a.served_model_name, req, steps):
                self.wfile.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")
            self.wfile.flush()
        except (BrokenPipeError, ConnectionResetError):
            return False
        return True


def _serve(a: argparse.Namespace, simulated: str) -> None:
    handler = type("StandInHandler", (Handler,), {"standin": StandIn(a, simulated)})
    server = ThreadingHTTPServer((a.host, a.port), handler)
    server.daemon_threads = True
    print(f"{TAG} serving {a.served_model_name} on http://{a.host}:{a.port}", flush=True)
    server.serve_forever(poll_interval=0.2)


def main(argv: list[str] | None = None) -> int:
    install_source()  # this process's discovery reads the box the harness gave it
    a = parse(sys.argv[1:] if argv is None else argv)
    spec = os.environ.get(SIMULATED_ENV, "")
    print(
        f"{TAG} NOT vLLM: a stand-in for vllm.entrypoints.openai.api_server on a simulated GPU box "
        f"({SIMULATED_ENV}={spec}); role {a.kv_role or 'plain server'}, TP {a.tensor_parallel_size}",
        flush=True,
    )
    ranks, why = take_gpus(a, os.environ)
    if why:
        print(why, flush=True)
        return 1
    folder, pid = box_state(), os.getpid()
    claim = Claim(
        pid,
        proc_start(pid) or "",
        tuple(g.index for g in ranks),
        a.gpu_memory_utilization * ranks[0].total_gib,
        f"{a.kv_role or 'server'}:{a.port}",
    )

    def leave(signum, frame) -> None:  # as a server that exits: its memory goes back to the GPUs
        release(folder, pid)
        os._exit(0)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, leave)
    register(folder, claim)
    print(
        f"{TAG} holding {claim.gib_per_gpu:.1f} GiB on each of GPUs {','.join(map(str, claim.gpus))} "
        f"({VISIBLE_ENV}={os.environ.get(VISIBLE_ENV)}, gpu_memory_utilization {a.gpu_memory_utilization}); "
        f"registered in {folder}",
        flush=True,
    )
    try:
        _serve(a, spec)
    finally:
        release(folder, pid)
    return 0


if __name__ == "__main__":
    sys.exit(main())
