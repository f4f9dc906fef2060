import shutil
import subprocess
import sys

import pytest

from harness.core.errors import ConfigError
from harness.hosts.faults import GO, HELD, LinkCutter, NetFaultError, block_ports, cut, dropped_packets, links
from harness.hosts.netns import NamespaceLab, namespace_problem
from harness.hosts.placement import LOCAL, Host, RunHosts
from harness.run.config import E2EConfig
from harness.serve.ports import PortAllocator

A, B = Host("a", "10.213.0.2", "pdh-t-a"), Host("b", "10.213.0.3", "pdh-t-b")


def test_links_are_cut_only_on_namespace_hosts():
    with pytest.raises(NetFaultError, match="not a network namespace"):
        links(LOCAL)


@pytest.mark.parametrize(
    "cfg, words",
    [
        (E2EConfig(net_fault="p-link-down"), "P must be on a namespace host"),
        (E2EConfig(net_fault="p-link-down", hosts=RunHosts(prefill=A, decode=A)), "P must be on a namespace host"),
        (E2EConfig(net_fault="unplug", hosts=RunHosts(prefill=A, decode=B)), "must be one of none, p-link-down, "),
        (
            E2EConfig(net_fault="p-link-down", proxy_fault="corrupt-block-ids", hosts=RunHosts(prefill=A, decode=B)),
            "give one",
        ),
    ],
)
def test_a_net_fault_needs_p_on_a_namespace_host_of_its_own(cfg, words):
    with pytest.raises(ConfigError, match=words):
        cfg.validate()
    E2EConfig(net_fault="p-link-down", hosts=RunHosts(prefill=A, decode=B)).validate()


NO_LAB = namespace_problem()


@pytest.mark.skipif(NO_LAB is not None, reason=f"cannot make network namespaces here: {NO_LAB}")
def test_the_cutter_cuts_when_a_request_is_held_reads_it_back_and_releases_it(tmp_path):
    with NamespaceLab(["a", "b"]) as lab:
        a = lab.hosts["a"]
        assert all(links(a).values())
        cutter = LinkCutter(a, tmp_path / "faults", timeout_s=30)
        cutter.start()
        (tmp_path / "faults" / f"req-7{HELD}").touch()
        cutter._thread.join(10)  # type: ignore[union-attr]
        assert (tmp_path / "faults" / f"req-7{GO}").exists()
        assert cutter.error is None
        assert cutter.fired["request_held"] == "req-7" and cutter.fired["links_down"] == list(links(a))
        assert not any(links(a).values())  # read back: every link of P's host is down
        assert cut(a) == list(links(a))  # cutting again is harmless


@pytest.mark.skipif(NO_LAB is not None, reason=f"cannot make network namespaces here: {NO_LAB}")
@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed (Debian: iptables)")
def test_a_blocked_port_drops_connections_and_counts_them(tmp_path):
    code = (
        "import socket, sys\n"
        "try: socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)\n"
        "except TimeoutError: print('timed out')\n"
        "except ConnectionRefusedError: print('refused')"
    )
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc, NamespaceLab(["a", "b"]) as lab:
        a, b = lab.hosts["a"], lab.hosts["b"]
        first = alloc.block(2).base
        probe = [sys.executable, "-c", code, a.address]
        assert subprocess.run(b.wrap([*probe, str(first)]), capture_output=True, text=True).stdout.strip() == "refused"
        rule = block_ports(a, first, 2)
        assert rule == f"-A INPUT -p tcp -m tcp --dport {first}:{first + 1} -j DROP"
        assert dropped_packets(a, first, 2) == 0
        for port in (first, first + 1):
            out = subprocess.run(b.wrap([*probe, str(port)]), capture_output=True, text=True).stdout.strip()
            assert out == "timed out"  # dropped, not refused: the host is there, the port is not
        assert dropped_packets(a, first, 2) >= 2
