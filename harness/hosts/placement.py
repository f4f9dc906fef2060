"""Which host each server of a run is on, and the address it binds and its peers dial (pure).

One host (the default) is this machine's own stack at 127.0.0.1. A hosts file places P, D, the proxy and the baseline
on hosts with their own addresses; a host may be a network namespace on this machine (``netns``), which is how the
tests stand up several hosts without several machines (docs/multi-host.md), or a node of a Ray cluster (``ray_node``,
``ray_resource``), where the harness starts the host's servers through Ray (``harness/cluster/remote.py``)."""

from __future__ import annotations

import ipaddress
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from harness.core.errors import ConfigError

LOCAL_ADDRESS = "127.0.0.1"
ROLES = ("prefill", "decode", "proxy", "baseline")
_NETNS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# What starts a command on a Ray node and streams its output back (run by this harness's interpreter; named, not
# imported: harness/cluster sits above this package).
REMOTE_MODULE = "harness.cluster.remote"
# The launcher's own stop grace: the server's on its node (remote.py REMOTE_GRACE_S) and Ray's round trips.
RAY_STOP_GRACE_S = 40.0
RAY_KEYS = ("ray_node", "ray_resource")  # how a hosts file picks a Ray node: by its address or node id, by a resource


@dataclass(frozen=True)
class RayNode:
    """The Ray node a host stands for: the cluster's address, the node Ray knows it by, and how the file chose it."""

    cluster: str
    node_id: str
    chosen_by: str  # "ray_node: 10.0.0.2", "ray_resource: pd_decode"


# (cluster address, "ray_node" or "ray_resource", value) -> (node id, the node's address)
RayResolver = Callable[[str, str, str], tuple[str, str]]


@dataclass(frozen=True)
class Host:
    name: str
    address: str = LOCAL_ADDRESS  # what its servers bind, and what peers (and P's remote_host) dial
    netns: str | None = None  # the network namespace standing for this host on one machine; None: this stack
    env: tuple[tuple[str, str], ...] = ()  # set for every server on this host (e.g. UCX_TLS, UCX_NET_DEVICES)
    ray: RayNode | None = None  # a node of a Ray cluster: its servers start there through Ray

    def __post_init__(self) -> None:
        if not self.name:
            raise ConfigError("a host needs a name")
        try:
            ipaddress.ip_address(self.address)
        except ValueError:
            raise ConfigError(f"host {self.name}: address {self.address!r} is not an IP address") from None
        if self.netns is not None and not _NETNS_NAME.match(self.netns):
            raise ConfigError(f"host {self.name}: {self.netns!r} is not a network namespace name")
        if self.netns is not None and self.ray is not None:
            raise ConfigError(f"host {self.name}: a network namespace here or a Ray node, not both")

    @property
    def is_local(self) -> bool:
        return self.netns is None and self.ray is None and ipaddress.ip_address(self.address).is_loopback

    def wrap(
        self, argv: tuple[str, ...] | list[str], env_names: Sequence[str] = (), name: str | None = None
    ) -> tuple[str, ...]:
        """``argv`` as run on this host: inside its namespace (``ip netns exec`` keeps the PID, so the process
        stays ours by process group); on its Ray node through a local launcher that owns it there and streams its
        output here (``env_names``: the variables it takes along, the node's environment gives the rest); else as
        it is (``name``: the server's, for its log on the node)."""
        if self.ray is not None:
            env = [a for n in env_names for a in ("--env", n)]
            named = ("--name", name) if name else ()
            return (sys.executable, "-m", REMOTE_MODULE, "--ray", self.ray.cluster, "--node-id", self.ray.node_id,
                    *env, *named, "--", *argv)  # fmt: skip
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

    @property
    def on_ray(self) -> bool:
        """Some server starts on a Ray node."""
        return any(h.ray is not None for h in self.placed())

    def to_dict(self) -> dict[str, object]:
        out: dict[str, object] = {role: _host_dict(self.for_role(role)) for role in ROLES}
        out["decode_nodes"] = [_host_dict(h) for h in self.decode_nodes]
        return out


