"""What the harness is doing now, for a person watching: on stderr, never on stdout (scripts parse stdout).

On a terminal the current status is one line redrawn in place. Elsewhere (CI, ``| tee``, a file) every phase
change is a line of its own and a status line comes at most every ``every_s`` seconds, so a log stays short.
The reporter also keeps a span (name, kind, start, end) of every step it is told about; a run turns the spans
of its own steps into the timeline of its report. Core imports nothing of the harness: higher layers call
``current()``, which is a silent reporter (spans only) until the CLI installs one on stderr with ``use()``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import statistics
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TextIO

EVERY_S = 10.0  # without a terminal: at most one status line this often
REDRAW_S = 0.25  # on a terminal: redraw the status line at most this often
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")

Text = str | Callable[[], str]  # a callable is only called when its line is actually written


@dataclass
class Span:
    name: str
    kind: str  # phase, launch, requests, evaluation, teardown, setup
    start: float  # the reporter's clock (monotonic)
    end: float | None = None
    ok: bool | None = None  # None while open


def clean(line: str, limit: int = 160) -> str:
    """One log line made fit for a status: colours and control characters gone, blanks collapsed, cut to ``limit``."""
    line = _CONTROL.sub(" ", _ANSI.sub("", line))
    line = " ".join(line.split())
    return line if len(line) <= limit else line[: limit - 1] + "…"


def last_line(text: str, limit: int = 160) -> str:
    """The last non-blank line of a log's tail (carriage returns split lines too: progress bars redraw with them)."""
    for line in reversed(re.split(r"[\r\n]+", text)):
        if line.strip():
            return clean(line, limit)
    return ""


def last_line_of(path: str | os.PathLike, limit: int = 160) -> str:
    """The last non-blank line of a file (its last 8 KiB are read), or "" when there is none yet."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 8192))
            return last_line(f.read().decode("utf-8", "replace"), limit)
    except OSError:
        return ""


def eta_s(done_s: list[float], remaining: int) -> float | None:
    """Seconds left for ``remaining`` items, from the median duration of those done (None before the first)."""
    if not done_s or remaining <= 0:
        return None if not done_s else 0.0
    return statistics.median(done_s) * remaining


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 05 s``, ``1 h 02 min``: a duration for people."""
    s = max(0, int(round(seconds)))
    if s < 60:
        return f"{s} s"
    if s < 3600:
        return f"{s // 60} min {s % 60:02d} s"
    return f"{s // 3600} h {(s % 3600) // 60:02d} min"


