import shutil
import subprocess
import sys

import pytest

from harness.core.errors import ConfigError
from harness.hosts import faults
from harness.hosts.faults import (
    GO,
    HELD,
    LinkCutter,
    NetFaultError,
    block_ports,
    bring_up,
    cut,
    dropped_packets,
    links,
    unblock_ports,
)
from harness.hosts.netns import NamespaceLab, namespace_problem
from harness.hosts.placement import LOCAL, Host, RunHosts
from harness.run.config import E2EConfig
from harness.serve.ports import PortAllocator

A, B = Host("a", "10.213.0.2", "pdh-t-a"), Host("b", "10.213.0.3", "pdh-t-b")

# How a TCP connection from one host to another ends: "timed out" (dropped), "refused" (nothing listens), else the
# error's name (e.g. the network is unreachable with the links down).
CONNECT = (
    "import socket, sys\n"
    "try: socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1)\n"
    "except TimeoutError: print('timed out')\n"
    "except ConnectionRefusedError: print('refused')\n"
    "except OSError as e: print(type(e).__name__)"
)


def connect_from(host: Host, address: str, port: int) -> str:
    run = subprocess.run(host.wrap([sys.executable, "-c", CONNECT, address, str(port)]), capture_output=True, text=True)
    return run.stdout.strip()


def test_links_are_cut_only_on_namespace_hosts():
    with pytest.raises(NetFaultError, match="not a network namespace"):
        links(LOCAL)


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(net_fault="p-link-down"), "P must be on a namespace host"),
        (dict(net_fault="p-link-down", hosts=RunHosts(prefill=A, decode=A)), "P must be on a namespace host"),
        (dict(net_fault="unplug", hosts=RunHosts(prefill=A, decode=B)), "must be one of none, p-link-down, "),
        (
            dict(net_fault="p-link-down", proxy_fault="corrupt-block-ids", hosts=RunHosts(prefill=A, decode=B)),
            "give one",
        ),
    ],
)
def test_a_net_fault_needs_p_on_a_namespace_host_of_its_own(settings, words):
    with pytest.raises(ConfigError, match=words):  # refused when built: no such config exists
        E2EConfig(**settings)
    E2EConfig(net_fault="p-link-down", hosts=RunHosts(prefill=A, decode=B))


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
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc, NamespaceLab(["a", "b"]) as lab:
        a, b = lab.hosts["a"], lab.hosts["b"]
        first = alloc.block(2).base
        assert connect_from(b, a.address, first) == "refused"
        rule = block_ports(a, first, 2)
        assert rule == f"-A INPUT -p tcp -m tcp --dport {first}:{first + 1} -j DROP"
        assert dropped_packets(a, first, 2) == 0
        for port in (first, first + 1):
            assert connect_from(b, a.address, port) == "timed out"  # dropped, not refused: the host is there
        assert dropped_packets(a, first, 2) >= 2


class FakeIp:
    """``run_ip`` for ``ip -n NS ...`` and ``ip netns exec NS iptables ...``: links and an INPUT chain held in
    memory; ``stuck`` links ignore "up"; ``fail_on`` makes the command whose argv contains it fail."""

    def __init__(self, names=("pa1", "pa2"), stuck=(), fail_on=None, delete_does_nothing=False):
        self.up = dict.fromkeys(names, True)
        self.stuck, self.fail_on, self.delete_does_nothing = set(stuck), fail_on, delete_does_nothing
        self.rules: list[str] = []
        self.calls: list[list[str]] = []

    def __call__(self, argv, capture_output=True, text=True):
        self.calls.append(list(argv))
        if self.fail_on is not None and self.fail_on in argv:
            return subprocess.CompletedProcess(argv, 1, "", f"RTNETLINK answers: {self.fail_on} refused")
        if argv[:2] == ["ip", "-n"] and argv[3:] == ["-o", "link", "show"]:
            lines = ["1: lo: <LOOPBACK,UP,LOWER_UP> mtu 65536"] + [
                f"{i + 2}: {n}@if{i + 9}: <BROADCAST,MULTICAST{',UP,LOWER_UP' if up else ''}> mtu 1500"
                for i, (n, up) in enumerate(self.up.items())
            ]
            return subprocess.CompletedProcess(argv, 0, "\n".join(lines) + "\n", "")
        if argv[:2] == ["ip", "-n"] and argv[3:5] == ["link", "set"]:
            name, state = argv[5], argv[6]
            if not (state == "up" and name in self.stuck):
                self.up[name] = state == "up"
            return subprocess.CompletedProcess(argv, 0, "", "")
        return self._iptables(argv, argv[argv.index("iptables") + 1 :])

    def _iptables(self, argv, args):
        rule = "-A INPUT -p tcp -m tcp --dport {} -j DROP"
        if args[0] == "-A":
            self.rules.append(rule.format(args[args.index("--dport") + 1]))
        elif args[0] == "-D":
            mine = rule.format(args[args.index("--dport") + 1])
            if mine not in self.rules:
                return subprocess.CompletedProcess(argv, 1, "", "iptables: Bad rule (does a matching rule exist?).")
            if not self.delete_does_nothing:
                self.rules.remove(mine)
        elif args[0] == "-S":
            return subprocess.CompletedProcess(argv, 0, "\n".join(["-P INPUT ACCEPT", *self.rules]) + "\n", "")
        return subprocess.CompletedProcess(argv, 0, "", "")


