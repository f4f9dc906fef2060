"""Network namespaces that stand for hosts on one machine: each host has its own network stack and address, all
linked by one bridge that lives in a namespace of its own. Nothing is added to this machine's own stack; everything
made is removed on close, by the names this lab made (docs/multi-host.md).

Needs root and iproute2 (``ip``). ``namespace_problem()`` says why a lab cannot be made here, for an honest skip."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import shlex
import shutil
import subprocess
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from harness.hosts.placement import Host, RunHosts

# Addresses exist only inside the lab's namespaces; this range is what they are drawn from.
DEFAULT_SUBNET = "10.213.0.0/24"
NETNS_DIR = "/run/netns"
# Namespaces share one kernel, so UCX takes them for one node ("intra-node") and reads KV by CMA, which real hosts
# cannot do (measured: docs/multi-host.md). Hosts of a lab therefore offer UCX its network transport only.
# torch.distributed's Gloo advertises the address the host name resolves to, 127.0.0.1 here, so a TP group across
# hosts is told which interface to use (measured: a D rank on another host was refused at 127.0.0.1 without it).
NAMESPACE_HOST_ENV = (("UCX_TLS", "tcp"),)
# An `ip` or `iptables` call takes milliseconds; one hung in the kernel (a stuck namespace) must not hang the run.
IP_TIMEOUT_S = 30.0
IP_KILL_WAIT_S = 5.0  # after the kill: a process stuck in the kernel may not die at once; it is then left behind


class NamespaceError(RuntimeError):
    """An ``ip`` command of the lab failed; the message carries its stderr."""


def run_ip(argv: list[str], error: type[Exception]) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` (``ip ...``, or ``ip netns exec NS iptables ...``) for its output, bounded by ``IP_TIMEOUT_S``:
    past it the command is killed and ``error`` raised, one line naming the command. Every ``ip`` and ``iptables``
    call of hosts/ goes through here."""
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = proc.communicate(timeout=IP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=IP_KILL_WAIT_S)
        raise error(f"{shlex.join(argv)}: no answer within {IP_TIMEOUT_S:g} s (killed)") from None
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


@dataclass(frozen=True)
class LabPlan:
    """Names and addresses of a lab (pure): one namespace per host plus the switch, one veth pair per host."""

    tag: str
    hosts: tuple[Host, ...]
    switch: str
    bridge: str
    links: tuple[tuple[str, str], ...]  # per host: (its end, the switch's end)
    prefix_len: int

    @property
    def namespaces(self) -> tuple[str, ...]:
        return (self.switch, *(h.netns for h in self.hosts if h.netns))


def plan_lab(names: Sequence[str], tag: str, subnet: str = DEFAULT_SUBNET) -> LabPlan:
    """``names`` become hosts ``pdh-<tag>-<name>`` with addresses .1, .2, ... of ``subnet`` (interface names stay
    within Linux's 15 characters)."""
    if not names or len(set(names)) != len(names):
        raise ValueError(f"a lab needs distinct host names, got {list(names)}")
    net = ipaddress.ip_network(subnet)
    addrs = list(net.hosts())
    if len(names) > len(addrs):
        raise ValueError(f"{subnet} has room for {len(addrs)} hosts, not {len(names)}")
    links = tuple((f"ph{tag}{i}", f"ps{tag}{i}") for i in range(len(names)))
    hosts = tuple(
        Host(n, str(addrs[i]), f"pdh-{tag}-{n}", (*NAMESPACE_HOST_ENV, ("GLOO_SOCKET_IFNAME", links[i][0])))
        for i, n in enumerate(names)
    )
    too_long = [name for pair in links for name in pair if len(name) > 15]
    if too_long:
        raise ValueError(f"tag {tag!r} makes interface names longer than 15 characters: {too_long}")
    return LabPlan(tag, hosts, f"pdh-{tag}-switch", f"pb{tag}", links, net.prefixlen)


def namespace_problem() -> str | None:
    """Why a lab cannot be made on this machine, or None."""
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add); this process is not root"
    if shutil.which("ip") is None:
        return "iproute2's `ip` is not installed"
    probe = f"pdh-probe-{os.getpid()}"
    try:
        made = run_ip(["ip", "netns", "add", probe], NamespaceError)
        if made.returncode:
            return f"ip netns add failed: {made.stderr.strip()}"
        run_ip(["ip", "netns", "del", probe], NamespaceError)
    except NamespaceError as e:
        return str(e)
    return None


