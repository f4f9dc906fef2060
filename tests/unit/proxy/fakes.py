"""Fake P and D backends for the proxy tests: small raw HTTP servers on 127.0.0.1 in a background event loop."""

import asyncio
import json

from fastapi.testclient import TestClient

from harness.proxy.app import create_app

KV = {
    "do_remote_prefill": True,
    "do_remote_decode": False,
    "remote_block_ids": [[1, 2]],
    "remote_engine_id": "e",
    "remote_host": "127.0.0.1",
    "remote_port": 5600,
    "tp_size": 1,
}


def http(status: int, body: bytes | dict | list, content_type: str = "application/json") -> bytes:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    return f"HTTP/1.1 {status} X\r\ncontent-type: {content_type}\r\ncontent-length: {len(data)}\r\n\r\n".encode() + data


def chunked(parts: list[bytes], end: bool = True) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    return head + b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + (b"0\r\n\r\n" if end else b"")


class Drop:
    """Write these bytes (maybe none), then cut the connection."""

    def __init__(self, data: bytes = b""):
        self.data = data


class Slow:
    def __init__(self, seconds: float, data: bytes):
        self.seconds, self.data = seconds, data


class Fakes:
    """Fake backends by name (p* answer as prefill servers, d* as decode servers); records every completion request."""

    def __init__(self):
        self.urls: dict[str, str] = {}
        self.calls: list[tuple[str, dict, dict]] = []
        self.cut_before_answer: list[str] = []  # backends whose request connection was closed before they answered
        self.override: dict = {}  # name -> fn(body) -> bytes | Drop | Slow; (name, "health") -> bytes

    def url(self, name: str) -> str:
        return self.urls[name]

    def answer(self, name: str, method: str, path: str, raw: bytes, headers: dict):
        if path == "/health":
            return self.override.get((name, "health"), http(200, {}))
        body = json.loads(raw)
        self.calls.append((self.urls[name], body, headers))
        if name in self.override:
            return self.override[name](body)
        if name.startswith("p"):
            return http(200, {"choices": [{"text": "x"}], "kv_transfer_params": KV})
        return http(200, {"choices": [{"text": f"decoded by {self.urls[name]}"}]})


class FakeProtocol(asyncio.Protocol):
    def __init__(self, fakes: Fakes, name: str):
        self.fakes, self.name, self.buf = fakes, name, b""

    def connection_made(self, transport):
        self.transport = transport
        self.answered = False

    def connection_lost(self, exc):
        # A connection the proxy closed before we answered: the proxy passed a client's cancellation on.
        if not self.answered and self.buf == b"" and getattr(self, "got_request", False):
            self.fakes.cut_before_answer.append(self.name)

    def data_received(self, data: bytes):
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        lines = self.buf[:end].decode().split("\r\n")
        headers = {k.strip().lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
        n = int(headers.get("content-length", 0))
        if len(self.buf) < end + 4 + n:
            return
        raw, self.buf = self.buf[end + 4 : end + 4 + n], self.buf[end + 4 + n :]
        method, path, _ = lines[0].split(" ")
        self.got_request = path != "/health"
        out = self.fakes.answer(self.name, method, path, raw, headers)
        asyncio.ensure_future(self.respond(out))

    async def respond(self, out):
        if isinstance(out, Slow):
            await asyncio.sleep(out.seconds)
            out = out.data
        if self.transport.is_closing():
            return
        self.answered = True
        if isinstance(out, Drop):
            self.transport.write(out.data)
            await asyncio.sleep(0.05)
            self.transport.abort()
            return
        self.transport.write(out)


def client(b: Fakes, prefill=("p1",), decode=("d1",), **kw) -> TestClient:
    return TestClient(create_app([b.url(n) for n in prefill], [b.url(n) for n in decode], **kw))
