"""Which host each server of a run is on, and the address it binds and its peers dial (pure).

One host (the default) is this machine's own stack at 127.0.0.1. A hosts file places P, D, the proxy and the baseline
on hosts with their own addresses; a host may be a network namespace on this machine (``netns``), which is how the
tests stand up several hosts without several machines (docs/multi-host.md)."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import ConfigError

LOCAL_ADDRESS = "127.0.0.1"
ROLES = ("prefill", "decode", "proxy", "baseline")
_NETNS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")


@dataclass(frozen=True)
class Host:
    name: str
    address: str = LOCAL_ADDRESS  # what its servers bind, and what peers (and P's remote_host) dial
    netns: str | None = None  # the network namespace standing for this host on one machine; None: this stack
    env: tuple[tuple[str, str], ...] = ()  # set for every server on this host (e.g. UCX_TLS, UCX_NET_DEVICES)

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a host needs a name")
        try:
            ipaddress.ip_address(self.address)
        except ValueError:
            raise ConfigError(f"host {self.name}: address {self.address!r} is not an IP address") from None
        if self.netns is not None and not _NETNS_NAME.match(self.netns):
            raise ConfigError(f"host {self.name}: {self.netns!r} is not a network namespace name")

    @property
    def is_local(self) -> bool:
        return self.netns is None and ipaddress.ip_address(self.address).is_loopback

    def wrap(self, argv: tuple[str, ...] | list[str]) -> tuple[str, ...]:
        """``argv`` as run on this host: inside its namespace (``ip netns exec`` keeps the PID, so the process
        stays ours by process group), else as it is."""
        return ("ip", "netns", "exec", self.netns, *argv) if self.netns else tuple(argv)

    def url(self, port: int) -> str:
        host = f"[{self.address}]" if ":" in self.address else self.address
        return f"http://{host}:{port}"


LOCAL = Host("local")


@dataclass(frozen=True)
class RunHosts:
    """The host of each role; a baseline with no host of its own runs on D's."""

    prefill: Host = LOCAL
    decode: Host = LOCAL
    proxy: Host = LOCAL
    baseline: Host | None = None
    decode_nodes: tuple[Host, ...] = ()  # D's further nodes: its TP group spans decode and these (vLLM's multi-node)
    hosts: tuple[Host, ...] = field(default=(), compare=False)  # every host the file named, in its order

    def __post_init__(self) -> None:
        seen: dict[str, Host] = {}
        for h in (*self.hosts, *self.placed()):
            other = seen.setdefault(h.name, h)
            if other != h:
                raise ConfigError(f"host {h.name} is given twice, as {other} and {h}")
        if self.decode in self.decode_nodes or len(set(self.decode_nodes)) != len(self.decode_nodes):
            raise ConfigError("each of D's nodes must be a different host")
        by_addr: dict[str, str] = {}
        for h in seen.values():
            if by_addr.setdefault(h.address, h.name) != h.name and not h.is_local:
                raise ConfigError(f"hosts {by_addr[h.address]} and {h.name} have the same address {h.address}")

    def placed(self) -> tuple[Host, ...]:
        return (self.prefill, self.decode, self.proxy, self.for_role("baseline"), *self.decode_nodes)

    def for_role(self, role: str) -> Host:
        if role == "baseline":
            return self.baseline or self.decode
        if role not in ROLES:
            raise ValueError(f"no host for role {role!r}")
        return getattr(self, role)

    @property
    def spans_hosts(self) -> bool:
        """P and D on different hosts: KV must cross a network, not a same-host shortcut."""
        return self.prefill.name != self.decode.name

    @property
    def over_network(self) -> bool:
        """Some server is not on this machine's loopback: reaching it is part of it being alive."""
        return not all(h.is_local for h in self.placed())

    @property
    def namespaces(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(h.netns for h in self.placed() if h.netns))

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {role: _host_dict(self.for_role(role)) for role in ROLES}
        out["decode_nodes"] = [_host_dict(h) for h in self.decode_nodes]
        return out


def _host_dict(h: Host) -> dict[str, object]:
    return {"name": h.name, "address": h.address, "netns": h.netns, "env": dict(h.env)}


def _host(name: str, spec: object, where: str) -> Host:
    if not isinstance(spec, Mapping) or "address" not in spec or set(spec) - {"address", "netns", "env"}:
        raise ConfigError(f"{where}: host {name} needs 'address' (and may have 'netns', 'env'), got {spec!r}")
    env = spec.get("env") or {}
    if not isinstance(env, Mapping):
        raise ConfigError(f"{where}: host {name}: 'env' maps variable names to values, got {env!r}")
    netns = None if spec.get("netns") is None else str(spec["netns"])
    return Host(name, str(spec["address"]), netns, tuple((str(k), str(v)) for k, v in env.items()))


def hosts_from_dict(data: Mapping[str, object], where: str = "hosts") -> RunHosts:
    """A RunHosts from a hosts file's content:

    hosts: {a: {address: 10.0.0.1, netns: lab-a}, b: {address: 10.0.0.2, env: {UCX_NET_DEVICES: mlx5_0:1}}}
    prefill: a
    decode: b       # or [b, c]: D's TP group across nodes b and c (b serves D's API)
    proxy: a        # default: prefill's host
    baseline: b     # default: decode's host
    """
    unknown = set(data) - {"hosts", *ROLES}
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: hosts, {', '.join(ROLES)})")
    raw = data.get("hosts")
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{where}: 'hosts' must map host names to {{address, netns, env}}")
    hosts: dict[str, Host] = {}
    for name, spec in raw.items():
        hosts[str(name)] = _host(str(name), spec, where)

    def host(role: str, name: object) -> Host:
        if str(name) not in hosts:
            raise ConfigError(f"{where}: {role} is on host {name!r}, which 'hosts' does not name")
        return hosts[str(name)]

    for role in ("prefill", "decode"):
        if role not in data:
            raise ConfigError(f"{where}: say which host '{role}' is on")
    # decode: one host, or a list: D's TP group across those nodes, the first serving its API
    d_names = data["decode"] if isinstance(data["decode"], list) else [data["decode"]]
    if not d_names:
        raise ConfigError(f"{where}: 'decode' names no host")
    d_nodes = [host("decode", n) for n in d_names]
    prefill = host("prefill", data["prefill"])
    return RunHosts(
        prefill=prefill,
        decode=d_nodes[0],
        decode_nodes=tuple(d_nodes[1:]),
        proxy=host("proxy", data.get("proxy", prefill.name)),
        baseline=host("baseline", data["baseline"]) if data.get("baseline") is not None else None,
        hosts=tuple(hosts.values()),
    )


def load_hosts(path: Path) -> RunHosts:
    """A hosts file (YAML, or JSON, which YAML reads too); any problem is one ConfigError line naming the file."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read hosts file: {str(e).splitlines()[0]}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a hosts file is a mapping (hosts, prefill, decode, ...)")
    return hosts_from_dict(data, where=str(path))
