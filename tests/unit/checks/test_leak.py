"""The leak check: P and D idle again after a run, read from /metrics of stand-in servers over HTTP."""

import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import requests

from harness.checks.leak import check_no_leak, state_of, wait_idle
from harness.serve.ports import PortAllocator
from harness.serve.prometheus import parse_metrics


def metrics(running=0, waiting=0, usage=0.0, expired=0, usage_name="vllm:kv_cache_usage_perc") -> str:
    return (f'vllm:num_requests_running{{engine="0"}} {running}\nvllm:num_requests_waiting{{engine="0"}} {waiting}\n'
            f'{usage_name}{{engine="0"}} {usage}\nvllm:nixl_num_kv_expired_reqs_total{{engine="0"}} {expired}\n')


class StandIn:
    """A /metrics endpoint whose text the test sets; ``settle_after`` reads later it turns idle."""

    def __init__(self, text: str, settle_after: int | None = None):
        self.text, self.settle_after, self.reads = text, settle_after, 0

    def body(self) -> str:
        self.reads += 1
        if self.settle_after is not None and self.reads > self.settle_after:
            return metrics()
        return self.text


@pytest.fixture
def serve():
    servers = []

    def start(stand_in: StandIn) -> str:
        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                data = stand_in.body().encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass

        alloc = PortAllocator()
        port = alloc.port()
        httpd = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        servers.append((httpd, alloc))
        return f"http://127.0.0.1:{port}/metrics"

    yield start
    for httpd, alloc in servers:
        httpd.shutdown()
        httpd.server_close()
        alloc.close()


def reader(urls: dict[str, str]):
    return lambda: {name: parse_metrics(requests.get(u, timeout=5).text) for name, u in urls.items()}


def test_a_server_whose_gauge_stays_up_fails_the_check(serve):
    urls = {"prefill": serve(StandIn(metrics())), "decode": serve(StandIn(metrics(running=1, usage=0.25)))}
    states, waited = wait_idle(reader(urls), {"prefill": 0.0, "decode": 0.0}, deadline_s=1.0, poll_s=0.1)
    c = check_no_leak(states, {"prefill": 0.0, "decode": 0.0}, waited, 1.0)
    assert not c.passed
    assert "decode still runs 1 request(s)" in c.detail and "decode KV usage 25.00%" in c.detail and "prefill" not in c.detail
    assert waited >= 1.0


def test_servers_that_settle_within_the_deadline_pass(serve):
    urls = {"prefill": serve(StandIn(metrics(waiting=2, usage=0.5), settle_after=2)), "decode": serve(StandIn(metrics()))}
    states, waited = wait_idle(reader(urls), {"prefill": 0.0, "decode": 0.0}, deadline_s=10.0, poll_s=0.05)
    c = check_no_leak(states, {"prefill": 0.0, "decode": 0.0}, waited, 10.0)
    assert c.passed, c.detail
    assert waited < 10.0


def test_usage_is_judged_against_the_idle_value_and_the_old_gauge_name_counts():
    s = state_of(parse_metrics(metrics(usage=0.1, usage_name="vllm:gpu_cache_usage_perc")))
    assert s.kv_usage == 0.1
    assert check_no_leak({"decode": s}, {"decode": 0.1}, 0.0, 5.0).passed
    assert not check_no_leak({"decode": s}, {"decode": 0.0}, 0.0, 5.0).passed


def test_an_expired_lease_or_no_gauges_at_all_fail():
    expired = state_of(parse_metrics(metrics(expired=1)))
    assert "lease expired" in check_no_leak({"prefill": expired}, {}, 0.0, 5.0).detail
    blind = state_of(parse_metrics("vllm:something_else 1\n"))
    c = check_no_leak({"decode": blind}, {}, 0.0, 5.0)
    assert not c.passed and "exports none of" in c.detail
