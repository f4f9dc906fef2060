"""Network faults a run injects between hosts (``--net-fault``), each read back to prove it took effect.

``p-link-down``: P's host loses every link (all its interfaces but loopback go down) while a request is between
its hops: P has answered the prefill and holds the KV, D is about to read it. The proxy holds that request until
the fault is in place (``--fault hold-between-hops``), so the cut lands at the same point on every run.

``side-channel-blocked``: once P is up and before the first request (so before D's NIXL handshake), P's host drops
every packet to P's side-channel ports (an iptables rule in P's namespace). The rule's packet counter, read when the
phase ends, shows whether D's handshake ran into it.

Each fault can be undone and read back (``LinkCutter.restore``, ``unblock_ports``): after the fault's failure, the
run reads P again to follow the blocks it held for D back to idle (the leak check after a fault)."""

from __future__ import annotations

import shutil
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from harness.hosts.netns import run_ip
from harness.hosts.placement import Host

NET_FAULTS = ("none", "p-link-down", "side-channel-blocked")
NEEDS_HOLD = ("p-link-down",)  # faults that need the proxy to hold a request between hops
HOLD_EVERY = 3  # the request the proxy holds for the cut: the third, after the handshake and a few transfers
HELD, GO = ".held", ".go"  # the proxy's marker files in the hold folder: "request held", "let it go on"


class NetFaultError(RuntimeError):
    """The fault could not be put in place (or read back)."""


def links(host: Host) -> dict[str, bool]:
    """Each interface of ``host``'s namespace but loopback -> whether it is up."""
    if host.netns is None:
        raise NetFaultError(f"host {host.name} is not a network namespace: the harness cuts links only there")
    out = run_ip(["ip", "-n", host.netns, "-o", "link", "show"], NetFaultError)
    if out.returncode:
        raise NetFaultError(f"ip -n {host.netns} link show: {out.stderr.strip()}")
    state: dict[str, bool] = {}
    for line in out.stdout.splitlines():
        # "2: ph1a2b3c0@if3: <BROADCAST,MULTICAST,UP,LOWER_UP> mtu 1500 ..."
        name = line.split(":", 2)[1].strip().split("@")[0]
        if name != "lo":
            state[name] = "UP" in line.partition("<")[2].partition(">")[0].split(",")
    return state


def cut(host: Host, done: list[str] | None = None) -> list[str]:
    """Take every link of ``host`` down; raise unless all read back down. Returns the links cut. ``done`` gets each
    link as it goes down, so that a cut that fails halfway can still be undone."""
    names = list(links(host))
    for name in names:
        _set_link(host, name, "down")
        if done is not None and name not in done:
            done.append(name)
    still_up = [n for n, up in links(host).items() if up]
    if not names or still_up:
        raise NetFaultError(f"host {host.name}: links still up after the cut: {still_up or 'no link to cut'}")
    return names


def bring_up(host: Host, names: list[str]) -> dict[str, bool]:
    """Bring ``names`` (links of ``host``, e.g. those ``cut`` took down) back up; raise unless each reads back up.
    Returns the links of ``host`` as read back."""
    for name in names:
        _set_link(host, name, "up")
    state = links(host)
    down = [n for n in names if not state.get(n)]
    if down:
        raise NetFaultError(f"host {host.name}: links still down after bringing them up: {down}")
    return state


def _set_link(host: Host, name: str, updown: str) -> None:
    done = run_ip(["ip", "-n", str(host.netns), "link", "set", name, updown], NetFaultError)
    if done.returncode:
        raise NetFaultError(f"ip -n {host.netns} link set {name} {updown}: {done.stderr.strip()}")


