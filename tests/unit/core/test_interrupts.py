"""SIGINT, SIGTERM and SIGHUP each become one Interrupted; the signals after it are ignored so the teardown finishes."""

from __future__ import annotations

import os
import signal

import pytest

from harness.core.interrupts import SIGNALS, Interrupted, catch_interrupts


@pytest.fixture
def restored_handlers():
    saved = {s: signal.getsignal(s) for s in SIGNALS}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_each_signal_unwinds_as_an_interrupt_and_the_next_ones_are_ignored(restored_handlers, signum):
    catch_interrupts()
    assert signal.getsignal(signum) not in (signal.SIG_DFL, signal.SIG_IGN)  # else the kill below ends pytest itself
    with pytest.raises(Interrupted) as caught:
        os.kill(os.getpid(), signum)
        signal.sigtimedwait([], 0)  # a handler runs between bytecodes: give it one
    assert caught.value.signum == signum and isinstance(caught.value, KeyboardInterrupt)
    assert all(signal.getsignal(s) == signal.SIG_IGN for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP))
    os.kill(os.getpid(), signal.SIGHUP)  # ignored during the teardown: no second interrupt, no default death
