"""The progress reporter: phase lines always, status lines throttled without a terminal and redrawn in place on
one, spans that become a run's timeline, and nothing of it on stdout."""

import io
import json
import subprocess
import sys
from pathlib import Path

from harness.core import progress
from harness.core.progress import Progress, eta_s, last_line

REPO = Path(__file__).resolve().parents[3]


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def reporter(tty=False, **kw):
    out, clock = io.StringIO(), Clock()
    return Progress(out, tty=tty, clock=clock, ticker=False, width=60, **kw), out, clock


def test_without_a_terminal_phase_changes_are_lines_and_a_status_comes_at_most_every_10_s():
    p, out, clock = reporter()
    p.phase("baseline phase")
    p.status("baseline starting, 0 s")
    clock.t += 4
    p.status("baseline starting, 4 s")
    p.tick()
    assert out.getvalue().splitlines() == ["[00:00] baseline phase"]  # a status right after a line waits its turn
    clock.t += 6
    p.tick()
    clock.t += 3
    p.tick()
    assert out.getvalue().splitlines()[1:] == ["[00:10]   baseline starting, 4 s"]
    clock.t += 7
    p.phase("baseline ready after 20 s")  # a phase change is never held back
    assert out.getvalue().splitlines()[-1] == "[00:20] baseline ready after 20 s"
    assert "\r" not in out.getvalue() and "\x1b" not in out.getvalue()


def test_a_callable_status_is_read_again_at_every_line_so_a_blocked_caller_still_shows_time_passing():
    p, out, clock = reporter()
    p.status(lambda: f"prompt 3/20 sent, waiting {clock.t - 100:.0f} s")
    for _ in range(3):
        clock.t += 10
        p.tick()  # what the ticker thread does while the caller waits on a request
    assert [line.split("   ")[1] for line in out.getvalue().splitlines()] == [
        "prompt 3/20 sent, waiting 0 s",
        "prompt 3/20 sent, waiting 10 s",
        "prompt 3/20 sent, waiting 20 s",
        "prompt 3/20 sent, waiting 30 s",
    ]


def test_on_a_terminal_the_status_is_redrawn_in_place_and_cleared_before_a_phase_line():
    p, out, clock = reporter(tty=True)
    p.status("decode starting, 1 s: " + "x" * 100)
    clock.t += 1
    p.status("decode starting, 2 s: loading weights")
    p.phase("decode ready after 2 s")
    text = out.getvalue()
    draws = text.split("\r\x1b[K")
    assert draws[1].startswith("[00:00]   decode starting, 1 s") and len(draws[1]) <= 60  # cut to the terminal's width
    assert draws[2] == "[00:01]   decode starting, 2 s: loading weights"
    assert draws[3] == "[00:01] decode ready after 2 s\n" and len(draws) == 4  # erased, then the line
    assert text.count("\n") == 1


def test_the_ticker_thread_keeps_the_status_coming_while_the_caller_blocks():
    import threading
    import time

    out = io.StringIO()
    p = Progress(out, tty=False, every_s=0.0)
    old = progress.use(p)
    try:
        seen = threading.Event()

        def status() -> str:
            seen.set()
            return "waiting"

        p.status(status)
        out.truncate(0)
        seen.clear()
        assert seen.wait(5), "the ticker never redrew the status"
    finally:
        progress.use(old)
        time.sleep(1.2)  # the replaced reporter's ticker ends
    assert "waiting" in out.getvalue()


def test_steps_are_spans_with_offsets_and_a_failed_step_says_so():
    p, out, clock = reporter()
    origin = clock.t
    mark = p.mark()
    with p.step("baseline", "phase", announce="baseline phase"):
        clock.t += 2
        s = p.begin("baseline start-up", "launch")
        clock.t += 30
        p.end(s, True, "baseline ready after 30 s")
    try:
        with p.step("P/D", "phase"):
            clock.t += 5
            raise RuntimeError("decode died")
    except RuntimeError:
        pass
    events = p.events_since(mark, origin)
    assert events == [
        {"name": "baseline", "kind": "phase", "start_s": 0.0, "end_s": 32.0, "ok": True},
        {"name": "baseline start-up", "kind": "launch", "start_s": 2.0, "end_s": 32.0, "ok": True},
        {"name": "P/D", "kind": "phase", "start_s": 32.0, "end_s": 37.0, "ok": False},
    ]
    lines = out.getvalue().splitlines()
    assert lines[-2:] == ["[00:32] baseline: done in 32 s", "[00:37] P/D: stopped after 5 s"]
    assert p.events_since(p.mark(), origin) == []


def test_an_open_span_ends_now_and_ending_twice_changes_nothing():
    p, _, clock = reporter()
    s = p.begin("decode start-up", "launch")
    clock.t += 3
    assert p.events_since(0, 100.0)[0] == {
        "name": "decode start-up",
        "kind": "launch",
        "start_s": 0.0,
        "end_s": 3.0,
        "ok": None,
    }
    p.end(s, False)
    clock.t += 3
    p.end(s, True)
    assert (s.end, s.ok) == (103.0, False)


def test_a_silent_reporter_writes_nothing_but_keeps_spans():
    p = Progress(None)
    p.phase("x")
    p.status("y")
    with p.step("baseline", "phase"):
        pass
    assert [e["name"] for e in p.events_since(0, p.t0)] == ["baseline"]


def test_a_broken_stream_never_ends_the_run():
    class Broken(io.StringIO):
        def write(self, s):
            raise BrokenPipeError

    p = Progress(Broken(), tty=False, ticker=False)
    p.phase("x")
    p.status("y")
    assert p.stream is None


def test_log_lines_and_estimates():
    assert last_line("a\nprogress  10%\rprogress 55%|\x1b[32m####\x1b[0m|\n\n") == "progress 55%|####|"
    assert last_line("") == ""
    assert len(last_line("z" * 500, 80)) == 80
    assert eta_s([], 3) is None
    assert eta_s([100.0, 300.0, 110.0], 2) == 220.0  # the median: one slow pair does not skew it
    assert (
        progress.duration(42) == "42 s"
        and progress.duration(185) == "3 min 05 s"
        and progress.duration(3720) == "1 h 02 min"
    )


def test_json_commands_keep_stdout_clean_and_progress_goes_to_stderr():
    """What scripts parse stays JSON; a run's progress never lands there."""
    for argv in (
        ["matrix", "--list", "--json"],
        ["topology", "--kv-heads", "1", "--heads", "4", "--tp-p", "1", "--tp-d", "2", "--json"],
    ):
        got = subprocess.run(
            [sys.executable, "-m", "harness", *argv], cwd=REPO, capture_output=True, text=True, timeout=120
        )
        assert got.returncode == 0, got.stderr
        json.loads(got.stdout)
    code = (
        "import sys; from harness.core import progress; progress.use(progress.on_stderr()); "
        "r = progress.current(); r.status('status line'); r.phase('phase line'); r.clear(); print('only this')"
    )
    got = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert got.stdout == "only this\n" and "phase line" in got.stderr and "status line" in got.stderr
