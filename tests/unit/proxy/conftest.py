"""Fixtures of the proxy tests: fake backends served on real ports (tests/unit/proxy/fakes.py)."""

import asyncio
import functools
import threading

import pytest

from harness.serve.ports import PortAllocator
from tests.unit.proxy.fakes import FakeProtocol, Fakes


@pytest.fixture(scope="module")
def servers():
    fakes = Fakes()
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    with PortAllocator() as alloc:
        for name in ("p1", "p2", "d1", "d2"):
            port = alloc.port()
            fut = asyncio.run_coroutine_threadsafe(
                loop.create_server(functools.partial(FakeProtocol, fakes, name), "127.0.0.1", port), loop
            )
            fut.result(10)
            fakes.urls[name] = f"http://127.0.0.1:{port}"
        fakes.urls["dead"] = f"http://127.0.0.1:{alloc.port()}"  # reserved, nothing listens: connection refused
        yield fakes

    async def cancel_pending():  # e.g. a Slow answer still sleeping after the proxy timed out
        for t in asyncio.all_tasks():
            if t is not asyncio.current_task():
                t.cancel()

    asyncio.run_coroutine_threadsafe(cancel_pending(), loop).result(5)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


@pytest.fixture
def b(servers):
    servers.calls.clear()
    servers.override.clear()
    servers.cut_before_answer.clear()
    return servers
