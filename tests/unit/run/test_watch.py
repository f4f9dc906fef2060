"""Client work under watch: its result when the servers stay fine, the watch's failure at once when one dies."""

import threading
import time

import pytest

from harness.run.watch import run_watched


class Watch:
    def __init__(self, fail_after: int | None = None):
        self.calls, self.fail_after = 0, fail_after
        self.forced: list[bool] = []

    def check(self, force=False):
        self.calls += 1
        self.forced.append(force)
        if self.fail_after is not None and self.calls > self.fail_after:
            raise RuntimeError("decode died")


def test_the_result_comes_back_after_a_last_forced_check():
    w = Watch()

    def slow_answer() -> int:
        time.sleep(0.05)
        return 42

    assert run_watched(slow_answer, [w], "t", poll_s=0.01) == 42
    assert w.forced[-1] is True


def test_a_dead_server_ends_the_wait_before_the_work_is_done():
    release, finished = threading.Event(), threading.Event()

    def work():
        release.wait(30)
        finished.set()

    with pytest.raises(RuntimeError, match="decode died"):
        run_watched(work, [Watch(fail_after=2)], "t", poll_s=0.01)
    assert not finished.is_set(), "the wait ended on the watch's failure, not when the work ended"
    release.set()
