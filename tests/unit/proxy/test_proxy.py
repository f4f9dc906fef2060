"""The proxy against fake P and D backends (tests/unit/proxy/fakes.py)."""

import json
from typing import cast

import pytest
from fastapi import FastAPI
from starlette.routing import Route

import toy_proxy_server
from harness.proxy.app import corrupt_block_ids, prefill_body, wrong_engine_id
from tests.unit.proxy.fakes import KV, Drop, Slow, chunked, client, http


def test_two_hops_rewrite_body_and_share_request_id(b):
    body = {"model": "m", "prompt": "hi", "max_tokens": 9, "stream": False, "min_tokens": 2, "stream_options": {"x": 1}}
    with client(b) as c:
        r = c.post("/v1/completions", json=body, headers={"X-Request-Id": "rid-1"})
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == f"decoded by {b.url('d1')}"
    (ph, pb, phd), (dh, db, dhd) = b.calls
    assert (ph, dh) == (b.url("p1"), b.url("d1"))
    assert pb["max_tokens"] == 1 and pb["stream"] is False and "min_tokens" not in pb and "stream_options" not in pb
    assert (
        pb["kv_transfer_params"]["do_remote_decode"] is True and pb["kv_transfer_params"]["do_remote_prefill"] is False
    )
    assert "max_completion_tokens" not in pb
    assert db == {**body, "kv_transfer_params": KV}
    assert phd["x-request-id"] == dhd["x-request-id"] == r.headers["x-request-id"] == "rid-1"


def test_generated_request_id_is_shared(b):
    with client(b) as c:
        r = c.post(
            "/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 5}
        )
    assert r.status_code == 200
    assert b.calls[0][2]["x-request-id"] == b.calls[1][2]["x-request-id"] == r.headers["x-request-id"]
    assert b.calls[0][1]["max_completion_tokens"] == 1


def test_authorization_reaches_both_hops(b):
    with client(b) as c:
        c.post("/v1/completions", json={"prompt": "hi"}, headers={"Authorization": "Bearer k"})
    assert [h.get("authorization") for _, _, h in b.calls] == ["Bearer k", "Bearer k"]


@pytest.mark.parametrize("answer", [http(200, {"choices": [{"text": "x"}]}), http(200, b"not json"), http(200, [1, 2])])
def test_missing_kv_transfer_params_fails_without_decode(b, answer):
    b.override["p1"] = lambda body: answer
    with client(b) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
        stats = c.get("/proxy/stats").json()
    assert r.status_code == 502 and "kv_transfer_params" in r.json()["error"]["message"]
    assert [h for h, _, _ in b.calls] == [b.url("p1")]
    assert stats["prefill_missing_kv_transfer_params"] == 1 and stats["completed"] == 0


def test_round_robin_over_2x2(b):
    with client(b, prefill=("p1", "p2"), decode=("d1", "d2")) as c:
        for _ in range(4):
            assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    hosts = [h for h, _, _ in b.calls]
    assert sorted(hosts[0::2]) == sorted([b.url("p1"), b.url("p1"), b.url("p2"), b.url("p2")])
    assert sorted(hosts[1::2]) == sorted([b.url("d1"), b.url("d1"), b.url("d2"), b.url("d2")])


def test_streaming_passthrough_in_order(b):
    chunks = [b'data: {"n": 1}\n\n', b'data: {"n": 2}\n\n', b"data: [DONE]\n\n"]
    b.override["d1"] = lambda body: chunked(chunks)
    with client(b) as c, c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
        data = b"".join(r.iter_bytes())
    assert r.status_code == 200 and data == b"".join(chunks)
    assert r.headers["content-type"].startswith("text/event-stream")
    assert b.calls[0][1]["stream"] is False and b.calls[1][1]["stream"] is True


