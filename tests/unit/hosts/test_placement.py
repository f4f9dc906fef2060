from typing import Any

import pytest

from harness.core.errors import ConfigError
from harness.hosts.placement import LOCAL, REMOTE_MODULE, Host, RayNode, RunHosts, hosts_file, hosts_from_dict

FILE: dict[str, Any] = {
    "hosts": {"a": {"address": "10.0.0.1", "netns": "lab-a"}, "b": {"address": "10.0.0.2", "netns": "lab-b"}},
    "prefill": "a",
    "decode": "b",
}


def test_default_is_one_host_on_loopback():
    hosts = RunHosts()
    assert not hosts.spans_hosts
    assert hosts.for_role("baseline") == LOCAL
    assert hosts.namespaces == ()
    assert LOCAL.wrap(["python", "-V"]) == ("python", "-V")
    assert LOCAL.url(8000) == "http://127.0.0.1:8000"


def test_a_file_places_roles_with_defaults_for_proxy_and_baseline():
    hosts = hosts_from_dict(FILE)
    assert hosts.prefill.address == "10.0.0.1" and hosts.decode.address == "10.0.0.2"
    assert hosts.proxy == hosts.prefill  # the proxy goes with P unless placed
    assert hosts.for_role("baseline") == hosts.decode  # the baseline runs at D's TP, on D's host
    assert hosts.spans_hosts
    assert hosts.namespaces == ("lab-a", "lab-b")
    assert hosts.decode.wrap(["python"]) == ("ip", "netns", "exec", "lab-b", "python")
    assert hosts.to_dict()["decode"] == {"name": "b", "address": "10.0.0.2", "netns": "lab-b", "env": {}, "ray": None}


def test_ipv6_url_is_bracketed():
    assert Host("x", "fd00::2").url(80) == "http://[fd00::2]:80"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"decode": "z"}, "which 'hosts' does not name"),
        ({"hosts": {"a": {"address": "not-an-ip"}}}, "is not an IP address"),
        ({"hosts": {"a": {"address": "10.0.0.1", "port": 3}}}, "takes address, env, netns, ray_node, ray_resource"),
        ({"hosts": {"a": {"netns": "lab-a"}}}, "needs 'address' (or a Ray node"),
        ({"hosts": {"a": {"ray_node": "10.0.0.1"}}}, "say which cluster with 'ray: ADDRESS'"),
        ({"colour": "red"}, "unknown key(s) colour"),
        ({"hosts": {"a": {"address": "10.0.0.1"}, "b": {"address": "10.0.0.1"}}}, "same address"),
        ({"hosts": {"a": {"address": "10.0.0.1", "netns": "bad name"}}}, "not a network namespace name"),
        ({"hosts": {}}, "'hosts' must map"),
    ],
)
def test_bad_files_fail_with_the_reason(change, words):
    data = {**FILE, **change}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        hosts_from_dict(data)


def test_decode_must_be_placed():
    with pytest.raises(ConfigError, match="say which host 'decode' is on"):
        hosts_from_dict({"hosts": FILE["hosts"], "prefill": "a"})


def test_a_hosts_file_is_named_in_its_errors(tmp_path):
    bad = tmp_path / "hosts.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="hosts.yaml: a hosts file is a mapping"):
        hosts_file(bad)
    good = tmp_path / "hosts.json"
    good.write_text('{"hosts": {"a": {"address": "10.0.0.1"}}, "prefill": "a", "decode": "a"}')
    assert not hosts_from_dict(hosts_file(good), where=str(good)).spans_hosts


def test_a_hosts_settings_are_kept_and_checked():
    data = {**FILE, "hosts": {**FILE["hosts"], "b": {"address": "10.0.0.2", "env": {"UCX_NET_DEVICES": "mlx5_0:1"}}}}
    assert hosts_from_dict(data).decode.env == (("UCX_NET_DEVICES", "mlx5_0:1"),)
    with pytest.raises(ConfigError, match="'env' maps variable names"):
        hosts_from_dict({**FILE, "hosts": {**FILE["hosts"], "b": {"address": "10.0.0.2", "env": ["X=1"]}}})


