"""The P/D routing proxy: prefill on P with max_tokens=1, then decode on D with P's kv_transfer_params.

A request whose prefill answer carries no ``kv_transfer_params`` fails with
502: a decode without a transfer would look right and prove nothing.

The backend hops go through aiohttp, one session (keep-alive pool) per
backend: measured on this project's 2-core box, an httpx request costs about
1 ms of proxy CPU against 0.2 ms for aiohttp, and the proxy makes two per
client request (``python -m harness bench proxy``).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import itertools
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from harness.core.safe import file_stem, under
from harness.hosts.faults import GO, HELD

log = logging.getLogger("toy_proxy")

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
BODY_LIMIT = 2000  # characters of a backend's error body quoted in a 502
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
KEEPALIVE_S = 4.0


# Where a request was when its client went away; "between_hops" strands P's blocks until P's lease expires.
CANCEL_STAGES = ("before_prefill", "prefill", "between_hops", "decode")
KEEP_IDS = 1000  # request ids kept per list in /proxy/stats
KEEP_HOP_TIMES = 256


@dataclass
class ProxyStats:
    requests: int = 0
    completed: int = 0
    prefill_with_kv_transfer_params: int = 0
    prefill_missing_kv_transfer_params: int = 0
    errors: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    last_kv_transfer_params: dict | None = None
    # Client cancellations, passed on to the backend of the hop in flight (its connection is closed, so vLLM aborts).
    cancelled: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CANCEL_STAGES, 0))
    cancelled_ids: dict[str, list[str]] = field(default_factory=lambda: {s: [] for s in CANCEL_STAGES})
    faulted_ids: list[str] = field(default_factory=list)  # requests the fault hook changed
    prefill_hop_ms: list[float] = field(default_factory=list)  # the latest prefill hop durations

    def cancel(self, stage: str, request_id: str) -> None:
        self.cancelled[stage] += 1
        if len(self.cancelled_ids[stage]) < KEEP_IDS:
            self.cancelled_ids[stage].append(request_id)


class HopError(Exception):
    def __init__(self, status: int, hop: str, message: str, body: bytes | None = None, passthrough: bool = False):
        self.status, self.hop, self.message, self.body, self.passthrough = status, hop, message, body, passthrough
        super().__init__(message)

    def response(self, request_id: str) -> Response:
        headers = {"X-Request-Id": request_id, "X-Proxy-Hop": self.hop}
        if self.passthrough and self.body is not None:
            return Response(self.body, status_code=self.status, headers=headers, media_type="application/json")
        return JSONResponse(
            {"error": {"message": self.message, "type": "proxy_error", "hop": self.hop}},
            status_code=self.status,
            headers=headers,
        )


class BadRequest(Exception):
    def __init__(self, status: int, message: str):
        self.status, self.message = status, message
        super().__init__(message)


def prefill_body(body: dict) -> dict:
    """The client's body as P must see it: one token, no streaming, asking to hand KV to a decoder."""
    b = dict(body)  # only top-level keys change, so a shallow copy leaves the client's body intact
    b["max_tokens"] = 1
    if "max_completion_tokens" in b:
        b["max_completion_tokens"] = 1
    b["stream"] = False
    b.pop("stream_options", None)
    b.pop("min_tokens", None)
    b["kv_transfer_params"] = dict(PREFILL_KV_PARAMS)
    return b


