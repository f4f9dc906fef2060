"""Which Ray node a hosts file's host is: by address or node id, by a resource; each cluster read once."""

import pytest

from harness.cluster.placement import RayNodes, pick_node
from harness.cluster.tasks import Node, nodes_from
from harness.core.errors import ConfigError

RAW = [
    {"NodeID": "aaa", "Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"CPU": 4.0, "node:10.0.0.1": 1.0}},
    {"NodeID": "bbb", "Alive": True, "NodeManagerAddress": "10.0.0.3", "Resources": {"CPU": 4.0, "pd_decode": 1.0}},
    {"NodeID": "ccc", "Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"CPU": 4.0, "pd_decode": 2.0}},
    {"NodeID": "ddd", "Alive": False, "NodeManagerAddress": "10.0.0.4", "Resources": {"gone": 1.0}},
]
NODES = nodes_from(RAW)


def test_the_nodes_resources_are_read_by_name():
    assert [n.resources for n in NODES] == [("node:10.0.0.1",), ("pd_decode",), ("pd_decode",)]


@pytest.mark.parametrize(
    "how, value, node_id",
    [
        ("ray_node", "10.0.0.1", "aaa"),
        ("ray_node", "bbb", "bbb"),  # by node id too
        ("ray_resource", "pd_decode", "ccc"),  # several have it: the first by address
    ],
)
def test_a_node_is_picked_by_address_id_or_resource(how, value, node_id):
    assert pick_node(NODES, how, value, "ray://h:1").node_id == node_id


@pytest.mark.parametrize("how, value", [("ray_node", "10.0.0.4"), ("ray_resource", "gone"), ("ray_resource", "x")])
def test_no_live_node_is_a_config_error_listing_the_nodes(how, value):
    with pytest.raises(ConfigError, match=rf"matches {how}: {value} \(nodes: 10.0.0.1 \(aaa, resources: node:"):
        pick_node(NODES, how, value, "ray://h:1")


def test_each_cluster_is_read_once():
    reads: list[str] = []

    def read(cluster: str) -> list[Node]:
        reads.append(cluster)
        return NODES

    nodes = RayNodes(read)
    assert nodes("ray://h:1", "ray_node", "10.0.0.1") == ("aaa", "10.0.0.1")
    assert nodes("ray://h:1", "ray_resource", "pd_decode") == ("ccc", "10.0.0.2")
    assert reads == ["ray://h:1"]


def test_a_bad_cluster_address_is_a_config_error():
    with pytest.raises(ConfigError, match="ray: --ray 'http://h:1'"):
        RayNodes()("http://h:1", "ray_node", "10.0.0.1")