def _ip(*args: str) -> None:
    done = run_ip(["ip", *args], NamespaceError)
    if done.returncode:
        raise NamespaceError(f"ip {' '.join(args)}: {done.stderr.strip() or f'exit {done.returncode}'}")


class NamespaceLab:
    """Hosts as network namespaces, made on enter and removed on exit (also after a failure half-way)."""

    def __init__(self, names: Sequence[str], subnet: str = DEFAULT_SUBNET, tag: str | None = None) -> None:
        self.plan = plan_lab(names, tag or uuid.uuid4().hex[:6], subnet)
        self._made: list[str] = []

    @property
    def hosts(self) -> dict[str, Host]:
        return {h.name: h for h in self.plan.hosts}

    def __enter__(self) -> NamespaceLab:
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _add_ns(self, name: str) -> None:
        _ip("netns", "add", name)
        self._made.append(name)
        _ip("-n", name, "link", "set", "lo", "up")

    def _create(self) -> None:
        p = self.plan
        self._add_ns(p.switch)
        _ip("-n", p.switch, "link", "add", p.bridge, "type", "bridge")
        _ip("-n", p.switch, "link", "set", p.bridge, "up")
        for host, (end, sw_end) in zip(p.hosts, p.links, strict=True):
            assert host.netns is not None
            self._add_ns(host.netns)
            # made inside the host's namespace, so no interface ever appears in this machine's own stack
            _ip("-n", host.netns, "link", "add", end, "type", "veth", "peer", "name", sw_end, "netns", p.switch)
            _ip("-n", host.netns, "addr", "add", f"{host.address}/{p.prefix_len}", "dev", end)
            _ip("-n", host.netns, "link", "set", end, "up")
            _ip("-n", p.switch, "link", "set", sw_end, "master", p.bridge)
            _ip("-n", p.switch, "link", "set", sw_end, "up")

    def link(self, host: str, up: bool) -> None:
        """Take ``host``'s link to the switch down (or up): the host is cut off from every other host."""
        i = [h.name for h in self.plan.hosts].index(host)
        _ip("-n", self.plan.switch, "link", "set", self.plan.links[i][1], "up" if up else "down")

    def link_is_up(self, host: str) -> bool:
        i = [h.name for h in self.plan.hosts].index(host)
        out = run_ip(["ip", "-n", self.plan.switch, "-o", "link", "show", self.plan.links[i][1]], NamespaceError)
        flags = out.stdout.partition("<")[2].partition(">")[0].split(",")
        return out.returncode == 0 and "UP" in flags

    def close(self) -> None:
        """Remove every namespace this lab made (their interfaces go with them)."""
        errors = []
        for name in reversed(self._made):
            try:  # every namespace gets its try, whatever happened to the one before
                done = run_ip(["ip", "netns", "del", name], NamespaceError)
            except NamespaceError as e:
                errors.append(f"{name}: {e}")
                continue
            if done.returncode and os.path.exists(os.path.join(NETNS_DIR, name)):
                errors.append(f"{name}: {done.stderr.strip()}")
        self._made.clear()
        if errors:
            raise NamespaceError("could not remove namespaces " + "; ".join(errors))

    def remaining(self) -> list[str]:
        """Namespaces of this lab still present (empty after close)."""
        return [n for n in self.plan.namespaces if os.path.exists(os.path.join(NETNS_DIR, n))]


def local_addresses() -> set[str]:
    """The IP addresses of this process's network stack."""
    import socket

    import psutil

    return {
        a.address.split("%")[0]
        for addrs in psutil.net_if_addrs().values()
        for a in addrs
        if a.family in (socket.AF_INET, socket.AF_INET6)
    }


def hosts_problem(hosts: RunHosts) -> str | None:
    """Why a run cannot be placed on ``hosts`` here (a namespace it names is missing, or this is not root), or None."""
    mine = local_addresses()
    elsewhere = [
        h for h in hosts.placed() if h.netns is None and h.ray is None and not h.is_local and h.address not in mine
    ]
    if elsewhere:
        h = elsewhere[0]
        return (
            f"host {h.name} ({h.address}) is not an address of this machine and has no netns: the harness starts "
            "servers only here, in network namespaces here or on Ray nodes (docs/multi-host.md); start them there "
            "and use attach mode (--prefill-url, --decode-url)"
        )
    names = hosts.namespaces
    if not names:
        return None
    if os.geteuid() != 0:
        return f"hosts in network namespaces ({', '.join(names)}) need root to start servers in them"
    missing = [n for n in names if not os.path.exists(os.path.join(NETNS_DIR, n))]
    if missing:
        return f"no network namespace {', '.join(missing)} (ip netns list shows what exists)"
    return None
