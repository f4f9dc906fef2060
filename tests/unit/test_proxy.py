"""The proxy against fake backends (httpx.MockTransport): no ports, no servers."""

import json

import httpx
import pytest
from fastapi.testclient import TestClient

import toy_proxy_server
from harness.proxy import corrupt_block_ids, create_app, prefill_body

P1, P2, D1, D2 = "http://p1", "http://p2", "http://d1", "http://d2"
KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_block_ids": [[1, 2]], "remote_engine_id": "e",
      "remote_host": "127.0.0.1", "remote_port": 5600, "tp_size": 1}


class Backends:
    """Records every request; per-host behaviour can be overridden."""

    def __init__(self):
        self.calls: list[tuple[str, dict, dict]] = []
        self.override = {}

    def __call__(self, request: httpx.Request) -> httpx.Response:
        host = f"http://{request.url.host}"
        if request.url.path == "/health":
            return self.override.get((host, "health"), lambda r: httpx.Response(200))(request)
        body = json.loads(request.content)
        self.calls.append((host, body, dict(request.headers)))
        if host in self.override:
            return self.override[host](request)
        if host.startswith("http://p"):
            return httpx.Response(200, json={"choices": [{"text": "x"}], "kv_transfer_params": KV})
        return httpx.Response(200, json={"choices": [{"text": f"decoded by {host}"}]})


def client(backends, prefill=(P1,), decode=(D1,), **kw):
    app = create_app(list(prefill), list(decode), transport=httpx.MockTransport(backends), **kw)
    return TestClient(app)


def test_two_hops_rewrite_body_and_share_request_id():
    b = Backends()
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": False, "min_tokens": 2, "stream_options": {"x": 1}}
    with client(b) as c:
        r = c.post("/v1/completions", json=body, headers={"X-Request-Id": "rid-1"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == "decoded by http://d1"
    (ph, pb, phd), (dh, db, dhd) = b.calls
    assert (ph, dh) == (P1, D1)
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb and "stream_options" not in pb
    assert pb["kv_transfer_params"]["do_remote_decode"] is True and pb["kv_transfer_params"]["do_remote_prefill"] is False
    assert "max_completion_tokens" not in pb
    assert db == {**body, "kv_transfer_params": KV}
    assert phd["x-request-id"] == dhd["x-request-id"] == r.headers["x-request-id"] == "rid-1"


def test_generated_request_id_is_shared():
    b = Backends()
    with client(b) as c:
        r = c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5})
    assert r.status_code == 200
    assert b.calls[0][2]["x-request-id"] == b.calls[1][2]["x-request-id"] == r.headers["x-request-id"]
    assert b.calls[0][1]["max_completion_tokens"] == 1


def test_missing_kv_transfer_params_fails_without_decode():
    b = Backends()
    b.override[P1] = lambda r: httpx.Response(200, json={"choices": [{"text": "x"}]})
    with client(b) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        stats = c.get("/proxy/stats").json()
    assert r.status_code == 502 and "kv_transfer_params" in r.json()["error"]["message"]
    assert [h for h, _, _ in b.calls] == [P1]
    assert stats["prefill_missing_kv_transfer_params"] == 1 and stats["completed"] == 0


def test_round_robin_over_2x2():
    b = Backends()
    with client(b, prefill=(P1, P2), decode=(D1, D2)) as c:
        for _ in range(4):
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    hosts = [h for h, _, _ in b.calls]
    assert sorted(hosts[0::2]) == [P1, P1, P2, P2] and sorted(hosts[1::2]) == [D1, D1, D2, D2]


def test_streaming_passthrough_in_order():
    b = Backends()
    chunks = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
    b.override[D1] = lambda r: httpx.Response(200, headers={"content-type": "text/event-stream"}, stream=httpx.ByteStream(b"".join(chunks)))
    with client(b) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            data = b"".join(r.iter_bytes())
    assert r.status_code == 200 and data == b"".join(chunks)
    assert b.calls[0][1]["stream"] is False and b.calls[1][1]["stream"] is True


@pytest.mark.parametrize("path,raw", [
    ("/v1/completions", b"{not json"),
    ("/v1/completions", b"[1, 2]"),
    ("/v1/completions", b'{"model": "m"}'),
    ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}'),
])
def test_malformed_body_is_400(path, raw):
    b = Backends()
    with client(b) as c:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert b.calls == []