def _host_dict(h: Host) -> dict[str, object]:
    ray = None if h.ray is None else {"cluster": h.ray.cluster, "node_id": h.ray.node_id, "chosen_by": h.ray.chosen_by}
    return {"name": h.name, "address": h.address, "netns": h.netns, "env": dict(h.env), "ray": ray}


_HOST_KEYS = {"address", "netns", "env", *RAY_KEYS}


def _host(name: str, spec: object, where: str, cluster: str | None, resolve: RayResolver | None) -> Host:
    if not isinstance(spec, Mapping) or set(spec) - _HOST_KEYS:
        raise ConfigError(f"{where}: host {name} takes {', '.join(sorted(_HOST_KEYS))}, got {spec!r}")
    env = spec.get("env") or {}
    if not isinstance(env, Mapping):
        raise ConfigError(f"{where}: host {name}: 'env' maps variable names to values, got {env!r}")
    env_items = tuple((str(k), str(v)) for k, v in env.items())
    picks = [k for k in RAY_KEYS if spec.get(k) is not None]
    if not picks:
        if "address" not in spec:
            raise ConfigError(f"{where}: host {name} needs 'address' (or a Ray node: 'ray_node', 'ray_resource')")
        netns = None if spec.get("netns") is None else str(spec["netns"])
        return Host(name, str(spec["address"]), netns, env_items)
    if len(picks) > 1 or spec.get("netns") is not None:
        raise ConfigError(f"{where}: host {name}: one of 'ray_node', 'ray_resource' (and no 'netns'), got {spec!r}")
    if cluster is None:
        raise ConfigError(f"{where}: host {name} is a Ray node ({picks[0]}): say which cluster with 'ray: ADDRESS'")
    assert resolve is not None  # hosts_from_dict refuses 'ray' without a resolver
    node_id, address = resolve(cluster, picks[0], str(spec[picks[0]]))
    if spec.get("address") is not None and str(spec["address"]) != address:
        raise ConfigError(f"{where}: host {name}: 'address' {spec['address']} is not its Ray node's ({address})")
    return Host(name, address, None, env_items, RayNode(cluster, node_id, f"{picks[0]}: {spec[picks[0]]}"))


def hosts_from_dict(data: Mapping[str, object], where: str = "hosts", resolve: RayResolver | None = None) -> RunHosts:
    """A RunHosts from a hosts file's content:

    ray: ray://10.0.0.1:10001   # only where a host is a Ray node
    hosts: {a: {address: 10.0.0.1, netns: lab-a}, b: {address: 10.0.0.2, env: {UCX_NET_DEVICES: mlx5_0:1}},
            c: {ray_node: 10.0.0.3}, d: {ray_resource: pd_decode}}
    prefill: a
    decode: b       # or [b, c]: D's TP group across nodes b and c (b serves D's API)
    proxy: a        # default: prefill's host
    baseline: b     # default: decode's host

    ``resolve`` finds a Ray host's node (``harness/cluster/placement.py``); a file with ``ray`` needs one.
    """
    unknown = set(data) - {"hosts", "ray", *ROLES}
    if unknown:
        known = ", ".join(("hosts", "ray", *ROLES))
        raise ConfigError(f"{where}: unknown key(s) {', '.join(sorted(unknown))} (known: {known})")
    raw = data.get("hosts")
    if not isinstance(raw, Mapping) or not raw:
        raise ConfigError(f"{where}: 'hosts' must map host names to {{address, netns, env}}")
    cluster = None if data.get("ray") is None else str(data["ray"])
    if cluster is not None and resolve is None:
        raise ConfigError(f"{where}: 'ray' places hosts on a Ray cluster, which this command does not connect to")
    hosts: dict[str, Host] = {}
    for name, spec in raw.items():
        hosts[str(name)] = _host(str(name), spec, where, cluster, resolve)

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


def hosts_file(path: Path) -> Mapping[str, object]:
    """A hosts file's content (YAML, or JSON, which YAML reads too); any problem is one ConfigError line naming it."""
    import yaml

    try:
        data = yaml.safe_load(Path(path).read_text())
    except (OSError, yaml.YAMLError) as e:
        raise ConfigError(f"{path}: cannot read hosts file: {str(e).splitlines()[0]}") from None
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: a hosts file is a mapping (hosts, prefill, decode, ...)")
    return data
