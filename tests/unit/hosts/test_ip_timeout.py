"""A hung ``ip`` or ``iptables`` ends in one line naming the command, not a harness that hangs forever: a fake ``ip``
on PATH that never answers, a tiny ``IP_TIMEOUT_S``, no real namespace."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from harness.hosts import faults, netns
from harness.hosts.faults import NetFaultError
from harness.hosts.netns import NamespaceError, NamespaceLab
from harness.hosts.placement import Host

HOST = Host("a", "10.213.0.2", "pdh-t-a")


@pytest.fixture
def hung_ip(tmp_path, monkeypatch) -> Path:
    """``ip`` and ``iptables`` that write their pid to the returned file and sleep; a 0.2 s bound."""
    bin_dir, pid_file = tmp_path / "bin", tmp_path / "pid"
    bin_dir.mkdir()
    for name in ("ip", "iptables"):
        (bin_dir / name).write_text(f"#!/bin/sh\necho $$ > {pid_file}\nexec sleep 60\n")
        (bin_dir / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(netns, "IP_TIMEOUT_S", 0.2)
    return pid_file


def killed(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True  # killed and reaped
    return False


def test_a_hung_ip_while_making_a_lab_is_one_line_naming_it(hung_ip):
    lab = NamespaceLab(["p"], tag="tmo")
    with pytest.raises(NamespaceError) as e:
        lab.__enter__()
    assert str(e.value) == "ip netns add pdh-tmo-switch: no answer within 0.2 s (killed)"
    assert killed(hung_ip) and lab._made == []


def test_a_hung_ip_while_removing_a_lab_still_tries_every_namespace(hung_ip):
    lab = NamespaceLab(["p"], tag="tmo")
    lab._made = ["pdh-tmo-switch", "pdh-tmo-p"]  # as if made
    with pytest.raises(NamespaceError) as e:
        lab.close()
    assert str(e.value).count("no answer within 0.2 s (killed)") == 2 and "ip netns del pdh-tmo-switch" in str(e.value)
    assert killed(hung_ip)


@pytest.mark.parametrize(
    "act,command",
    [
        (faults.links, "ip -n pdh-t-a -o link show"),
        (lambda h: faults.block_ports(h, 5600, 2), "ip netns exec pdh-t-a iptables -A INPUT -p tcp --dport 5600:5601"),
    ],
)
def test_a_hung_ip_or_iptables_fault_is_one_line_naming_it(hung_ip, act, command):
    with pytest.raises(NetFaultError) as e:
        act(HOST)
    assert str(e.value).startswith(command) and str(e.value).endswith(": no answer within 0.2 s (killed)")
    assert "\n" not in str(e.value) and killed(hung_ip)