def raise_(exc):
    def f(request):
        raise exc
    return f


@pytest.mark.parametrize("host,exc,status,hop", [
    (P1, httpx.ConnectError("refused"), 502, "prefill"),
    (D1, httpx.ReadError("dropped"), 502, "decode"),
    (D1, httpx.ReadTimeout("slow"), 504, "decode"),
])
def test_backend_errors_name_the_hop(host, exc, status, hop):
    b = Backends()
    b.override[host] = raise_(exc)
    with client(b) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == status
    assert r.json()["error"]["hop"] == hop and r.json()["error"]["message"].startswith(f"{hop} hop to {host}")


def test_backend_500_is_502_and_400_passes_through():
    b = Backends()
    b.override[D1] = lambda r: httpx.Response(500, json={"error": {"message": "Internal server error"}})
    with client(b) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and "HTTP 500" in r.json()["error"]["message"] and r.json()["error"]["hop"] == "decode"
    b.override[D1] = lambda r: httpx.Response(400, json={"error": {"message": "max_tokens too large"}})
    with client(b) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.headers["x-proxy-hop"] == "decode"
    assert r.json()["error"]["message"] == "max_tokens too large"


def test_stream_broken_mid_way_ends_with_error_event():
    class Broken(httpx.AsyncByteStream):
        async def __aiter__(self):
            yield b'data: {"n": 1}\n\n'
            raise httpx.ReadError("peer closed")

    b = Backends()
    b.override[D1] = lambda r: httpx.Response(200, stream=Broken())
    with client(b) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            data = b"".join(r.iter_bytes()).decode()
    assert data.startswith('data: {"n": 1}')
    assert "failed mid-stream" in data and '"hop": "decode"' in data


def test_healthcheck_reports_each_backend():
    b = Backends()
    with client(b, decode=(D1, D2)) as c:
        assert c.get("/healthcheck").status_code == 200
        b.override[(D2, "health")] = raise_(httpx.ConnectError("refused"))
        r = c.get("/healthcheck")
    assert r.status_code == 503
    down = [x for x in r.json()["backends"] if not x["ok"]]
    assert [(x["role"], x["url"]) for x in down] == [("decode", D2)]


def test_stats_count_requests():
    b = Backends()
    with client(b) as c:
        for _ in range(3):
            c.post("/v1/completions", json={"prompt": "hi"})
        s = c.get("/proxy/stats").json()
    assert s["requests"] == 3 and s["completed"] == 3 and s["prefill_with_kv_transfer_params"] == 3
    assert s["last_kv_transfer_params"] == KV


def test_corrupt_block_ids_hook_reaches_decode():
    assert corrupt_block_ids({"remote_block_ids": [[1, 2], [5]]})["remote_block_ids"] == [[2, 3], [6]]
    assert corrupt_block_ids({"remote_block_ids": [4]})["remote_block_ids"] == [5]
    b = Backends()
    with client(b, kv_params_hook=corrupt_block_ids) as c:
        c.post("/v1/completions", json={"prompt": "hi"})
    assert b.calls[1][1]["kv_transfer_params"]["remote_block_ids"] == [[2, 3]]


def test_prefill_body_does_not_mutate_client_body():
    body = {"prompt": "x", "max_tokens": 5, "kv_transfer_params": {"a": 1}}
    prefill_body(body)
    assert body == {"prompt": "x", "max_tokens": 5, "kv_transfer_params": {"a": 1}}


def test_cli_builds_urls_both_styles():
    a = toy_proxy_server.parse_args(["--port", "1", "--prefill", "http://h:1", "--decoder-ports", "7", "8"])
    assert toy_proxy_server.backend_urls(a) == (["http://h:1"], ["http://127.0.0.1:7", "http://127.0.0.1:8"])
    assert a.host == "127.0.0.1"


@pytest.mark.parametrize("argv", [["--port", "1", "--decode", "http://d"], ["--port", "1", "--prefill", "http://p"],
                                  ["--port", "1", "--prefill", "http://p", "--decoder-hosts", "a", "b", "--decoder-ports", "1", "2", "3"]])
def test_cli_rejects_bad_backends(argv):
    with pytest.raises(SystemExit):
        toy_proxy_server.parse_args(argv)
