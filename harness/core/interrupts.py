"""SIGINT, SIGTERM and SIGHUP end a run like Ctrl-C: every ``with`` block tears its servers down on the way out."""

from __future__ import annotations

import signal

# SIGHUP: a closed terminal or ssh session ends the run as SIGTERM does (teardown, report, exit 128 + the signal).
SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


class Interrupted(KeyboardInterrupt):
    """SIGINT, SIGTERM or SIGHUP: unwinds like Ctrl-C, so every `with` block tears its servers down."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    # The first signal stops the run; later ones are ignored so that the teardown it started can finish
    # (it is bounded: SIGTERM, a grace period, then SIGKILL).
    for s in SIGNALS:
        signal.signal(s, signal.SIG_IGN)
    raise Interrupted(signum)


def catch_interrupts() -> None:
    for s in SIGNALS:
        signal.signal(s, _interrupt)