def validate_body(raw: bytes, path: str) -> dict:
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ValueError(f"request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise ValueError("request body must be a JSON object")
    if path.endswith("/chat/completions"):
        if not isinstance(body.get("messages"), list):
            raise ValueError("chat completion request needs a 'messages' list")
    elif "prompt" not in body:
        raise ValueError("completion request needs a 'prompt'")
    return body


async def read_body(request: Request, limit: int) -> bytes:
    """The request body, refused with 413 past ``limit`` bytes, before reading it when Content-Length says so."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise BadRequest(413, f"request body of {int(declared)} bytes exceeds the proxy's limit of {limit} bytes")
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise BadRequest(413, f"request body exceeds the proxy's limit of {limit} bytes")
        chunks.append(chunk)
    return b"".join(chunks)


def encode(body: dict) -> bytes:
    return json.dumps(body, separators=(",", ":"), ensure_ascii=False).encode()


def hold_until_released(hold_dir: Path, limit_s: float = 60.0) -> Callable[[str], Awaitable[None]]:
    """A between-hops hook: mark the request held (``<id>.held`` in ``hold_dir``) and wait until ``<id>.go`` appears
    (or ``limit_s`` passes), so whoever injects a fault does so while this request is between its hops. ``<id>`` is
    the request id as a safe file name (``file_stem``: a client's ``X-Request-Id`` may hold ``../`` or ``/``), and
    the files are checked to stay in ``hold_dir``."""

    async def hold(request_id: str) -> None:
        stem = file_stem(request_id)
        held = under(hold_dir, hold_dir / f"{stem}{HELD}")
        go = under(hold_dir, hold_dir / f"{stem}{GO}")
        held.touch()
        log.warning("req %s: held between hops for a fault (%s)", request_id, held)
        deadline = time.monotonic() + limit_s
        while not go.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.05)

    return hold


def corrupt_block_ids(params: dict) -> dict:
    """Fault injection: shift every remote block id by one, keeping the shape, so D reads the wrong blocks."""
    p = copy.deepcopy(params)

    def shift(x):
        return [shift(y) for y in x] if isinstance(x, list) else x + 1

    if isinstance(p.get("remote_block_ids"), list):
        p["remote_block_ids"] = shift(p["remote_block_ids"])
    return p


def wrong_engine_id(params: dict) -> dict:
    """Fault injection: name a P engine that does not exist, so D's handshake (and so every transfer) fails."""
    return {**params, "remote_engine_id": "no-such-engine"}


async def client_gone(request: Request) -> None:
    """Returns when the client disconnects (call only after the body has been read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _connection_error(hop: str, url: str, timeout_s: float, e: BaseException) -> HopError:
    if isinstance(e, (asyncio.TimeoutError, aiohttp.ServerTimeoutError)):
        return HopError(504, hop, f"{hop} hop to {url} timed out after {timeout_s:g} s: {type(e).__name__}")
    return HopError(502, hop, f"{hop} hop to {url} failed: {type(e).__name__}: {e}")


@dataclass(frozen=True)
class FaultSettings:
    """Fault injection for tests, applied to every ``every``-th request (/proxy/stats names them): ``hook`` changes
    the kv_transfer_params D gets; ``skip_transfer`` acts like a proxy that forgot ``do_remote_decode`` and decodes
    anyway (D then computes the whole prompt itself; outputs look right, but no KV moved); ``between_hops`` runs
    while P holds the KV (a fault between hosts lands there)."""

    hook: Callable[[dict], dict] | None = None
    skip_transfer: bool = False
    every: int = 1
    between_hops: Callable[[str], Awaitable[None]] | None = None

    def __post_init__(self) -> None:
        if self.every < 1:
            raise ValueError("fault_every must be >= 1")

    @property
    def any(self) -> bool:
        return self.hook is not None or self.skip_transfer or self.between_hops is not None


class Router:
    """One proxy's routing: its backends (used in turn), one keep-alive session per backend (opened by the app's
    lifespan), the counters /proxy/stats serves, and the fault settings. A request goes P hop, then D hop."""

    def __init__(self, prefill_urls: list[str], decode_urls: list[str], timeout_s: float, faults: FaultSettings):
        if not prefill_urls or not decode_urls:
            raise ValueError("the proxy needs at least one prefill and one decode backend")
        self.prefill_urls = [u.rstrip("/") for u in prefill_urls]
        self.decode_urls = [u.rstrip("/") for u in decode_urls]
        self.timeout_s, self.faults = timeout_s, faults
        self.p_cycle, self.d_cycle = itertools.cycle(self.prefill_urls), itertools.cycle(self.decode_urls)
        self.stats = ProxyStats()
        self.sessions: dict[str, aiohttp.ClientSession] = {}

    @asynccontextmanager
    async def lifespan(self, app: FastAPI):
        # Per read and per connect, not total: a long decode stream is fine as long as tokens keep coming.
        timeout = aiohttp.ClientTimeout(total=None, connect=self.timeout_s, sock_read=self.timeout_s)
        for url in dict.fromkeys(self.prefill_urls + self.decode_urls):
            # No pool cap (vLLM queues requests itself). Idle connections close after 4 s, before uvicorn's 5 s
            # keep-alive timeout on the backend, so a POST never goes out on a connection the server is closing.
            connector = aiohttp.TCPConnector(limit=0, keepalive_timeout=KEEPALIVE_S)
            self.sessions[url] = aiohttp.ClientSession(connector=connector, timeout=timeout)
        try:
            yield
        finally:
            await asyncio.gather(*(s.close() for s in self.sessions.values()))

    async def send(self, hop: str, url: str, path: str, body: dict, headers: dict) -> aiohttp.ClientResponse:
        """POST to one backend; the answer's body is still unread. Non-200 becomes a HopError."""
        try:
            resp = await self.sessions[url].post(f"{url}{path}", data=encode(body), headers=headers)
        except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
            raise _connection_error(hop, url, self.timeout_s, e) from None
        if resp.status != 200:
            raw = await self.read(hop, url, resp)
            if resp.status >= 500:
                text = raw.decode("utf-8", "replace")[:BODY_LIMIT]
                raise HopError(502, hop, f"{hop} hop to {url} failed: backend answered HTTP {resp.status}: {text}")
            raise HopError(resp.status, hop, f"{hop} hop to {url}: HTTP {resp.status}", body=raw, passthrough=True)
        return resp

    async def read(self, hop: str, url: str, resp: aiohttp.ClientResponse) -> bytes:
        try:
            return await resp.read()
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            raise _connection_error(hop, url, self.timeout_s, e) from None
        finally:
            resp.release()

    def count(self, request_id: str) -> bool:
        """Count a new request; whether the fault applies to it (then it is named in /proxy/stats)."""
        self.stats.requests += 1
        fault = self.faults.any and self.stats.requests % self.faults.every == 0
        if fault and len(self.stats.faulted_ids) < KEEP_IDS:
            self.stats.faulted_ids.append(request_id)
        return fault

    async def prefill(
        self, p_url: str, path: str, body: dict, headers: dict, fault: bool, stage: list[str]
    ) -> dict | None:
        """The P hop: the kv_transfer_params to hand D (the fault's hook applied), or None where the fault skips
        the transfer."""
        t0 = time.monotonic()
        skip = self.faults.skip_transfer and fault
        p_body = prefill_body(body)
        if skip:
            del p_body["kv_transfer_params"]
        stage[0] = "prefill"
        p_raw = await self.read("prefill", p_url, await self.send("prefill", p_url, path, p_body, headers))
        stage[0] = "between_hops"
        if fault and self.faults.between_hops is not None:
            await self.faults.between_hops(headers["X-Request-Id"])  # P holds the KV: a fault between hosts lands here
        self.stats.prefill_hop_ms = [
            *self.stats.prefill_hop_ms[-(KEEP_HOP_TIMES - 1) :],
            1000 * (time.monotonic() - t0),
        ]
        try:
            kv = json.loads(p_raw).get("kv_transfer_params")
        except (ValueError, AttributeError):
            kv = None
        if not kv:
            self.stats.prefill_missing_kv_transfer_params += 1
            if not skip:
                raise HopError(
                    502,
                    "prefill",
                    f"prefill hop to {p_url}: the prefill answer carried no kv_transfer_params, "
                    "so no KV transfer can happen",
                )
            return None
        self.stats.prefill_with_kv_transfer_params += 1
        self.stats.last_kv_transfer_params = kv
        if skip:
            return None
        if fault and self.faults.hook is not None:
            return self.faults.hook(kv)
        return kv

    async def route(self, request: Request, path: str, body: dict, request_id: str, stage: list[str]) -> Response:
        """P hop then D hop; ``stage[0]`` says where the request is, for a client that goes away meanwhile."""
        fault = self.count(request_id)
        t0 = time.monotonic()
        p_url, d_url = next(self.p_cycle), next(self.d_cycle)
        headers = {"X-Request-Id": request_id, "Content-Type": "application/json"}
        auth = request.headers.get("authorization")
        if auth:
            headers["Authorization"] = auth
        try:
            kv = await self.prefill(p_url, path, body, headers, fault, stage)
            d_body = dict(body)
            if kv is not None:
                d_body["kv_transfer_params"] = kv
            stage[0] = "decode"
            d_resp = await self.send("decode", d_url, path, d_body, headers)
            if body.get("stream"):
                ms = 1000 * (time.monotonic() - t0)
                log.debug("req %s P=%s D=%s stream started kv=yes %.1f ms", request_id, p_url, d_url, ms)
                return StreamingResponse(
                    self.relay(d_resp, d_url, request_id),
                    media_type="text/event-stream",
                    headers={"X-Request-Id": request_id},
                )
            d_raw = await self.read("decode", d_url, d_resp)
        except HopError as e:
            self.stats.errors[e.hop] = self.stats.errors.get(e.hop, 0) + 1
            log.warning("req %s P=%s D=%s failed (%s): %s", request_id, p_url, d_url, e.status, e.message)
            return e.response(request_id)
        self.stats.completed += 1
        # Successes at debug level: /proxy/stats keeps the counts, and a line per request costs throughput.
        log.debug("req %s P=%s D=%s 200 kv=yes %.1f ms", request_id, p_url, d_url, 1000 * (time.monotonic() - t0))
        return Response(d_raw, status_code=200, media_type="application/json", headers={"X-Request-Id": request_id})

    async def handle(self, request: Request, path: str, max_body_bytes: int) -> Response:
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            raw = await read_body(request, max_body_bytes)
            try:
                body = validate_body(raw, path)
            except ValueError as e:
                raise BadRequest(400, str(e)) from None
            stage = ["before_prefill"]
            return await self.until_disconnect(
                request, self.route(request, path, body, request_id, stage), stage, request_id
            )
        except BadRequest as e:
            return JSONResponse(
                {"error": {"message": e.message, "type": "invalid_request_error"}},
                status_code=e.status,
                headers={"X-Request-Id": request_id},
            )
        except Exception as e:  # noqa: BLE001 - a bug here must still answer JSON, never a bare 500 with a traceback
            log.exception("req %s: proxy error", request_id)
            return JSONResponse(
                {"error": {"message": f"proxy error: {type(e).__name__}: {e}", "type": "proxy_error"}},
                status_code=500,
                headers={"X-Request-Id": request_id},
            )

    async def until_disconnect(self, request: Request, work, stage: list[str], request_id: str) -> Response:
        """Run ``work`` (the hops) until it answers or the client goes away; then cancel it, which closes the
        backend connection of the hop in flight, so that backend aborts the request as it would for a client."""
        job = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(client_gone(request))  # the body is read: receive() now waits for a disconnect
        try:
            await asyncio.wait((job, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not gone.done():
                gone.cancel()
        if job.done():
            return job.result()
        job.cancel()
        with contextlib.suppress(asyncio.CancelledError, HopError):
            await job
        self.stats.cancel(stage[0], request_id)
        log.info("req %s: client went away during %s; backend request cancelled", request_id, stage[0])
        return Response(status_code=499, headers={"X-Request-Id": request_id})

    async def relay(self, resp: aiohttp.ClientResponse, url: str, request_id: str):
        done = False
        try:
            async for chunk in resp.content.iter_any():
                yield chunk
            done = True
            self.stats.completed += 1
        except (aiohttp.ClientError, asyncio.TimeoutError) as e:
            self.stats.errors["decode"] += 1
            msg = {
                "error": {
                    "message": f"decode hop to {url} failed mid-stream: {type(e).__name__}: {e}",
                    "type": "proxy_error",
                    "hop": "decode",
                }
            }
            log.warning("req %s stream broke: %s: %s", request_id, type(e).__name__, e)
            yield f"data: {json.dumps(msg)}\n\n".encode()
        except (asyncio.CancelledError, GeneratorExit):  # the client went away mid-stream
            self.stats.cancel("decode", request_id)
            log.info("req %s: client went away during the decode stream; backend request cancelled", request_id)
            raise
        finally:
            # A stream cut short (backend error, client gone) must not leave a half-read connection in the pool.
            if done:
                resp.release()
            else:
                resp.close()

    async def healthcheck(self) -> Response:
        async def probe(role: str, url: str) -> dict:
            try:
                async with self.sessions[url].get(f"{url}/health", timeout=aiohttp.ClientTimeout(total=5.0)) as r:
                    return {"role": role, "url": url, "ok": r.status == 200, "detail": f"HTTP {r.status}"}
            except (aiohttp.ClientError, asyncio.TimeoutError, OSError) as e:
                return {"role": role, "url": url, "ok": False, "detail": f"{type(e).__name__}: {e}"}

        results = await asyncio.gather(
            *[probe("prefill", u) for u in self.prefill_urls], *[probe("decode", u) for u in self.decode_urls]
        )
        ok = all(r["ok"] for r in results)
        return JSONResponse(
            {"status": "ok" if ok else "degraded", "backends": list(results)}, status_code=200 if ok else 503
        )


def create_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    timeout_s: float = 300.0,
    kv_params_hook: Callable[[dict], dict] | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    skip_transfer: bool = False,
    fault_every: int = 1,
    between_hops: Callable[[str], Awaitable[None]] | None = None,
) -> FastAPI:
    """The proxy's app (see ``Router``; the fault arguments are ``FaultSettings``'s)."""
    faults = FaultSettings(kv_params_hook, skip_transfer, fault_every, between_hops)
    router = Router(prefill_urls, decode_urls, timeout_s, faults)
    # No /docs, /redoc, /openapi.json: nothing reads them, and /docs loads its assets from a CDN (docs/proxy.md).
    app = FastAPI(lifespan=router.lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.stats = router.stats

    async def completions(request: Request) -> Response:
        return await router.handle(request, "/v1/completions", max_body_bytes)

    async def chat(request: Request) -> Response:
        return await router.handle(request, "/v1/chat/completions", max_body_bytes)

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def healthcheck(request: Request) -> Response:
        return await router.healthcheck()

    async def proxy_stats(request: Request) -> Response:
        return JSONResponse(asdict(router.stats))

    # Plain Starlette routes: FastAPI's dependency resolution costs tens of µs per request and these take no parameters.
    app.add_route("/v1/completions", completions, methods=["POST"])
    app.add_route("/v1/chat/completions", chat, methods=["POST"])
    for path, endpoint in (("/health", health), ("/healthcheck", healthcheck), ("/proxy/stats", proxy_stats)):
        app.add_route(path, endpoint, methods=["GET"])
    return app
