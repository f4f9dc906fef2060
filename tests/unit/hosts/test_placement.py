import pytest

from harness.core.errors import ConfigError
from harness.hosts.placement import LOCAL, Host, RunHosts, hosts_from_dict, load_hosts

FILE = {
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
    assert hosts.to_dict()["decode"] == {"name": "b", "address": "10.0.0.2", "netns": "lab-b", "env": {}}


def test_ipv6_url_is_bracketed():
    assert Host("x", "fd00::2").url(80) == "http://[fd00::2]:80"


@pytest.mark.parametrize(
    "change, words",
    [
        ({"decode": "z"}, "which 'hosts' does not name"),
        ({"hosts": {"a": {"address": "not-an-ip"}}}, "is not an IP address"),
        ({"hosts": {"a": {"address": "10.0.0.1", "port": 3}}}, "needs 'address'"),
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


def test_load_hosts_names_the_file(tmp_path):
    bad = tmp_path / "hosts.yaml"
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="hosts.yaml: a hosts file is a mapping"):
        load_hosts(bad)
    good = tmp_path / "hosts.json"
    good.write_text('{"hosts": {"a": {"address": "10.0.0.1"}}, "prefill": "a", "decode": "a"}')
    assert not load_hosts(good).spans_hosts


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
    assert [n["name"] for n in hosts.to_dict()["decode_nodes"]] == ["c"]
    with pytest.raises(ConfigError, match="different host"):
        hosts_from_dict({**data, "decode": ["b", "b"]})
    with pytest.raises(ConfigError, match="names no host"):
        hosts_from_dict({**data, "decode": []})