def test_decode_across_nodes_is_a_list_whose_first_serves_the_api():
    data = {**FILE, "hosts": {**FILE["hosts"], "c": {"address": "10.0.0.3"}}, "decode": ["b", "c"]}
    hosts = hosts_from_dict(data)
    assert hosts.decode.name == "b" and [h.name for h in hosts.decode_nodes] == ["c"]
    assert hosts.for_role("baseline").name == "b"
    nodes = hosts.to_dict()["decode_nodes"]
    assert isinstance(nodes, list) and [n["name"] for n in nodes] == ["c"]
    with pytest.raises(ConfigError, match="different host"):
        hosts_from_dict({**data, "decode": ["b", "b"]})
    with pytest.raises(ConfigError, match="names no host"):
        hosts_from_dict({**data, "decode": []})


RAY_FILE: dict[str, Any] = {
    "ray": "ray://10.0.0.9:10001",
    "hosts": {
        "p": {"ray_node": "10.0.0.1", "env": {"UCX_TLS": "tcp"}},
        "d": {"ray_resource": "pd_decode"},
        "here": {"address": "10.0.0.3"},
    },
    "prefill": "p",
    "decode": "d",
    "proxy": "here",
}


def fake_cluster(asked: list):
    nodes = {("ray_node", "10.0.0.1"): ("n-1", "10.0.0.1"), ("ray_resource", "pd_decode"): ("n-2", "10.0.0.2")}

    def resolve(cluster: str, how: str, value: str) -> tuple[str, str]:
        asked.append((cluster, how, value))
        if (how, value) not in nodes:
            raise ConfigError(f"no live node matches {how}: {value}")
        return nodes[(how, value)]

    return resolve


def test_ray_hosts_are_the_nodes_the_resolver_finds():
    asked: list = []
    hosts = hosts_from_dict(RAY_FILE, resolve=fake_cluster(asked))
    assert asked == [
        ("ray://10.0.0.9:10001", "ray_node", "10.0.0.1"),
        ("ray://10.0.0.9:10001", "ray_resource", "pd_decode"),
    ]
    assert hosts.prefill.address == "10.0.0.1" and hosts.prefill.ray == RayNode(
        "ray://10.0.0.9:10001", "n-1", "ray_node: 10.0.0.1"
    )
    assert hosts.decode.address == "10.0.0.2" and hosts.decode.ray is not None
    assert hosts.decode.ray.chosen_by == "ray_resource: pd_decode"
    assert hosts.proxy.ray is None and hosts.on_ray and hosts.spans_hosts and hosts.over_network
    decode = hosts.to_dict()["decode"]
    assert isinstance(decode, dict) and decode["ray"] == {
        "cluster": "ray://10.0.0.9:10001",
        "node_id": "n-2",
        "chosen_by": "ray_resource: pd_decode",
    }


def test_a_ray_host_runs_its_command_through_the_launcher_with_the_named_variables():
    hosts = hosts_from_dict(RAY_FILE, resolve=fake_cluster([]))
    argv = hosts.prefill.wrap(["python", "-m", "x"], env_names=("A", "B"), name="prefill")
    assert argv[1:] == (
        "-m",
        REMOTE_MODULE,
        "--ray",
        "ray://10.0.0.9:10001",
        "--node-id",
        "n-1",
        "--env",
        "A",
        "--env",
        "B",
        "--name",
        "prefill",
        "--",
        "python",
        "-m",
        "x",
    )
    assert hosts.proxy.wrap(["python"], env_names=("A",)) == ("python",)  # not a Ray node: as it is


@pytest.mark.parametrize(
    "host, words",
    [
        ({"ray_node": "10.0.0.1", "ray_resource": "x"}, "one of 'ray_node', 'ray_resource'"),
        ({"ray_node": "10.0.0.1", "netns": "lab-a"}, "one of 'ray_node', 'ray_resource'"),
        ({"ray_node": "10.0.0.1", "address": "10.0.0.7"}, "is not its Ray node's (10.0.0.1)"),
        ({"ray_resource": "nowhere"}, "no live node matches ray_resource: nowhere"),
    ],
)
def test_bad_ray_hosts_fail_with_the_reason(host, words):
    data = {**RAY_FILE, "hosts": {**RAY_FILE["hosts"], "p": host}}
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        hosts_from_dict(data, resolve=fake_cluster([]))


def test_a_ray_file_needs_a_command_that_connects_to_ray():
    with pytest.raises(ConfigError, match="which this command does not connect to"):
        hosts_from_dict(RAY_FILE)