@pytest.fixture
def fake_ip(monkeypatch):
    def make(**kw) -> FakeIp:
        fake = FakeIp(**kw)
        monkeypatch.setattr(faults, "run_ip", lambda argv, error: fake(argv))
        monkeypatch.setattr(faults.shutil, "which", lambda name: f"/usr/sbin/{name}")
        return fake

    return make


def test_the_cutter_brings_back_up_exactly_the_links_it_cut_and_records_the_read_back(fake_ip, tmp_path):
    ip = fake_ip()
    cutter = LinkCutter(A, tmp_path / "faults", timeout_s=30)
    assert cutter.restore() == {}  # nothing cut yet: nothing to undo, no command run
    assert not any(c[3:5] == ["link", "set"] for c in ip.calls)
    cutter.start()
    (tmp_path / "faults" / f"req-3{HELD}").touch()
    cutter._thread.join(10)  # type: ignore[union-attr]
    cutter.stop()
    assert ip.up == {"pa1": False, "pa2": False} and cutter.fired["links_down"] == ["pa1", "pa2"]
    undone = cutter.restore()
    assert undone == {"restored": ["pa1", "pa2"], "restored_read_back": {"pa1": True, "pa2": True}}
    assert {k: cutter.fired[k] for k in undone} == undone  # recorded for the report too
    ups = [c for c in ip.calls if c[-1] == "up"]
    assert ups == [["ip", "-n", "pdh-t-a", "link", "set", n, "up"] for n in ("pa1", "pa2")]


def test_a_cut_that_failed_halfway_is_still_undone(fake_ip, tmp_path):
    ip = fake_ip()
    ip.fail_on = "pa2"  # pa1 goes down, then taking pa2 down fails
    cutter = LinkCutter(A, tmp_path / "faults", timeout_s=30)
    cutter.start()
    (tmp_path / "faults" / f"req-3{HELD}").touch()
    cutter._thread.join(10)  # type: ignore[union-attr]
    cutter.stop()
    assert cutter.error and "pa2" in cutter.error and ip.up["pa1"] is False
    ip.fail_on = None
    assert cutter.restore()["restored"] == ["pa1"] and ip.up == {"pa1": True, "pa2": True}


def test_restoring_while_the_cutter_may_still_cut_is_refused(fake_ip, tmp_path):
    fake_ip()
    cutter = LinkCutter(A, tmp_path / "faults", timeout_s=30)
    cutter.start()
    try:
        with pytest.raises(NetFaultError, match="stop it before"):
            cutter.restore()
    finally:
        cutter.stop()


def test_a_link_that_does_not_come_back_up_fails_the_undo(fake_ip):
    ip = fake_ip(stuck=["pa2"])
    assert cut(A) == ["pa1", "pa2"]
    with pytest.raises(NetFaultError, match=r"still down after bringing them up: \['pa2'\]"):
        bring_up(A, ["pa1", "pa2"])
    ip.fail_on = "up"
    with pytest.raises(NetFaultError, match="link set pa1 up: RTNETLINK"):
        bring_up(A, ["pa1"])


@pytest.mark.parametrize("count, ports", [(1, "40000"), (2, "40000:40001")])
def test_unblocking_deletes_the_very_rule_block_ports_added_and_reads_it_back_gone(fake_ip, count, ports):
    ip = fake_ip()
    other = "-A INPUT -p tcp -m tcp --dport 400001 -j DROP"  # someone else's rule on a port that starts alike
    ip.rules.append(other)
    assert block_ports(A, 40000, count) == f"-A INPUT -p tcp -m tcp --dport {ports} -j DROP"
    after = unblock_ports(A, 40000, count)
    added = next(c for c in ip.calls if "-A" in c)
    deleted = next(c for c in ip.calls if "-D" in c)
    assert deleted[deleted.index("-D") + 1 :] == added[added.index("-A") + 1 :]  # the same spec, -D for -A
    assert ip.rules == [other] and after == ["-P INPUT ACCEPT", other]


def test_a_rule_still_there_after_the_delete_or_no_rule_to_delete_fails_the_undo(fake_ip):
    fake_ip(delete_does_nothing=True)
    block_ports(A, 40000, 2)
    with pytest.raises(NetFaultError, match="still in a's INPUT chain"):
        unblock_ports(A, 40000, 2)
    fake_ip()
    with pytest.raises(NetFaultError, match="Bad rule"):
        unblock_ports(A, 40000, 2)  # never added
    with pytest.raises(NetFaultError, match="not a network namespace"):
        unblock_ports(LOCAL, 40000, 2)


@pytest.mark.skipif(NO_LAB is not None, reason=f"cannot make network namespaces here: {NO_LAB}")
@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed (Debian: iptables)")
def test_undone_faults_let_the_host_answer_again(tmp_path):
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc, NamespaceLab(["a", "b"]) as lab:
        a, b = lab.hosts["a"], lab.hosts["b"]
        port = alloc.port()

        def probe() -> str:
            return connect_from(b, a.address, port)

        rule = block_ports(a, port, 1)
        assert probe() == "timed out"
        assert rule not in unblock_ports(a, port, 1)
        assert probe() == "refused"  # the host answers again: nothing listens there
        cutter = LinkCutter(a, tmp_path / "faults", timeout_s=30)
        cutter.start()
        (tmp_path / "faults" / f"req-1{HELD}").touch()
        cutter._thread.join(10)  # type: ignore[union-attr]
        cutter.stop()
        assert probe() != "refused"
        read_back = cutter.restore()["restored_read_back"]
        assert isinstance(read_back, dict) and all(read_back.values()) and all(links(a).values())
        assert probe() == "refused"
