"""A client that goes away: the real proxy process closes the connection of the hop in flight (so vLLM aborts
the request) and counts the cancellation by stage; a fault applied to every n-th request names those requests."""

import concurrent.futures
import contextlib
import json
import socket
import sys
import time

import requests

from harness.run.launch import make_proxy
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
from tests.unit.proxy.fakes import KV, Slow, chunked, http


@contextlib.contextmanager
def proxy(b, tmp_path, fault="none", fault_every=1):
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        proc, url = make_proxy(
            sys.executable, alloc, [b.url("p1")], [b.url("d1")], tmp_path, 30, fault=fault, fault_every=fault_every
        )
        start_all([proc], stack, 60)
        yield url


def send_and_close(url: str, body: dict, request_id: str, wait_s: float) -> None:
    """Send a request on a raw socket, wait, and close without reading the answer."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    payload = json.dumps(body).encode()
    with socket.create_connection((host, int(port))) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"X-Request-Id: %s\r\nContent-Length: %d\r\n\r\n" % (request_id.encode(), len(payload)) + payload
        )
        time.sleep(wait_s)


def stats(url: str) -> dict:
    return requests.get(f"{url}/proxy/stats", timeout=5).json()


def wait_for(pred, timeout_s: float = 10.0):
    deadline = time.monotonic() + timeout_s
    while not pred():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.05)


def test_a_client_gone_during_prefill_cancels_the_prefill_hop(b, tmp_path):
    b.override["p1"] = lambda body: Slow(2.0, http(200, {"choices": [{"text": "x"}], "kv_transfer_params": KV}))
    with proxy(b, tmp_path) as url:
        send_and_close(url, {"model": "m", "prompt": "hi", "max_tokens": 4}, "gone-p", 0.5)
        wait_for(lambda: stats(url)["cancelled"]["prefill"] == 1)
        s = stats(url)
        assert s["cancelled_ids"]["prefill"] == ["gone-p"]
        assert s["completed"] == 0 and not any(call[0] == b.url("d1") for call in b.calls), (
            "no decode hop after a cancelled prefill"
        )
        wait_for(lambda: "p1" in b.cut_before_answer)  # P saw its connection closed before it answered


def test_a_client_gone_mid_stream_cancels_the_decode_hop(b, tmp_path):
    first = b'data: {"choices":[{"text":"a"}]}\n\n'
    b.override["d1"] = lambda body: chunked([first], end=False)  # a stream that never ends by itself
    with proxy(b, tmp_path) as url:
        with requests.post(
            f"{url}/v1/completions",
            json={"model": "m", "prompt": "hi", "stream": True},
            headers={"X-Request-Id": "gone-d"},
            stream=True,
            timeout=10,
        ) as r:
            assert next(r.iter_content(chunk_size=None)).startswith(b"data:")
        wait_for(lambda: stats(url)["cancelled"]["decode"] == 1)
        assert stats(url)["cancelled_ids"]["decode"] == ["gone-d"]


def test_a_client_that_stays_is_never_counted_as_cancelled(b, tmp_path):
    with proxy(b, tmp_path) as url:
        for _i in range(3):
            assert (
                requests.post(f"{url}/v1/completions", json={"model": "m", "prompt": "hi"}, timeout=10).status_code
                == 200
            )
        s = stats(url)
        assert s["completed"] == 3 and sum(s["cancelled"].values()) == 0
        assert len(s["prefill_hop_ms"]) == 3


def test_a_fault_every_n_requests_names_exactly_those(b, tmp_path):
    with proxy(b, tmp_path, fault="corrupt-block-ids", fault_every=3) as url:
        for i in range(7):
            requests.post(
                f"{url}/v1/completions",
                json={"model": "m", "prompt": "hi"},
                headers={"X-Request-Id": f"r{i}"},
                timeout=10,
            )
        assert stats(url)["faulted_ids"] == ["r2", "r5"]
    shifted = [call[1]["kv_transfer_params"]["remote_block_ids"] for call in b.calls if call[0] == b.url("d1")]
    assert shifted == [[[1, 2]], [[1, 2]], [[2, 3]], [[1, 2]], [[1, 2]], [[2, 3]], [[1, 2]]]


def test_a_held_request_waits_between_hops_until_released(b, tmp_path):
    """The hook a network fault uses: the third request stops after P's answer, marked held, until released."""
    hold = tmp_path / "faults"
    hold.mkdir()
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        proc, url = make_proxy(
            sys.executable,
            alloc,
            [b.url("p1")],
            [b.url("d1")],
            tmp_path,
            30,
            fault="hold-between-hops",
            fault_every=3,
            hold_dir=hold,
        )
        start_all([proc], stack, 60)
        for i in range(2):
            requests.post(
                f"{url}/v1/completions",
                json={"model": "m", "prompt": "hi"},
                headers={"X-Request-Id": f"r{i}"},
                timeout=10,
            )
        assert list(hold.iterdir()) == []  # only every third request is held
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            third = pool.submit(
                requests.post,
                f"{url}/v1/completions",
                json={"model": "m", "prompt": "hi"},
                headers={"X-Request-Id": "r2"},
                timeout=30,
            )
            wait_for(lambda: (hold / "r2.held").exists())
            d_calls = [c for c in b.calls if c[0] == b.url("d1")]
            assert len(d_calls) == 2 and not third.done()  # P answered; D not asked yet
            (hold / "r2.go").touch()
            assert third.result().status_code == 200
        assert len([c for c in b.calls if c[0] == b.url("d1")]) == 3
        assert stats(url)["faulted_ids"] == ["r2"]
