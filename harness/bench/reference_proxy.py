"""The reference for the proxy benchmark: a P/D proxy in upstream vLLM's design.

    python -m harness.bench.reference_proxy --port P --prefill URL [URL ...] --decode URL [URL ...]

Modelled on vLLM's ``tests/v1/kv_connector/nixl_integration/toy_proxy_server.py``
(written here, not copied): FastAPI + httpx, one ``AsyncClient`` per backend
(unbounded pool, no timeout), round robin, the prefill hop first (max_tokens=1,
no streaming, ``kv_transfer_params`` asking for a remote decode, body read in
full), then the decode hop with P's ``kv_transfer_params``, always relayed as a
``StreamingResponse`` whether the client streams or not, and uvicorn started
with its defaults (so with its access log, as upstream runs it). No error
mapping beyond what upstream has. It exists only so that the harness's proxy
can be measured against it; it is not used by the harness.
"""

from __future__ import annotations

import argparse
import itertools
import os
import uuid
from contextlib import asynccontextmanager

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from harness.core.argtypes import HarnessArgumentParser

REMOTE_DECODE = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


def create_app(prefill_urls: list[str], decode_urls: list[str]) -> FastAPI:
    @asynccontextmanager
    async def lifespan(app: FastAPI):
        def client(url: str) -> httpx.AsyncClient:
            limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
            return httpx.AsyncClient(base_url=f"{url.rstrip('/')}/v1", timeout=None, limits=limits)

        app.state.prefill = [client(u) for u in prefill_urls]
        app.state.decode = [client(u) for u in decode_urls]
        app.state.p_next = itertools.cycle(range(len(prefill_urls)))
        app.state.d_next = itertools.cycle(range(len(decode_urls)))
        yield
        for c in app.state.prefill + app.state.decode:
            await c.aclose()

    app = FastAPI(lifespan=lifespan)

    def headers(request_id: str) -> dict:
        return {"Authorization": f"Bearer {os.environ.get('OPENAI_API_KEY')}", "X-Request-Id": request_id}

    async def prefill(client: httpx.AsyncClient, endpoint: str, data: dict, request_id: str) -> dict:
        p = dict(data)
        p.update(kv_transfer_params=dict(REMOTE_DECODE), stream=False, max_tokens=1)
        if "max_completion_tokens" in p:
            p["max_completion_tokens"] = 1
        for key in ("stream_options", "min_tokens", "min_completion_tokens"):
            p.pop(key, None)
        resp = await client.post(endpoint, json=p, headers=headers(request_id))
        resp.raise_for_status()
        await resp.aread()
        return resp.json()

    async def relay(client: httpx.AsyncClient, endpoint: str, data: dict, request_id: str):
        async with client.stream("POST", endpoint, json=data, headers=headers(request_id)) as resp:
            resp.raise_for_status()
            async for chunk in resp.aiter_bytes():
                yield chunk

    async def handle(endpoint: str, request: Request):
        data = await request.json()
        request_id = str(uuid.uuid4())
        p_client = app.state.prefill[next(app.state.p_next)]
        kv = (await prefill(p_client, endpoint, data, request_id)).get("kv_transfer_params", {})
        if kv:
            data["kv_transfer_params"] = kv
        d_client = app.state.decode[next(app.state.d_next)]
        return StreamingResponse(relay(d_client, endpoint, data, request_id), media_type="application/json")

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await handle("/completions", request)

    @app.post("/v1/chat/completions")
    async def chat(request: Request):
        return await handle("/chat/completions", request)

    @app.get("/healthcheck")
    async def healthcheck():
        return {"status": "ok", "prefill_instances": len(prefill_urls), "decode_instances": len(decode_urls)}

    return app


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    ap = HarnessArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--prefill", nargs="+", required=True, metavar="URL")
    ap.add_argument("--decode", nargs="+", required=True, metavar="URL")
    a = ap.parse_args(argv)
    uvicorn.run(create_app(a.prefill, a.decode), host=a.host, port=a.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
