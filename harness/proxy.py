"""The P/D routing proxy: prefill on P with max_tokens=1, then decode on D with P's kv_transfer_params.

A request whose prefill answer carries no ``kv_transfer_params`` fails with
502: a decode without a transfer would look right and prove nothing.
"""

from __future__ import annotations

import asyncio
import copy
import itertools
import json
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

log = logging.getLogger("toy_proxy")

PREFILL_KV_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}
BODY_LIMIT = 2000


@dataclass
class ProxyStats:
    requests: int = 0
    completed: int = 0
    prefill_with_kv_transfer_params: int = 0
    prefill_missing_kv_transfer_params: int = 0
    errors: dict[str, int] = field(default_factory=lambda: {"prefill": 0, "decode": 0})
    last_kv_transfer_params: dict | None = None


class HopError(Exception):
    def __init__(self, status: int, hop: str, message: str, body: bytes | None = None, passthrough: bool = False):
        self.status, self.hop, self.message, self.body, self.passthrough = status, hop, message, body, passthrough
        super().__init__(message)

    def response(self, request_id: str) -> Response:
        headers = {"X-Request-Id": request_id, "X-Proxy-Hop": self.hop}
        if self.passthrough and self.body is not None:
            return Response(self.body, status_code=self.status, headers=headers, media_type="application/json")
        return JSONResponse({"error": {"message": self.message, "type": "proxy_error", "hop": self.hop}}, status_code=self.status, headers=headers)


def prefill_body(body: dict) -> dict:
    """The client's body as P must see it: one token, no streaming, asking to hand KV to a decoder."""
    b = copy.deepcopy(body)
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


def corrupt_block_ids(params: dict) -> dict:
    """Fault injection: shift every remote block id by one, keeping the shape, so D reads the wrong blocks."""
    p = copy.deepcopy(params)

    def shift(x):
        return [shift(y) for y in x] if isinstance(x, list) else x + 1

    if isinstance(p.get("remote_block_ids"), list):
        p["remote_block_ids"] = shift(p["remote_block_ids"])
    return p


