"""The load client against a fake streaming server: answers assembled from the stream, and cancels that really
close the connection (the server sees the client go away before it finished)."""

import asyncio
import json
import threading

import pytest
from aiohttp import web

from harness.serve.ports import PortAllocator
from harness.workload.client import GenerationSettings
from harness.workload.load import LoadRequest
from harness.workload.load_client import run_load


class FakeServer:
    def __init__(self):
        self.finished: list[str] = []  # request ids answered to the end
        self.cut: list[str] = []  # request ids whose client went away first
        self.bodies: dict[str, dict] = {}

    async def completions(self, request: web.Request) -> web.StreamResponse:
        rid = request.headers["X-Request-Id"]
        body = await request.json()
        self.bodies[rid] = body
        try:
            if "slow-start" in rid:
                await asyncio.sleep(1.0)
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            for i in range(body["max_tokens"]):
                chunk = {
                    "choices": [
                        {
                            "text": f"t{i} ",
                            "finish_reason": "length" if i == body["max_tokens"] - 1 else None,
                            "logprobs": {
                                "tokens": [f"token_id:{100 + i}"],
                                "top_logprobs": [{f"token_id:{100 + i}": -0.5}],
                            },
                        }
                    ]
                }
                await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
                await asyncio.sleep(0.02)
            await resp.write(b'data: {"choices": [], "usage": {"prompt_tokens": %d}}\n\n' % len(body["prompt"]))
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            self.finished.append(rid)
            return resp
        except (asyncio.CancelledError, ConnectionResetError):
            self.cut.append(rid)
            raise


@pytest.fixture(scope="module")
def server():
    fake = FakeServer()
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    app = web.Application()
    app.router.add_post("/v1/completions", fake.completions)
    runner = web.AppRunner(app, handler_cancellation=True)
    with PortAllocator() as alloc:
        port = alloc.port()
        asyncio.run_coroutine_threadsafe(runner.setup(), loop).result(10)
        asyncio.run_coroutine_threadsafe(web.TCPSite(runner, "127.0.0.1", port).start(), loop).result(10)
        yield fake, f"http://127.0.0.1:{port}"
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)


def wait_until(pred, timeout_s=5.0):
    import time

    end = time.monotonic() + timeout_s
    while not pred() and time.monotonic() < end:
        time.sleep(0.02)
    return pred()


def test_answers_are_assembled_from_the_stream(server):
    fake, url = server
    reqs = [LoadRequest("a", 3, "other", 4), LoadRequest("b", 5, "other", 2)]
    run = run_load(url, "m", reqs, {"a": [1, 2, 3], "b": [1, 2, 3, 4, 5]}, GenerationSettings(), 2, run_tag="x-")
    assert [o.status for o in run.outcomes] == ["ok", "ok"]
    a = run.outcomes[0].completion
    assert a is not None
    assert a.token_ids == (100, 101, 102, 103) and a.text == "t0 t1 t2 t3 " and a.prompt_tokens == 3
    assert a.top_logprobs[0] == {100: -0.5} and a.finish_reason == "length"
    first = run.outcomes[0]
    assert first.ttft_s is not None and first.latency_s is not None and first.latency_s >= first.ttft_s
    body = fake.bodies["x-a"]
    assert body["prompt"] == [1, 2, 3] and body["stream"] and body["stream_options"] == {"include_usage": True}
    assert "ignore_eos" not in body and body["temperature"] == 0.0
    assert wait_until(lambda: {"x-a", "x-b"} <= set(fake.finished)), "a normal request is read to the end, never cut"


def test_a_decode_abort_closes_the_stream_after_k_tokens(server):
    fake, url = server
    req = LoadRequest("d", 4, "other", 100, abort="decode", abort_after_tokens=3)
    run = run_load(url, "m", [req], {"d": [1, 2, 3, 4]}, GenerationSettings(), 1, run_tag="x-")
    o = run.outcomes[0]
    assert o.status == "aborted" and o.tokens_before_abort == 3 and o.completion is None
    assert fake.bodies["x-d"]["ignore_eos"] is True
    assert wait_until(lambda: "x-d" in fake.cut) and "x-d" not in fake.finished


def test_a_prefill_abort_closes_before_any_answer(server):
    fake, url = server
    req = LoadRequest("slow-start", 4, "other", 4, abort="prefill")
    run = run_load(
        url, "m", [req], {"slow-start": [1, 2, 3, 4]}, GenerationSettings(), 1, prefill_abort_s=0.1, run_tag="x-"
    )
    o = run.outcomes[0]
    assert o.status == "aborted" and "before any answer" in o.detail
    assert wait_until(lambda: "x-slow-start" in fake.cut)


def test_a_reference_server_gets_no_abort_requests(server):
    fake, url = server
    reqs = [
        LoadRequest("keep", 2, "other", 2),
        LoadRequest("drop", 2, "other", 2, abort="decode", abort_after_tokens=1),
    ]
    run = run_load(
        url, "m", reqs, {"keep": [1, 2], "drop": [1, 2]}, GenerationSettings(), 2, run_tag="ref-", with_aborts=False
    )
    assert [o.status for o in run.outcomes] == ["ok", "skipped"]
    assert "ref-drop" not in fake.bodies


def test_an_http_error_is_a_failed_request(server):
    _, url = server
    run = run_load(url + "/nope", "m", [LoadRequest("e", 2, "other", 2)], {"e": [1, 2]}, GenerationSettings(), 1)
    assert run.outcomes[0].status == "failed" and "404" in run.outcomes[0].detail
