"""Servers and the proxy placed on hosts: what they bind, what peers dial, where they run."""

from harness.hosts.placement import Host, RunHosts
from harness.run.config import E2EConfig
from harness.run.launch import make_proxy, make_server
from harness.serve.ports import PortAllocator

A = Host("a", "10.213.0.2", "pdh-t-a", (("UCX_TLS", "tcp"),))
B = Host("b", "10.213.0.3", "pdh-t-b", (("UCX_TLS", "tcp"),))
C = Host("c", "10.213.0.4", "pdh-t-c")


def test_a_server_on_a_namespace_host_binds_and_advertises_its_address(tmp_path):
    cfg = E2EConfig(hosts=RunHosts(prefill=A, decode=B, proxy=C))
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(cfg, alloc, "prefill", 1, "/m", "tiny", 32, None, tmp_path)
    argv, env = srv.proc.spec.argv, srv.proc.spec.env
    assert argv[:4] == ("ip", "netns", "exec", "pdh-t-a")
    assert argv[argv.index("--host") + 1] == "10.213.0.2"
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.213.0.2"  # P's remote_host is dialable
    assert env["UCX_TLS"] == "tcp" and env["UCX_PROTO_INFO"] == "y"  # the host's settings; the transport evidence
    assert srv.url.startswith("http://10.213.0.2:") and srv.proc.spec.health_url.startswith(srv.url)
    assert srv.command.startswith("DO_NOT_TRACK=1") and " ip netns exec pdh-t-a " in srv.command


def test_the_baseline_goes_to_ds_host(tmp_path):
    cfg = E2EConfig(hosts=RunHosts(prefill=A, decode=B, proxy=C))
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(cfg, alloc, "baseline", 1, "/m", "tiny", 32, None, tmp_path)
    assert srv.proc.spec.argv[3] == "pdh-t-b" and srv.url.startswith("http://10.213.0.3:")


def test_one_host_stays_as_it_was(tmp_path):
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(E2EConfig(), alloc, "decode", 1, "/m", "tiny", 32, None, tmp_path)
    argv, env = srv.proc.spec.argv, srv.proc.spec.env
    assert argv[0] != "ip" and argv[argv.index("--host") + 1] == "127.0.0.1"
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and "UCX_PROTO_INFO" not in env


def test_the_proxy_runs_on_its_host(tmp_path):
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        proc, url = make_proxy("python", alloc, ["http://10.213.0.2:1"], ["http://10.213.0.3:2"], tmp_path, 30.0, host=C)
    argv = proc.spec.argv
    assert tuple(argv[:5]) == ("ip", "netns", "exec", "pdh-t-c", "python")
    assert argv[argv.index("--host") + 1] == "10.213.0.4" and url.startswith("http://10.213.0.4:")
