"""Which Ray node a host of a hosts file is (``ray_node: ADDRESS-or-NODE-ID``, ``ray_resource: NAME``): the choice is
pure (``pick_node``); ``RayNodes`` reads each cluster's live nodes once, connecting for that read only (the servers
are started later, each by its own launcher: ``remote.py``)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from harness.cluster.tasks import Node, parse_address
from harness.core.errors import ConfigError


def pick_node(nodes: Sequence[Node], how: str, value: str, cluster: str) -> Node:
    """The live node ``how`` ("ray_node": its address or node id; "ray_resource": a resource it has) names. Several
    nodes with the resource: the first by address (the report says which); none: a ConfigError listing the nodes."""
    if how == "ray_node":
        found = [n for n in nodes if value in (n.address, n.node_id)]
    elif how == "ray_resource":
        found = sorted((n for n in nodes if value in n.resources), key=lambda n: (n.address, n.node_id))
    else:
        raise ValueError(f"no Ray node choice {how!r}")
    if not found:
        listed = "; ".join(f"{n.address} ({n.node_id[:12]}, resources: {', '.join(n.resources) or 'none'})"
                           for n in nodes)  # fmt: skip
        raise ConfigError(f"no live node of the Ray cluster at {cluster} matches {how}: {value} (nodes: {listed})")
    return found[0]


def read_nodes(cluster: str) -> list[Node]:
    """The live nodes of the cluster at ``cluster`` (connected for this read, then disconnected)."""
    from harness.cluster.ray_tasks import ClusterError, connected, live_nodes

    try:
        address = parse_address(cluster)
    except ValueError as e:
        raise ConfigError(f"ray: {e}") from None
    try:
        with connected(address) as ray:
            return live_nodes(ray)
    except ClusterError as e:
        raise ConfigError(str(e)) from None


@dataclass
class RayNodes:
    """A hosts file's resolver (``hosts/placement.py`` ``RayResolver``): each cluster read once."""

    read: Callable[[str], list[Node]] = read_nodes
    _seen: dict[str, list[Node]] = field(default_factory=dict)

    def __call__(self, cluster: str, how: str, value: str) -> tuple[str, str]:
        if cluster not in self._seen:
            self._seen[cluster] = self.read(cluster)
        node = pick_node(self._seen[cluster], how, value, cluster)
        return node.node_id, node.address
