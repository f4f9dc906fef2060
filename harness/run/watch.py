"""Client work while the servers are watched: a dead server or a fatal log line ends the wait at once
(vLLM retries a failed handshake on every request, minutes each, so waiting out the requests is no option)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def run_watched(work: Callable[[], T], watch: list, name: str, poll_s: float = 0.5) -> T:
    """``work()`` in a thread while each of ``watch`` (anything with ``check(force)``) is checked every ``poll_s``;
    a check that raises ends the wait with its exception. The result of ``work`` otherwise."""
    box: dict[str, T] = {}
    t = threading.Thread(target=lambda: box.setdefault("out", work()), name=name, daemon=True)
    t.start()
    while True:
        t.join(poll_s)
        done = not t.is_alive()
        for w in watch:
            w.check(force=done)  # a full last pass too: a server that died mid-run is the story, not its failed requests
        if done:
            return box["out"]