@pytest.mark.parametrize(
    "path,raw",
    [
        ("/v1/completions", b"{not json"),
        ("/v1/completions", b"\xff\xfe"),
        ("/v1/completions", b"[1, 2]"),
        ("/v1/completions", b'{"model": "m"}'),
        ("/v1/chat/completions", b'{"model": "m"}'),
        ("/v1/chat/completions", b'{"model": "m", "messages": "hi"}'),
    ],
)
def test_malformed_body_is_400(b, path, raw):
    with client(b) as c:
        r = c.post(path, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert r.json()["error"]["message"]
    assert b.calls == []


def test_missing_prompt_or_messages_says_so(b):
    with client(b) as c:
        r1 = c.post("/v1/completions", json={"model": "m", "max_tokens": 3})
        r2 = c.post("/v1/chat/completions", json={"model": "m", "max_tokens": 3})
    assert r1.status_code == 400 and "'prompt'" in r1.json()["error"]["message"]
    assert r2.status_code == 400 and "'messages'" in r2.json()["error"]["message"]


def test_body_over_the_limit_is_413(b):
    big = {"prompt": "x" * 5000}
    with client(b, max_body_bytes=4096) as c:
        r = c.post("/v1/completions", json=big)
        # Without a Content-Length (chunked upload) the limit holds while reading.
        chunked_r = c.post(
            "/v1/completions", content=iter([json.dumps(big).encode()]), headers={"content-type": "application/json"}
        )
        ok = c.post("/v1/completions", json={"prompt": "x" * 100})
    assert r.status_code == 413 and "4096 bytes" in r.json()["error"]["message"]
    assert chunked_r.status_code == 413 and "limit" in chunked_r.json()["error"]["message"]
    assert ok.status_code == 200
    assert len(b.calls) == 2  # only the small request reached the backends


def test_default_body_limit_is_16_mib(b):
    from harness.proxy.app import DEFAULT_MAX_BODY_BYTES

    assert DEFAULT_MAX_BODY_BYTES == 16 * 2**20
    assert (
        toy_proxy_server.parse_args(["--port", "1", "--prefill", "http://p", "--decode", "http://d"]).max_body_mib == 16
    )


@pytest.mark.parametrize(
    "name,behaviour,status,hop",
    [
        ("dead", None, 502, "prefill"),  # connection refused
        ("d1", Drop(), 502, "decode"),  # connection dropped before an answer
        ("d1", Slow(2.0, http(200, {})), 504, "decode"),
    ],
)
def test_backend_errors_name_the_hop(b, name, behaviour, status, hop):
    if behaviour is not None:
        b.override[name] = lambda body: behaviour
    prefill = ("dead",) if name == "dead" else ("p1",)
    with client(b, prefill=prefill, timeout_s=0.5) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == status
    assert r.json()["error"]["hop"] == hop and r.json()["error"]["message"].startswith(f"{hop} hop to {b.url(name)}")
    assert r.headers["x-proxy-hop"] == hop


def test_backend_500_is_502_and_400_passes_through(b):
    b.override["d1"] = lambda body: http(500, {"error": {"message": "Internal server error"}})
    with client(b) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 502 and "HTTP 500" in r.json()["error"]["message"] and r.json()["error"]["hop"] == "decode"
    b.override["d1"] = lambda body: http(400, {"error": {"message": "max_tokens too large"}})
    with client(b) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 400 and r.headers["x-proxy-hop"] == "decode"
    assert r.json()["error"]["message"] == "max_tokens too large"


def test_stream_broken_mid_way_ends_with_error_event(b):
    b.override["d1"] = lambda body: Drop(chunked([b'data: {"n": 1}\n\n'], end=False))
    with client(b) as c:
        with c.stream("POST", "/v1/completions", json={"prompt": "hi", "stream": True}) as r:
            data = b"".join(r.iter_bytes()).decode()
        stats = c.get("/proxy/stats").json()
    assert data.startswith('data: {"n": 1}')
    assert "failed mid-stream" in data and '"hop": "decode"' in data
    assert stats["errors"]["decode"] == 1 and stats["completed"] == 0


def test_healthcheck_reports_each_backend(b):
    with client(b, decode=("d1", "d2")) as c:
        assert c.get("/healthcheck").status_code == 200
        b.override[("d2", "health")] = http(503, {})
        r = c.get("/healthcheck")
    assert r.status_code == 503
    down = [x for x in r.json()["backends"] if not x["ok"]]
    assert [(x["role"], x["url"]) for x in down] == [("decode", b.url("d2"))]
    with client(b, decode=("d1", "dead")) as c:
        r = c.get("/healthcheck")
    assert r.status_code == 503 and [x["url"] for x in r.json()["backends"] if not x["ok"]] == [b.url("dead")]


def test_stats_count_requests(b):
    with client(b) as c:
        for _ in range(3):
            c.post("/v1/completions", json={"prompt": "hi"})
        s = c.get("/proxy/stats").json()
    assert s["requests"] == 3 and s["completed"] == 3 and s["prefill_with_kv_transfer_params"] == 3
    assert s["last_kv_transfer_params"] == KV


def test_corrupt_block_ids_hook_reaches_decode(b):
    assert corrupt_block_ids({"remote_block_ids": [[1, 2], [5]]})["remote_block_ids"] == [[2, 3], [6]]
    assert corrupt_block_ids({"remote_block_ids": [4]})["remote_block_ids"] == [5]
    with client(b, kv_params_hook=corrupt_block_ids) as c:
        c.post("/v1/completions", json={"prompt": "hi"})
    assert b.calls[1][1]["kv_transfer_params"]["remote_block_ids"] == [[2, 3]]


def test_wrong_engine_id_fault_reaches_decode(b):
    with client(b, kv_params_hook=wrong_engine_id) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
    assert b.calls[1][1]["kv_transfer_params"]["remote_engine_id"] == "no-such-engine"


def test_skip_transfer_fault_decodes_without_kv_and_counts_it(b):
    """The llm-d #2535 proxy: no do_remote_decode to P, and D decodes anyway; the stats must show it."""
    with client(b, skip_transfer=True) as c:
        assert c.post("/v1/completions", json={"prompt": "hi"}).status_code == 200
        s = c.get("/proxy/stats").json()
    assert "kv_transfer_params" not in b.calls[0][1] and "kv_transfer_params" not in b.calls[1][1]
    assert s["completed"] == 1  # (this fake P answers with params anyway; a real P, not asked, does not)


def test_unexpected_error_is_json_without_traceback(b):
    def broken(params: dict) -> dict:
        raise ValueError("boom")  # not the client's fault: must not turn into a 400

    with client(b, kv_params_hook=broken) as c:
        r = c.post("/v1/completions", json={"prompt": "hi"})
    assert r.status_code == 500 and r.json()["error"]["type"] == "proxy_error"
    assert "Traceback" not in r.text and "boom" in r.json()["error"]["message"]


def test_prefill_body_does_not_mutate_client_body():
    body = {"prompt": "x", "max_tokens": 5, "kv_transfer_params": {"a": 1}, "stream_options": {"include_usage": True}}
    prefill_body(body)
    assert body == {
        "prompt": "x",
        "max_tokens": 5,
        "kv_transfer_params": {"a": 1},
        "stream_options": {"include_usage": True},
    }


def test_cli_builds_urls_both_styles():
    a = toy_proxy_server.parse_args(["--port", "1", "--prefill", "http://h:1", "--decoder-ports", "7", "8"])
    assert toy_proxy_server.backend_urls(a) == (["http://h:1"], ["http://127.0.0.1:7", "http://127.0.0.1:8"])
    assert a.host == "127.0.0.1"


@pytest.mark.parametrize(
    "argv",
    [
        ["--port", "1", "--decode", "http://d"],
        ["--port", "1", "--prefill", "http://p"],
        ["--port", "1", "--prefill", "http://p", "--decoder-hosts", "a", "b", "--decoder-ports", "1", "2", "3"],
        ["--port", "1", "--prefill", "http://p", "--decode", "http://d", "--max-body-mib", "0"],
    ],
)
def test_cli_rejects_bad_args(argv):
    with pytest.raises(SystemExit):
        toy_proxy_server.parse_args(argv)


def test_fastapi_docs_and_schema_are_off(b):
    # /docs loads assets from a CDN and nothing of the harness reads any of these (docs/proxy.md).
    with client(b) as c:
        for path in ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json"):
            assert c.get(path).status_code == 404, path
        assert c.get("/health").status_code == 200 and c.get("/proxy/stats").status_code == 200


def test_the_documented_routes_are_the_served_ones(b):
    import re

    from harness.core.paths import REPO_ROOT

    doc = (REPO_ROOT / "docs" / "proxy.md").read_text().partition("## What the proxy exposes")[2]
    documented = set(re.findall(r"^\| `(GET|POST) (/[^`]*)` \|", doc, re.MULTILINE))
    routes = cast(FastAPI, client(b).app).routes  # TestClient types its app as any ASGI app: create_app's is FastAPI
    served = {(m, r.path) for r in cast(list[Route], routes) for m in getattr(r, "methods", ()) if m != "HEAD"}
    assert documented and documented == served