@dataclass
class LinkCutter:
    """Waits (in a thread) for the proxy to hold a request between hops, cuts ``host``'s links, reads them back,
    then lets the request go on; ``restore`` (after ``stop``) brings them back up. ``fired`` is what the report
    records."""

    host: Host
    hold_dir: Path
    timeout_s: float = 600.0
    fired: dict[str, object] = field(default_factory=dict)
    error: str | None = None
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None
    _cut: list[str] = field(default_factory=list)  # links taken down so far, even by a cut that failed halfway

    def start(self) -> None:
        self.hold_dir.mkdir(parents=True, exist_ok=True)
        self._thread = threading.Thread(target=self._run, name="net-fault", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _run(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._stop.is_set() and time.monotonic() < deadline:
            held = sorted(self.hold_dir.glob(f"*{HELD}"))
            if held:
                request_id = held[0].name[: -len(HELD)]
                try:
                    cut_links = cut(self.host, self._cut)
                    self.fired = {
                        "fault": "p-link-down",
                        "host": self.host.name,
                        "links_down": cut_links,
                        "read_back": links(self.host),
                        "request_held": request_id,
                    }
                except NetFaultError as e:
                    self.error = str(e)
                (self.hold_dir / f"{request_id}{GO}").touch()
                return
            self._stop.wait(0.05)

    def restore(self) -> dict[str, object]:
        """Bring the links this cutter took down back up and read them back; raises NetFaultError unless each is up.
        Call after ``stop``, so that no cut can follow. Returns what it did (``restored``: the links, and
        ``restored_read_back``), also added to ``fired``; {} when nothing was cut."""
        if self._thread is not None and self._thread.is_alive():
            raise NetFaultError("the cutter still runs: stop it before restoring the links")
        if not self._cut:
            return {}
        done: dict[str, object] = {"restored": list(self._cut), "restored_read_back": bring_up(self.host, self._cut)}
        self.fired.update(done)
        return done


def _iptables(host: Host, *args: str) -> str:
    if shutil.which("iptables") is None:
        raise NetFaultError("iptables is not installed (Debian: apt-get install iptables)")
    out = run_ip(["ip", "netns", "exec", str(host.netns), "iptables", *args], NetFaultError)
    if out.returncode:
        raise NetFaultError(f"iptables {' '.join(args)} in {host.netns}: {out.stderr.strip()}")
    return out.stdout


def _drop_spec(first: int, count: int) -> tuple[str, list[str]]:
    """The ports as iptables writes them, and the DROP rule's spec in INPUT (shared by adding and removing it)."""
    ports = f"{first}:{first + count - 1}" if count > 1 else str(first)
    return ports, ["INPUT", "-p", "tcp", "--dport", ports, "-j", "DROP"]


def _drop_rules(host: Host, ports: str) -> list[str]:
    return [r for r in _iptables(host, "-S", "INPUT").splitlines() if f"--dport {ports} " in f"{r} " and "DROP" in r]


def block_ports(host: Host, first: int, count: int) -> str:
    """Drop every TCP packet to ports ``first`` .. ``first + count - 1`` arriving at ``host``; the rule as iptables
    reads it back (raises if it is not there)."""
    if host.netns is None:
        raise NetFaultError(f"host {host.name} is not a network namespace: the harness blocks ports only there")
    ports, spec = _drop_spec(first, count)
    _iptables(host, "-A", *spec)
    rules = _drop_rules(host, ports)
    if not rules:
        raise NetFaultError(f"the DROP rule for ports {ports} is not in {host.name}'s INPUT chain after adding it")
    return rules[0]


def unblock_ports(host: Host, first: int, count: int) -> list[str]:
    """Remove the rule ``block_ports`` added (``iptables -D`` with the same spec); raise unless it reads back gone.
    Returns the INPUT chain as read back after."""
    if host.netns is None:
        raise NetFaultError(f"host {host.name} is not a network namespace: the harness blocks ports only there")
    ports, spec = _drop_spec(first, count)
    _iptables(host, "-D", *spec)
    left = _drop_rules(host, ports)
    if left:
        raise NetFaultError(f"a DROP rule for ports {ports} is still in {host.name}'s INPUT chain: {left}")
    return _iptables(host, "-S", "INPUT").splitlines()


def dropped_packets(host: Host, first: int, count: int) -> int:
    """Packets the DROP rule for those ports has dropped so far."""
    ports = f"dpts:{first}:{first + count - 1}" if count > 1 else f"dpt:{first}"
    for line in _iptables(host, "-L", "INPUT", "-v", "-n", "-x").splitlines():
        if "DROP" in line and line.rstrip().endswith(ports):
            return int(line.split()[0])
    raise NetFaultError(f"no DROP rule for {ports} in {host.name}'s INPUT chain")
