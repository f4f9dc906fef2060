"""Send the load phase's requests at a fixed concurrency, streamed, and cancel the planned ones as a client would.

Every request streams (``stream_options.include_usage``), so time to first token is measured and a decode
abort can close the stream after a few tokens. A prefill abort closes the connection ``prefill_abort_s``
after sending, before any answer: through the proxy that lands while P prefills (the proxy passes the
cancellation on to the hop in flight). What actually happened is recorded per request, never assumed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
from dataclasses import dataclass, field

import aiohttp

from harness.core import progress
from harness.workload.client import GenerationSettings
from harness.workload.completion import Completion, parse_completion
from harness.workload.load import LoadRequest

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # aiohttp brings async-timeout on Python 3.10
    from async_timeout import timeout


@dataclass
class LoadOutcome:
    request: LoadRequest
    status: str  # ok | aborted | failed | skipped (an abort request on a server that is only a reference)
    completion: Completion | None = None
    ttft_s: float | None = None
    latency_s: float | None = None
    tokens_before_abort: int = 0
    detail: str = ""

    def to_dict(self) -> dict:
        return {
            "id": self.request.id,
            "length": self.request.length,
            "shape": self.request.shape,
            "abort": self.request.abort,
            "status": self.status,
            "ttft_s": self.ttft_s,
            "latency_s": self.latency_s,
            "tokens_before_abort": self.tokens_before_abort,
            "detail": self.detail,
        }


@dataclass
class LoadRun:
    outcomes: list[LoadOutcome] = field(default_factory=list)
    wall_s: float = 0.0
    concurrency: int = 1

    def completions(self) -> list[Completion]:
        return [o.completion for o in self.outcomes if o.status == "ok" and o.completion is not None]

    def by_status(self, status: str) -> list[LoadOutcome]:
        return [o for o in self.outcomes if o.status == status]


def load_body(gen: GenerationSettings, model: str, req: LoadRequest, prompt: list[int]) -> dict:
    body = gen.body(model, prompt)
    body.update(max_tokens=req.max_tokens, stream=True, stream_options={"include_usage": True})
    if req.abort == "decode":
        body["ignore_eos"] = True  # the stream must outlive the few tokens after which it is cancelled
    return body


class _Stream:
    """Accumulates a streamed completion into the shape of a non-streamed answer."""

    def __init__(self):
        self.text, self.tokens, self.tops, self.finish, self.usage = [], [], [], None, None

    def feed(self, line: bytes) -> bool:
        """One SSE line; True at the end of the stream."""
        line = line.strip()
        if not line.startswith(b"data:"):
            return False
        data = line[5:].strip()
        if data == b"[DONE]":
            return True
        chunk = json.loads(data)
        if "error" in chunk:
            raise ValueError(f"error in stream: {chunk['error']}")
        self.usage = chunk.get("usage") or self.usage
        for choice in chunk.get("choices") or []:
            self.text.append(choice.get("text") or "")
            lp = choice.get("logprobs") or {}
            self.tokens += lp.get("tokens") or []
            self.tops += lp.get("top_logprobs") or []
            self.finish = choice.get("finish_reason") or self.finish
        return False

    def answer(self) -> dict:
        return {
            "choices": [
                {
                    "text": "".join(self.text),
                    "finish_reason": self.finish,
                    "logprobs": {"tokens": self.tokens, "top_logprobs": self.tops},
                }
            ],
            "usage": self.usage,
        }


async def _one(
    session: aiohttp.ClientSession,
    url: str,
    body: dict,
    req: LoadRequest,
    headers: dict,
    prefill_abort_s: float,
    timeout_s: float,
) -> LoadOutcome:
    t0 = time.monotonic()
    out = LoadOutcome(req, "failed")
    try:
        if req.abort == "prefill":
            try:
                resp = await asyncio.wait_for(session.post(url, json=body, headers=headers), prefill_abort_s)
            except asyncio.TimeoutError:
                out.status, out.detail = (
                    "aborted",
                    f"closed {1000 * prefill_abort_s:.0f} ms after sending, before any answer",
                )
                return out
            resp.close()  # the answer had already started: P was done, so this cancel lands in the decode hop
            out.status, out.detail = "aborted", "the answer had started before the planned cancel (P already done)"
            return out
        async with timeout(timeout_s), session.post(url, json=body, headers=headers) as resp:
            if resp.status != 200:
                out.detail = f"HTTP {resp.status}: {(await resp.text())[:500]}"
                return out
            stream = _Stream()
            done = False
            async for line in resp.content:  # read to the end even after [DONE]: a connection cut early is a cancel
                if done:
                    continue
                done = stream.feed(line)
                if stream.tokens and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0
                if req.abort == "decode" and len(stream.tokens) >= req.abort_after_tokens:
                    out.status, out.tokens_before_abort = "aborted", len(stream.tokens)
                    out.detail = f"closed the stream after {len(stream.tokens)} tokens"
                    resp.close()
                    return out
        if req.abort == "decode":
            out.detail = f"the stream ended after {len(stream.tokens)} tokens, before the planned cancel"
            return out
        out.completion = parse_completion(req.id, stream.answer())
        out.status = "ok"
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        out.detail = f"{type(e).__name__}: {e}"
    finally:
        out.latency_s = time.monotonic() - t0
    return out


async def _all(
    url: str,
    model: str,
    requests: list[LoadRequest],
    prompts: dict[str, list[int]],
    gen: GenerationSettings,
    concurrency: int,
    prefill_abort_s: float,
    run_tag: str,
    done: list[LoadOutcome],
) -> list[LoadOutcome]:
    sem = asyncio.Semaphore(concurrency)
    connector = aiohttp.TCPConnector(limit=concurrency + 2)
    async with aiohttp.ClientSession(connector=connector) as session:

        async def one(req: LoadRequest) -> LoadOutcome:
            async with sem:
                headers = {"X-Request-Id": f"{run_tag}{req.id}"}
                out = await _one(
                    session,
                    f"{url}/v1/completions",
                    load_body(gen, model, req, prompts[req.id]),
                    req,
                    headers,
                    prefill_abort_s,
                    gen.timeout_s,
                )
                done.append(out)  # read by the progress line
                return out

        return list(await asyncio.gather(*(one(r) for r in requests)))


def run_load(
    url: str,
    model: str,
    requests: list[LoadRequest],
    prompts: dict[str, list[int]],
    gen: GenerationSettings,
    concurrency: int,
    prefill_abort_s: float = 0.0,
    run_tag: str = "",
    with_aborts: bool = True,
) -> LoadRun:
    """Every request at ``concurrency`` in flight. ``with_aborts=False`` (a reference server): the requests planned
    as aborts are skipped, since they have no answer to compare."""
    sent = [r for r in requests if with_aborts or r.abort is None]
    t0 = time.monotonic()
    done: list[LoadOutcome] = []
    label = f"{run_tag.rstrip('-') or 'load'} load"
    rep = progress.current()
    with rep.step(label, "requests", announce=f"{label}: {len(sent)} requests at concurrency {concurrency} to {url}"):
        rep.status(
            lambda: (
                f"{label}: {len(done)}/{len(sent)} done, {sum(o.status == 'aborted' for o in done)} cancelled, "
                f"{sum(o.status == 'failed' for o in done)} failed"
            )
        )
        outcomes = asyncio.run(
            _all(url.rstrip("/"), model, sent, prompts, gen, concurrency, prefill_abort_s, run_tag, done)
        )
    by_id = {o.request.id: o for o in outcomes}
    ordered = [
        by_id.get(r.id) or LoadOutcome(r, "skipped", detail="an abort request; not sent to a reference server")
        for r in requests
    ]
    return LoadRun(ordered, time.monotonic() - t0, concurrency)
