"""The two server-set providers' liveness and /metrics paths, against small in-process HTTP servers."""

import contextlib
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from harness.serve.procs import ProcessFailed
from harness.serve.servers import (
    AttachedServers,
    Endpoint,
    MetricsUnavailable,
    decode_metrics,
    endpoints,
    served_model,
)


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
    assert (
        endpoints("prefill", ["http://a/"])[0].url == "http://a"
        and endpoints("prefill", ["http://a/"])[0].name == "prefill"
    )


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


class SlowHealth:
    """A server whose /health answers 200 after ``delay_s``; ``silent`` makes it answer nothing (it holds the request
    until closed). ``asked`` counts the /health requests it got."""

    def __init__(self, delay_s: float = 0.0):
        self.delay_s, self.silent, self.asked = delay_s, False, 0
        self.closing = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):
                pass

            def do_GET(self):
                outer.asked += 1
                if outer.closing.wait(3600 if outer.silent else outer.delay_s):
                    return  # closing: no answer
                self.send_response(200 if self.path == "/health" else 404)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self):
        self.closing.set()
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def slow():
    made: list[SlowHealth] = []

    def make(delay_s: float = 0.0) -> SlowHealth:
        made.append(SlowHealth(delay_s))
        return made[-1]

    yield make
    for s in made:
        s.close()


def test_a_server_slow_on_health_for_less_than_the_grace_is_alive(slow):
    """Each answer takes 2.2 s (the old watch gave up after two probes of 2 s): unresponsive, not dead."""
    server = slow()
    s = AttachedServers([server.url], [], probe_every_s=0.1)  # the default grace, 30 s
    s.start(contextlib.ExitStack())
    server.delay_s = 2.2
    deadline = time.monotonic() + 5.0
    while time.monotonic() < deadline:
        s.check()  # never waits for a slow answer, never fails
        time.sleep(0.1)
    s.check(force=True)  # waits for the next answer, which comes
    assert server.asked >= 3


def test_a_server_silent_for_longer_than_the_grace_is_dead_and_the_failure_says_what_was_seen(slow):
    server = slow()
    s = AttachedServers([], [server.url], probe_every_s=0.1, health_grace_s=1.0)
    s.start(contextlib.ExitStack())
    server.silent = True
    went_silent = time.monotonic()
    with pytest.raises(ProcessFailed) as e:
        while time.monotonic() < went_silent + 10:
            s.check()
            time.sleep(0.05)
    assert time.monotonic() - went_silent >= 1.0  # not before the grace
    assert e.value.name == "decode" and e.value.after_ready
    assert re.fullmatch(
        rf"{server.url} stopped answering /health: no answer to /health for \d\.\d s \(grace 1\.0 s\); "
        r"last answer at \d{4}-\d\d-\d\d \d\d:\d\d:\d\d",
        e.value.reason,
    ), e.value.reason


def test_forced_check_waits_out_the_grace_then_decides(fake):
    s = AttachedServers([], [fake.url], probe_every_s=60, health_grace_s=0.5)
    s.check(force=True)  # answers: alive
    fake.healthy = False
    t0 = time.monotonic()
    with pytest.raises(ProcessFailed) as e:
        s.check(force=True)
    assert 0.4 <= time.monotonic() - t0 < 5 and "no answer to /health for" in e.value.reason


def test_metrics_of_a_dead_server_fail_as_the_death(fake):
    s = AttachedServers([], [fake.url], health_grace_s=0.5)
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


class ExitingServers:
    """A server that closed its port and exits ``exits_after`` checks later (vLLM's API server on its way out)."""

    attached = False

    def __init__(self, url: str, exits_after: int | None):
        self.prefill: list[Endpoint] = []
        self.decode = endpoints("decode", [url])
        self.exits_after, self.checks = exits_after, 0

    def start(self, stack: contextlib.ExitStack) -> dict[str, float]:
        return {}

    def check(self, force: bool = False) -> None:
        self.checks += 1
        if self.exits_after is not None and self.checks > self.exits_after:
            raise ProcessFailed("decode", "exited while serving", 1, None, "engine died", after_ready=True)

    def logs(self) -> dict[str, str]:
        return {}

    def leftover_pids(self) -> list[int]:
        return []


def test_a_refused_metrics_read_waits_for_the_server_that_is_exiting_and_names_its_death(fake, monkeypatch):
    # the race the pipeline-parallel entry hit: P's port refused /metrics while P was still exiting
    import harness.serve.servers as servers

    fake.close()  # its port now refuses connections
    monkeypatch.setattr(servers, "EXIT_GRACE_S", 5.0)
    dying = ExitingServers(fake.url, exits_after=3)
    with pytest.raises(ProcessFailed) as e:
        servers.decode_metrics(dying)
    assert e.value.after_ready and dying.checks == 4
    monkeypatch.setattr(servers, "EXIT_GRACE_S", 0.5)
    alive = ExitingServers(fake.url, exits_after=None)  # never exits: the read's own failure, after the grace
    with pytest.raises(MetricsUnavailable):
        servers.decode_metrics(alive)
    assert alive.checks > 1
