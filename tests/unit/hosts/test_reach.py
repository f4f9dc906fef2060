import socket
import subprocess
import sys

import pytest

from harness.hosts.netns import NamespaceLab, namespace_problem
from harness.hosts.placement import Host
from harness.hosts.reach import HostUnreachable, check_reachable, probe
from harness.serve.ports import PortAllocator


def test_a_listening_or_refusing_host_answers(tmp_path):
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        closed = alloc.port()
        assert probe("127.0.0.1", closed) is None  # refused: the host answered
        with socket.socket() as srv:
            srv.bind(("127.0.0.1", 0))
            srv.listen()
            assert probe("127.0.0.1", srv.getsockname()[1]) is None
        assert check_reachable([Host("local"), Host("local")], closed) == ["local"]  # each host once


NO_LAB = namespace_problem()


@pytest.mark.skipif(NO_LAB is not None, reason=f"cannot make network namespaces here: {NO_LAB}")
def test_a_host_cut_off_is_named_unreachable_from_another_host(tmp_path):
    code = (
        "import sys; from harness.hosts.reach import check_reachable, HostUnreachable; "
        "from harness.hosts.placement import Host\n"
        "try: check_reachable([Host('b', sys.argv[1]), Host('c', sys.argv[2])], int(sys.argv[3]), timeout_s=1)\n"
        "except HostUnreachable as e: print(e)"
    )
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc, NamespaceLab(["a", "b", "c"]) as lab:
        h = lab.hosts
        port = str(alloc.port())
        lab.link("c", up=False)
        assert not lab.link_is_up("c")  # the fault is in place before the probe
        out = subprocess.run(
            h["a"].wrap([sys.executable, "-c", code, h["b"].address, h["c"].address, port]),
            capture_output=True,
            text=True,
        )
    assert out.stdout.strip() == f"host c ({h['c'].address}) is unreachable from the harness: no answer within 1 s", (
        out.stderr
    )
    assert issubclass(HostUnreachable, RuntimeError)
