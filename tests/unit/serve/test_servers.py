"""The two server-set providers' liveness and /metrics paths, against small in-process HTTP servers."""

import contextlib
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.serve.procs import ProcessFailed
from harness.serve.servers import AttachedServers, MetricsUnavailable, decode_metrics, endpoints, served_model


class FakeServer:
    """/health, /metrics and /v1/models; ``healthy`` and ``metrics_ok`` switch answers to 503."""

    def __init__(self):
        self.healthy, self.metrics_ok = True, True
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                body, status = b"", 404
                if self.path == "/health":
                    status = 200 if outer.healthy else 503
                elif self.path == "/metrics":
                    status, body = (200, b"vllm:nixl_xfer_time_seconds_count 3\n") if outer.metrics_ok else (503, b"")
                elif self.path == "/v1/models":
                    status, body = 200, b'{"data": [{"id": "served", "root": "/models/m"}]}'
                self.send_response(status)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def fake():
    s = FakeServer()
    yield s
    s.close()


def test_endpoint_names_are_unique_per_role():
    assert [e.name for e in endpoints("decode", ["http://a/", "http://b"])] == ["decode[0]", "decode[1]"]
    assert endpoints("prefill", ["http://a/"])[0].url == "http://a" and endpoints("prefill", ["http://a/"])[0].name == "prefill"


def test_attached_servers_ready_and_alive(fake):
    s = AttachedServers([fake.url], [fake.url], ready_timeout_s=5)
    assert s.start(contextlib.ExitStack()) == {}
    s.check(force=True)  # no raise


def test_attached_server_not_answering_is_named(fake):
    fake.healthy = False
    s = AttachedServers([fake.url], [], ready_timeout_s=0.5)
    with pytest.raises(ProcessFailed) as e:
        s.start(contextlib.ExitStack())
    assert e.value.name == "prefill" and not e.value.after_ready and "/health" in e.value.reason


def test_one_missed_probe_is_no_death_two_are(fake):
    s = AttachedServers([], [fake.url], probe_every_s=0)
    fake.healthy = False
    s.check()  # first miss: a slow answer is no death
    with pytest.raises(ProcessFailed) as e:
        s.check()
    assert e.value.name == "decode" and e.value.after_ready and "stopped answering /health" in e.value.reason


def test_forced_check_decides_at_once(fake):
    s = AttachedServers([], [fake.url], probe_every_s=60)
    fake.healthy = False
    with pytest.raises(ProcessFailed):
        s.check(force=True)


def test_metrics_of_a_dead_server_fail_as_the_death(fake):
    s = AttachedServers([], [fake.url])
    assert decode_metrics(s)[0].value == 3
    fake.metrics_ok, fake.healthy = False, False
    with pytest.raises(ProcessFailed):
        decode_metrics(s)


def test_metrics_of_a_live_server_that_fail_are_their_own_error(fake):
    s = AttachedServers([], [fake.url])
    fake.metrics_ok = False
    with pytest.raises(MetricsUnavailable) as e:
        decode_metrics(s)
    assert e.value.source == "decode" and "/metrics" in e.value.detail


def test_served_model_reads_v1_models(fake):
    assert served_model(fake.url) == ("/models/m", "served")
