"""Servers and the proxy placed on hosts: what they bind, what peers dial, where they run."""

import pytest

from harness.cluster.remote import REMOTE_GRACE_S
from harness.core.errors import ConfigError
from harness.hosts.placement import RAY_STOP_GRACE_S, REMOTE_MODULE, Host, RayNode, RunHosts
from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, make_proxy, make_server
from harness.serve.ports import PortAllocator
from harness.serve.procs import RUN_TAG_ENV

A = Host("a", "10.213.0.2", "pdh-t-a", (("UCX_TLS", "tcp"),))
B = Host("b", "10.213.0.3", "pdh-t-b", (("UCX_TLS", "tcp"),))
C = Host("c", "10.213.0.4", "pdh-t-c")


def tiny(role: str) -> WantedServer:
    """A TP-1 server of ``role`` (the model's path and name stand-ins: nothing is started)."""
    return WantedServer(role=role, tp=1, model="/m", served_name="tiny", block_size=32, cpu_bind=None)


def test_a_server_on_a_namespace_host_binds_and_advertises_its_address(tmp_path):
    cfg = E2EConfig(hosts=RunHosts(prefill=A, decode=B, proxy=C))
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(cfg, alloc, tiny("prefill"), tmp_path)
    argv, env = srv.proc.spec.argv, srv.proc.spec.env
    assert argv[:4] == ("ip", "netns", "exec", "pdh-t-a")
    assert argv[argv.index("--host") + 1] == "10.213.0.2"
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.213.0.2"  # P's remote_host is dialable
    assert env["UCX_TLS"] == "tcp" and env["UCX_PROTO_INFO"] == "y"  # the host's settings; the transport evidence
    assert srv.url.startswith("http://10.213.0.2:") and (srv.proc.spec.health_url or "").startswith(srv.url)
    assert srv.command.startswith("DO_NOT_TRACK=1") and " ip netns exec pdh-t-a " in srv.command


def test_the_baseline_goes_to_ds_host(tmp_path):
    cfg = E2EConfig(hosts=RunHosts(prefill=A, decode=B, proxy=C))
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(cfg, alloc, tiny("baseline"), tmp_path)
    assert srv.proc.spec.argv[3] == "pdh-t-b" and srv.url.startswith("http://10.213.0.3:")


def test_one_host_stays_local_and_p_and_d_print_ucx_s_choice(tmp_path):
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(E2EConfig(), alloc, tiny("decode"), tmp_path)
        base = make_server(E2EConfig(), alloc, tiny("baseline"), tmp_path / "b")
    argv, env = srv.proc.spec.argv, srv.proc.spec.env
    assert argv[0] != "ip" and argv[argv.index("--host") + 1] == "127.0.0.1"
    # on one box too, D's log says which transport carried the KV (the report records it); the baseline moves none
    assert env["VLLM_HOST_IP"] == "127.0.0.1" and env["UCX_PROTO_INFO"] == "y"
    assert "UCX_PROTO_INFO" not in base.proc.spec.env


def test_the_proxy_runs_on_its_host(tmp_path):
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        proc, url = make_proxy(
            "python", alloc, ["http://10.213.0.2:1"], ["http://10.213.0.3:2"], tmp_path, 30.0, host=C
        )
    argv = proc.spec.argv
    assert tuple(argv[:5]) == ("ip", "netns", "exec", "pdh-t-c", "python")
    assert argv[argv.index("--host") + 1] == "10.213.0.4" and url.startswith("http://10.213.0.4:")


R = Host("r", "10.213.0.5", env=(("UCX_TLS", "tcp"),), ray=RayNode("ray://10.213.0.9:10001", "node-r", "ray_node: r"))


def test_a_server_on_a_ray_node_starts_through_the_launcher_with_its_own_settings(tmp_path):
    cfg = E2EConfig(hosts=RunHosts(prefill=R, decode=B, proxy=C))
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        srv = make_server(cfg, alloc, tiny("prefill"), tmp_path)
    spec = srv.proc.spec
    argv, env = list(spec.argv), spec.env
    assert argv[1:9] == [
        "-m",
        REMOTE_MODULE,
        "--ray",
        "ray://10.213.0.9:10001",
        "--node-id",
        "node-r",
        "--env",
        argv[8],
    ]
    taken = {argv[i + 1] for i, a in enumerate(argv[: argv.index("--")]) if a == "--env"}
    # every variable the harness sets for the server goes along (the node's environment gives the rest)
    assert taken == set(env) and {"VLLM_HOST_IP", "VLLM_NIXL_SIDE_CHANNEL_PORT", "UCX_TLS", RUN_TAG_ENV} <= taken
    assert argv[argv.index("--name") + 1] == "prefill"
    vllm = argv[argv.index("--") + 1 :]
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and vllm[vllm.index("--host") + 1] == "10.213.0.5"
    assert env["VLLM_HOST_IP"] == env["VLLM_NIXL_SIDE_CHANNEL_HOST"] == "10.213.0.5"
    assert srv.url.startswith("http://10.213.0.5:")
    # its stop covers the server's own on its node and Ray's round trips
    assert spec.stop_grace_s == RAY_STOP_GRACE_S > REMOTE_GRACE_S + 20
    assert f"-m {REMOTE_MODULE} " in srv.command


def test_gpu_runs_are_refused_with_servers_on_ray_nodes():
    with pytest.raises(ConfigError, match="servers on Ray nodes run on CPU only so far"):
        E2EConfig(device="gpu", model="m", hosts=RunHosts(prefill=R, decode=B)).validate()
