import socket
import subprocess
import sys

import pytest

from harness.serve.ports import PortAllocator, PortExhausted, server_ports

# Small ranges these tests fill must be outside DEFAULT_RANGE (20000-32000): a real run on the machine (a server, or a
# port of its in TIME-WAIT) would otherwise take one, and "every port of the range" would not hold.


def test_blocks_are_contiguous_disjoint_and_bindable(tmp_path):
    with PortAllocator(lock_dir=tmp_path) as a:
        blocks = [a.block(4) for _ in range(10)]
        ports = [p for b in blocks for p in b.ports]
        assert len(ports) == len(set(ports)) == 40
        for p in ports:
            with socket.socket() as s:
                s.bind(("127.0.0.1", p))


def test_two_allocators_never_collide(tmp_path):
    # A narrow range forces both to contend for the same ports.
    a = PortAllocator(lock_dir=tmp_path, port_range=(32200, 32240), seed=1)
    b = PortAllocator(lock_dir=tmp_path, port_range=(32200, 32240), seed=1)
    got_a = {a.port() for _ in range(15)}
    got_b = {b.port() for _ in range(15)}
    assert not got_a & got_b
    a.close()
    b.close()


def test_other_process_holding_lock_is_respected(tmp_path):
    code = (
        "import sys,time; sys.path.insert(0, {!r})\n"
        "from harness.serve.ports import PortAllocator\n"
        "a = PortAllocator(lock_dir={!r}, port_range=(32100, 32110))\n"
        "ports = [a.port() for _ in range(10)]\n"
        "print('held', flush=True); time.sleep(30)\n"
    ).format(str(__import__("pathlib").Path(__file__).resolve().parents[3]), str(tmp_path))
    p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    try:
        assert p.stdout.readline().strip() == "held"
        with pytest.raises(PortExhausted):
            PortAllocator(lock_dir=tmp_path, port_range=(32100, 32110)).port()
    finally:
        p.kill()
        p.wait()
    # The dead process's locks are gone with it.
    assert 32100 <= PortAllocator(lock_dir=tmp_path, port_range=(32100, 32110)).port() < 32110


def test_port_in_use_is_skipped(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        busy = s.getsockname()[1]
        if not (1024 <= busy < 65535):
            pytest.skip("unexpected ephemeral port")
        a = PortAllocator(lock_dir=tmp_path, port_range=(busy, busy + 1))
        with pytest.raises(PortExhausted):
            a.port()


def test_release_and_server_ports(tmp_path):
    a = PortAllocator(lock_dir=tmp_path)
    sp = server_ports(a, tp=2)
    assert len({sp.http, sp.side_channel_base, sp.side_channel_base + 1, sp.internal_base}) == 4
    assert sp.internal_count >= 16
    held = set(a.held)
    assert sp.http in held and sp.side_channel_base + 1 in held
    a.release(sp.http)
    assert sp.http not in a.held
    a.close()
    assert not a.held
    with pytest.raises(ValueError):
        server_ports(a, tp=0)