def create_app(
    prefill_urls: list[str],
    decode_urls: list[str],
    timeout_s: float = 300.0,
    transport: httpx.AsyncBaseTransport | None = None,
    kv_params_hook: Callable[[dict], dict] | None = None,
) -> FastAPI:
    if not prefill_urls or not decode_urls:
        raise ValueError("the proxy needs at least one prefill and one decode backend")
    prefill_urls = [u.rstrip("/") for u in prefill_urls]
    decode_urls = [u.rstrip("/") for u in decode_urls]
    hook = kv_params_hook or (lambda p: p)
    p_cycle, d_cycle = itertools.cycle(prefill_urls), itertools.cycle(decode_urls)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=200)
        app.state.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s), transport=transport, limits=limits)
        try:
            yield
        finally:
            await app.state.client.aclose()

    app = FastAPI(lifespan=lifespan)
    app.state.stats = ProxyStats()

    async def send(hop: str, url: str, path: str, body: dict, headers: dict, stream: bool = False) -> httpx.Response:
        client: httpx.AsyncClient = app.state.client
        try:
            req = client.build_request("POST", f"{url}{path}", json=body, headers=headers)
            resp = await client.send(req, stream=stream)
        except httpx.TimeoutException as e:
            raise HopError(504, hop, f"{hop} hop to {url} timed out after {timeout_s:g} s: {type(e).__name__}") from None
        except httpx.TransportError as e:
            raise HopError(502, hop, f"{hop} hop to {url} failed: {type(e).__name__}: {e}") from None
        if resp.status_code != 200:
            raw = await resp.aread() if stream else resp.content
            if stream:
                await resp.aclose()
            if resp.status_code >= 500:
                text = raw.decode("utf-8", "replace")[:BODY_LIMIT]
                raise HopError(502, hop, f"{hop} hop to {url} failed: backend answered HTTP {resp.status_code}: {text}")
            raise HopError(resp.status_code, hop, f"{hop} hop to {url}: HTTP {resp.status_code}", body=raw, passthrough=True)
        return resp

    async def handle(request: Request, path: str) -> Response:
        stats: ProxyStats = app.state.stats
        request_id = request.headers.get("x-request-id") or uuid.uuid4().hex
        try:
            body = validate_body(await request.body(), path)
        except ValueError as e:
            return JSONResponse({"error": {"message": str(e), "type": "invalid_request_error"}}, status_code=400, headers={"X-Request-Id": request_id})
        stats.requests += 1
        t0 = time.monotonic()
        p_url, d_url = next(p_cycle), next(d_cycle)
        headers = {"X-Request-Id": request_id}
        auth = request.headers.get("authorization")
        if auth:
            headers["Authorization"] = auth
        hop = "prefill"
        try:
            p_resp = await send("prefill", p_url, path, prefill_body(body), headers)
            try:
                kv = p_resp.json().get("kv_transfer_params")
            except (json.JSONDecodeError, AttributeError):
                kv = None
            if not kv:
                stats.prefill_missing_kv_transfer_params += 1
                raise HopError(502, "prefill", f"prefill hop to {p_url}: the prefill answer carried no kv_transfer_params, so no KV transfer can happen")
            stats.prefill_with_kv_transfer_params += 1
            stats.last_kv_transfer_params = kv
            d_body = dict(body)
            d_body["kv_transfer_params"] = hook(kv)
            hop = "decode"
            if body.get("stream"):
                d_resp = await send("decode", d_url, path, d_body, headers, stream=True)
                log.info("req %s P=%s D=%s stream started kv=yes %.0f ms", request_id, p_url, d_url, 1000 * (time.monotonic() - t0))
                return StreamingResponse(relay(d_resp, d_url, request_id), media_type="text/event-stream", headers={"X-Request-Id": request_id})
            d_resp = await send("decode", d_url, path, d_body, headers)
        except HopError as e:
            stats.errors[e.hop] = stats.errors.get(e.hop, 0) + 1
            log.warning("req %s P=%s D=%s failed (%s): %s", request_id, p_url, d_url, e.status, e.message)
            return e.response(request_id)
        stats.completed += 1
        log.info("req %s P=%s D=%s 200 kv=yes %.0f ms", request_id, p_url, d_url, 1000 * (time.monotonic() - t0))
        return Response(d_resp.content, status_code=200, media_type="application/json", headers={"X-Request-Id": request_id})

    async def relay(resp: httpx.Response, url: str, request_id: str):
        stats: ProxyStats = app.state.stats
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
            stats.completed += 1
        except httpx.HTTPError as e:
            stats.errors["decode"] += 1
            msg = {"error": {"message": f"decode hop to {url} failed mid-stream: {type(e).__name__}: {e}", "type": "proxy_error", "hop": "decode"}}
            log.warning("req %s stream broke: %s", request_id, e)
            yield f"data: {json.dumps(msg)}\n\n".encode()
        finally:
            await resp.aclose()

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await handle(request, "/v1/completions")

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        return await handle(request, "/v1/chat/completions")

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/healthcheck")
    async def healthcheck() -> Response:
        client: httpx.AsyncClient = app.state.client

        async def probe(role: str, url: str) -> dict:
            try:
                r = await client.get(f"{url}/health", timeout=5.0)
                return {"role": role, "url": url, "ok": r.status_code == 200, "detail": f"HTTP {r.status_code}"}
            except httpx.HTTPError as e:
                return {"role": role, "url": url, "ok": False, "detail": f"{type(e).__name__}: {e}"}

        results = await asyncio.gather(*[probe("prefill", u) for u in prefill_urls], *[probe("decode", u) for u in decode_urls])
        ok = all(r["ok"] for r in results)
        return JSONResponse({"status": "ok" if ok else "degraded", "backends": list(results)}, status_code=200 if ok else 503)

    @app.get("/proxy/stats")
    async def proxy_stats() -> dict:
        return asdict(app.state.stats)

    return app
