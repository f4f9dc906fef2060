"""SIGINT and SIGTERM end a run like Ctrl-C: every ``with`` block tears its servers down on the way out."""

from __future__ import annotations

import signal


class Interrupted(KeyboardInterrupt):
    """SIGINT or SIGTERM: unwinds like Ctrl-C, so every `with` block tears its servers down."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _interrupt(signum, frame):
    # The first signal stops the run; later ones are ignored so that the teardown it started can finish
    # (it is bounded: SIGTERM, a grace period, then SIGKILL).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise Interrupted(signum)


def catch_interrupts() -> None:
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
