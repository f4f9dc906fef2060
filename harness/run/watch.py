"""Client work while the servers are watched: a dead server or a fatal log line ends the wait at once
(vLLM retries a failed handshake on every request, minutes each, so waiting out the requests is no option)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass
class _Outcome(Generic[T]):
    """What the work thread ended with: its result, or the exception it raised (a thread's exception is otherwise
    only printed by threading's excepthook, and the caller would see a missing result instead)."""

    value: T | None = None
    error: BaseException | None = None
    done: bool = False


def run_watched(work: Callable[[], T], watch: list, name: str, poll_s: float = 0.5) -> T:
    """``work()`` in a thread while each of ``watch`` (anything with ``check(force)``) is checked every ``poll_s``;
    a check that raises ends the wait with its exception. The result of ``work`` otherwise, or the exception
    ``work`` raised, as it was raised."""
    out: _Outcome[T] = _Outcome()

    def target() -> None:
        try:
            out.value = work()
        except BaseException as e:  # noqa: BLE001 - handed to the caller's thread below, never swallowed
            out.error = e
        finally:
            out.done = True

    t = threading.Thread(target=target, name=name, daemon=True)
    t.start()
    while True:
        t.join(poll_s)
        done = not t.is_alive()
        for w in watch:
            # A full last pass too: a server that died mid-run is the story, not its failed requests.
            w.check(force=done)
        if done:
            if out.error is not None:
                raise out.error  # the work's own exception, type, message and traceback intact
            assert out.done, f"{name}: the work thread ended without an outcome"
            return out.value  # type: ignore[return-value]
