"""The launcher of a server on a Ray node, without Ray: its command line, its exit status, the node side's process
(output by offset, stop) run here against a real process."""

import signal
import sys
import time

import pytest

from harness.cluster.remote import CHUNK, NodeProcess, exit_status, parse_args
from harness.serve.procs import ManagedProcess, ProcessSpec


def test_the_command_line_takes_the_server_after_the_double_dash():
    a = parse_args(["--ray", "ray://h:1", "--node-id", "n", "--env", "A", "--env", "B", "--", "python", "-m", "x"])
    assert (a.ray, a.node_id, a.env, a.argv) == ("ray://h:1", "n", ["A", "B"], ["python", "-m", "x"])
    with pytest.raises(SystemExit):
        parse_args(["--ray", "ray://h:1", "--node-id", "n", "--"])


@pytest.mark.parametrize("rc, status", [(0, 0), (1, 1), (-signal.SIGKILL, 137), (-signal.SIGTERM, 143), (None, 143)])
def test_the_servers_end_is_the_launchers_exit_status(rc, status):
    assert exit_status(rc) == status


def node_process(tmp_path, code: str) -> NodeProcess:
    node = NodeProcess(str(tmp_path))
    node.proc = ManagedProcess(ProcessSpec("srv", (sys.executable, "-c", code), tmp_path / "srv.log")).start()
    return node


def test_the_output_comes_out_by_offset_and_the_exit_code_once_all_is_read(tmp_path):
    node = node_process(tmp_path, "print('x' * 10)")
    try:
        deadline = time.monotonic() + 30
        while node.proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        data, rc = node.poll(0)
        assert data.endswith(b"x" * 10 + b"\n") and data.startswith(b"# srv: ") and rc == 0
        assert node.poll(len(data)) == (b"", 0)
    finally:
        node.proc.stop()


def test_a_full_chunk_holds_the_exit_code_back(tmp_path):
    node = node_process(tmp_path, f"import sys; sys.stdout.write('y' * {CHUNK + 10})")
    try:
        deadline = time.monotonic() + 30
        while node.proc.returncode is None and time.monotonic() < deadline:
            time.sleep(0.05)
        data, rc = node.poll(0)
        assert len(data) == CHUNK and rc is None  # more to read: not ended yet as far as the launcher knows
        rest, rc = node.poll(CHUNK)
        assert rest and rc == 0
    finally:
        node.proc.stop()


def test_stop_ends_the_servers_group_and_says_nothing_is_left(tmp_path):
    node = node_process(tmp_path, "import time; time.sleep(600)")
    rc, left = node.stop()
    assert rc == -signal.SIGTERM and left == []
