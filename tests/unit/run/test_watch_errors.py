"""An exception in the watched work reaches the caller as itself (issue 23 item 12: it came out as a KeyError)."""

import pytest

from harness.run.watch import run_watched


class Quiet:
    def check(self, force=False):
        pass


class Dead:
    def check(self, force=False):
        if force:
            raise RuntimeError("decode died")


class RequestError(Exception):
    pass


def failing_work():
    raise RequestError("HTTP 500 from the proxy on prompt 3")


def test_the_works_exception_propagates_with_its_type_and_message():
    with pytest.raises(RequestError, match="HTTP 500 from the proxy on prompt 3") as e:
        run_watched(failing_work, [Quiet()], "t", poll_s=0.01)
    assert not isinstance(e.value, KeyError)
    assert any(tb.name == "failing_work" for tb in e.traceback), "the traceback reaches into the work"


def test_a_falsy_or_none_result_is_still_a_result():
    assert run_watched(lambda: None, [Quiet()], "t", poll_s=0.01) is None
    assert run_watched(lambda: 0, [], "t", poll_s=0.01) == 0


def test_a_dead_server_still_outranks_the_works_failure():
    # Requests fail because the server died: the death is what the caller must see.
    with pytest.raises(RuntimeError, match="decode died"):
        run_watched(failing_work, [Dead()], "t", poll_s=0.01)