class Progress:
    """A progress reporter. ``stream`` None: silent, spans still kept. ``tty`` None: asks the stream.

    The status is kept and redrawn by a ticker thread, so it keeps coming while the caller blocks (a server
    that takes minutes to start, a request that hangs); ``ticker=False`` leaves that to ``tick()`` (tests)."""

    def __init__(
        self,
        stream: TextIO | None = None,
        tty: bool | None = None,
        every_s: float = EVERY_S,
        redraw_s: float = REDRAW_S,
        clock: Callable[[], float] = time.monotonic,
        width: int | None = None,
        ticker: bool = True,
    ):
        self.stream = stream
        self.tty = bool(stream is not None and (tty if tty is not None else _is_terminal(stream)))
        self.every_s = every_s
        self.redraw_s = redraw_s
        self.clock = clock
        self.width = width
        self.t0 = clock()
        self._lock = threading.RLock()
        self._spans: list[Span] = []
        self._status: Text | None = None
        self._last_line = -math.inf  # when the last line was written (throttles status lines without a terminal)
        self._last_draw = -math.inf
        self._drawn = False  # a status line is on the terminal now
        self._ticker = ticker
        self._ticking = False

    # -- lines ---------------------------------------------------------------
    def _stamp(self) -> str:
        s = int(self.clock() - self.t0)
        return f"[{s // 60:02d}:{s % 60:02d}]"

    def _write(self, text: str) -> None:
        try:
            self.stream.write(text)  # type: ignore[union-attr]
            self.stream.flush()  # type: ignore[union-attr]
        except (OSError, ValueError, AttributeError):  # a closed or broken stderr must never end a run
            self.stream = None

    def phase(self, text: str) -> None:
        """A phase change: always its own line."""
        with self._lock:
            if self.stream is None:
                return
            self._erase()
            self._write(f"{self._stamp()} {text}\n")
            self._last_line = self.clock()

    def status(self, text: Text) -> None:
        """How the current step is going (a callable is re-read at every redraw): in place on a terminal, else a
        line at most every ``every_s``. It stays until the next ``status``, ``end`` or ``clear``."""
        with self._lock:
            if self.stream is None:
                return
            self._status = text
            self._draw()
            if self._ticker and not self._ticking:
                self._ticking = True
                threading.Thread(target=self._tick_loop, name="progress", daemon=True).start()

    def tick(self) -> None:
        """Redraw the status if one is due."""
        with self._lock:
            if self.stream is not None and self._status is not None:
                self._draw()

    def _tick_loop(self) -> None:
        while self.stream is not None and _current is self:  # a replaced reporter stops ticking
            time.sleep(self.redraw_s if self.tty else 1.0)
            self.tick()
        self._ticking = False

    def _draw(self) -> None:
        now = self.clock()
        if now - (self._last_draw if self.tty else self._last_line) < (self.redraw_s if self.tty else self.every_s):
            return
        try:
            text = self._status() if callable(self._status) else str(self._status)
        except Exception as e:  # a status that cannot be read is no reason to stop a run
            text = f"(status unavailable: {type(e).__name__})"
        line = f"{self._stamp()}   {text}"
        if self.tty:
            cols = self.width or shutil.get_terminal_size((100, 20)).columns
            self._write("\r\x1b[K" + (line if len(line) < cols else line[: max(1, cols - 2)] + "…"))
            self._drawn, self._last_draw = True, now
        else:
            self._write(line + "\n")
            self._last_line = now

    def _erase(self) -> None:
        if self._drawn:
            self._write("\r\x1b[K")
            self._drawn = False
            self._last_draw = -math.inf

    def clear(self) -> None:
        """Drop the status and take its line off the terminal (before something else prints there)."""
        with self._lock:
            self._status = None
            if self.stream is not None:
                self._erase()

    # -- spans (the run's timeline) -----------------------------------------
    def begin(self, name: str, kind: str, announce: str | None = None) -> Span:
        span = Span(name, kind, self.clock())
        with self._lock:
            self._spans.append(span)
        if announce:
            self.phase(announce)
        return span

    def end(self, span: Span, ok: bool = True, announce: str | None = None) -> None:
        """Close ``span`` (once: later calls do nothing) and drop the status, which belonged to it."""
        with self._lock:
            if span.end is not None:
                return
            span.end, span.ok = self.clock(), ok
            self.clear()
        if announce:
            self.phase(announce)

    @contextlib.contextmanager
    def step(self, name: str, kind: str, announce: str | None = None, done: bool = True) -> Iterator[Span]:
        """A span around the block; ``done`` adds a line when it ends (with its duration, or that it stopped)."""
        span = self.begin(name, kind, announce)
        try:
            yield span
        except BaseException:
            self.end(span, False, f"{name}: stopped after {duration(self.clock() - span.start)}" if done else None)
            raise
        self.end(span, True, f"{name}: done in {duration(self.clock() - span.start)}" if done else None)

    def mark(self) -> int:
        with self._lock:
            return len(self._spans)

    def events_since(self, mark: int, origin: float) -> list[dict]:
        """Spans begun since ``mark``, as offsets in seconds from ``origin`` (a clock reading); an open span ends
        now."""
        now = self.clock()
        with self._lock:
            spans = list(self._spans[mark:])
        return [
            {
                "name": s.name,
                "kind": s.kind,
                "start_s": round(s.start - origin, 3),
                "end_s": round((s.end if s.end is not None else now) - origin, 3),
                "ok": s.ok if s.end is not None else None,
            }
            for s in spans
        ]


def _is_terminal(stream: TextIO) -> bool:
    try:
        return stream.isatty() and os.environ.get("TERM") != "dumb"
    except (AttributeError, ValueError):
        return False


_current = Progress()


def current() -> Progress:
    return _current


def use(p: Progress) -> Progress:
    """Make ``p`` the reporter every layer reports to; returns the one it replaces."""
    global _current
    old, _current = _current, p
    return old


def on_stderr() -> Progress:
    """The CLI's reporter: on stderr, in place when stderr is a terminal."""
    return Progress(sys.stderr)
