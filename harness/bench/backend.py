"""A minimal OpenAI-style backend for the proxy benchmarks (no model: it answers at once).

    python -m harness.bench.backend --port P [--ready-after S] [--ready-file F]

A prefill-style request (``kv_transfer_params.do_remote_decode`` true) gets a
one-token completion carrying ``kv_transfer_params`` as vLLM's P server returns
them; any other completion is a decode answer, streamed as SSE when the body
asks for ``stream``. ``/health`` answers 200 only ``--ready-after`` seconds
after start; the wall-clock moment it turns ready goes to ``--ready-file``, so
readiness-detection latency can be measured against it. ``/metrics`` counts
requests per role.

It is a raw asyncio HTTP/1.1 server with keep-alive (uvloop when installed):
on 2 cores a framework server would itself become the bottleneck of the
proxy benchmark, which must measure the proxies, not this process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import sys
import time

from harness.core.argtypes import HarnessArgumentParser

# One KV params shape, as vLLM's NixlConnector returns it from P (what harness/proxy/app.py forwards to D).
KV_TRANSFER_PARAMS = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2, 3]],
    "remote_engine_id": "bench-engine",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}
STATUS_TEXT = {200: "OK", 400: "Bad Request", 404: "Not Found", 413: "Payload Too Large", 503: "Service Unavailable"}
MAX_BODY = 64 * 1024 * 1024


def completion(chat: bool, text: str, kv: dict | None = None) -> dict:
    choice: dict = {"index": 0, "finish_reason": "length", "logprobs": None}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    out = {
        "id": "cmpl-bench",
        "object": "chat.completion" if chat else "text_completion",
        "created": 0,
        "model": "bench",
        "choices": [choice],
        "usage": {"prompt_tokens": 8, "completion_tokens": 1, "total_tokens": 9},
    }
    if kv is not None:
        out["kv_transfer_params"] = kv
    return out


def response_bytes(status: int, body: bytes, content_type: str = "application/json", extra: str = "") -> bytes:
    head = (
        f"HTTP/1.1 {status} {STATUS_TEXT.get(status, 'OK')}\r\ncontent-type: {content_type}\r\n"
        f"content-length: {len(body)}\r\n{extra}\r\n"
    )
    return head.encode() + body


def sse_bytes(chat: bool, events: int, extra: str = "") -> bytes:
    """A chunked text/event-stream answer: ``events`` token events, then [DONE]."""
    parts = []
    for i in range(events):
        delta = {"index": 0, "delta": {"content": f"t{i}"}} if chat else {"index": 0, "text": f"t{i}"}
        parts.append(b"data: " + json.dumps({"id": "cmpl-bench", "choices": [delta]}).encode() + b"\n\n")
    parts.append(b"data: [DONE]\n\n")
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    head = (f"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n{extra}\r\n").encode()
    return head + chunks


class State:
    def __init__(self, ready_after_s: float, ready_file: str | None, stream_events: int):
        self.ready = False
        self.ready_after_s = ready_after_s
        self.ready_file = ready_file
        self.stream_events = stream_events
        self.counts = {"prefill": 0, "decode": 0, "bad": 0}

    def mark_ready(self) -> None:
        self.ready = True
        if self.ready_file:
            # Wall clock: the reader (another process) compares it with its own time.time().
            tmp = f"{self.ready_file}.tmp"
            with open(tmp, "w") as f:
                f.write(f"{time.time():.6f}\n")
            os.replace(tmp, self.ready_file)

    def answer(self, method: str, path: str, body: bytes, request_id: str | None) -> bytes:
        extra = f"x-request-id: {request_id}\r\n" if request_id else ""
        if method == "GET" and path == "/health":
            return response_bytes(200 if self.ready else 503, b"{}", extra=extra)
        if method == "GET" and path == "/metrics":
            text = "".join(f'bench_requests_total{{role="{k}"}} {v}\n' for k, v in self.counts.items())
            return response_bytes(200, text.encode(), "text/plain; version=0.0.4", extra)
        if method != "POST" or path not in ("/v1/completions", "/v1/chat/completions"):
            return response_bytes(404, b'{"error": {"message": "not found"}}', extra=extra)
        chat = path == "/v1/chat/completions"
        try:
            req = json.loads(body)
            kv = req.get("kv_transfer_params") or {}
            stream = bool(req.get("stream"))
        except (ValueError, AttributeError):
            self.counts["bad"] += 1
            return response_bytes(400, b'{"error": {"message": "bad request body"}}', extra=extra)
        if kv.get("do_remote_decode"):
            self.counts["prefill"] += 1
            return response_bytes(200, json.dumps(completion(chat, "p", KV_TRANSFER_PARAMS)).encode(), extra=extra)
        self.counts["decode"] += 1
        if stream:
            return sse_bytes(chat, self.stream_events, extra)
        return response_bytes(200, json.dumps(completion(chat, "decoded")).encode(), extra=extra)


class HttpProtocol(asyncio.Protocol):
    """HTTP/1.1 with keep-alive and pipelining; Content-Length bodies only (what the proxies and load generator
    send)."""

    def __init__(self, state: State):
        self.state = state
        self.buf = bytearray()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
            try:
                method, target, _ = head[0].split(" ", 2)
            except ValueError:
                self._close(response_bytes(400, b"{}"))
                return
            length, request_id, close = 0, None, False
            for line in head[1:]:
                name, _, value = line.partition(":")
                name = name.strip().lower()
                if name == "content-length":
                    length = int(value.strip() or 0)
                elif name == "x-request-id":
                    request_id = value.strip()
                elif name == "connection":
                    close = value.strip().lower() == "close"
                elif name == "transfer-encoding":
                    self._close(
                        response_bytes(400, b'{"error": {"message": "chunked request bodies are not supported"}}')
                    )
                    return
            if length > MAX_BODY:
                self._close(response_bytes(413, b"{}"))
                return
            if len(self.buf) < end + 4 + length:
                return  # wait for the rest of the body
            body = bytes(self.buf[end + 4 : end + 4 + length])
            del self.buf[: end + 4 + length]
            out = self.state.answer(method, target.split("?", 1)[0], body, request_id)
            if close:
                self._close(out)
                return
            assert self.transport is not None
            self.transport.write(out)

    def _close(self, out: bytes) -> None:
        assert self.transport is not None
        self.transport.write(out)
        self.transport.close()
        self.buf.clear()


async def serve(host: str, port: int, state: State) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(lambda: HttpProtocol(state), host, port, backlog=1024, reuse_address=True)
    # Counted from the moment it listens, so the ready moment is one it can really answer at.
    loop.call_later(max(0.0, state.ready_after_s), state.mark_ready)
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    print(f"bench backend on http://{host}:{port} (ready after {state.ready_after_s:g} s)", flush=True)
    async with server:
        await stop.wait()
    print("bench backend stopped", flush=True)


def run(coro) -> None:
    """asyncio.run on uvloop when it is installed (it is a vLLM dependency)."""
    try:
        import uvloop
    except ImportError:
        asyncio.run(coro)
        return
    if sys.version_info >= (3, 11):
        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(coro)
    else:  # no asyncio.Runner before Python 3.11
        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
        asyncio.run(coro)


def main(argv: list[str] | None = None) -> int:
    ap = HarnessArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--ready-after", type=float, default=0.0, help="seconds before /health answers 200")
    ap.add_argument("--ready-file", help="write the wall-clock moment /health turned 200 here")
    ap.add_argument("--stream-events", type=int, default=4, help="token events per streamed decode answer")
    a = ap.parse_args(argv)
    state = State(a.ready_after, a.ready_file, a.stream_events)
    run(serve(a.host, a.port, state))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
