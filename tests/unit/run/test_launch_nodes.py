"""D's TP group across two hosts: rank 0 serves the API, the follower starts headless; each binds its own address."""

import pytest

from harness.core.errors import ConfigError
from harness.hosts.placement import Host, RunHosts
from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, make_server
from harness.serve.ports import PortAllocator

A, B, C = (Host(n, f"10.213.0.{i}", f"pdh-t-{n}") for i, n in ((2, "a"), (3, "b"), (4, "c")))


def test_d_across_two_nodes_is_a_leader_and_a_headless_follower(tmp_path):
    cfg = E2EConfig(tp_d=2, hosts=RunHosts(prefill=A, decode=B, decode_nodes=(C,)))
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        want = WantedServer(role="decode", tp=2, model="/m", served_name="tiny", block_size=32, cpu_bind="0|1")
        srv = make_server(cfg, alloc, want, tmp_path)
    lead = srv.proc.spec
    [(name, follower, shown)] = srv.followers
    assert name == "decode-node1" and follower.spec.health_url is None  # only rank 0 answers /health
    la, fa = list(lead.argv), list(follower.spec.argv)
    assert la[:4] == ["ip", "netns", "exec", "pdh-t-b"] and fa[:4] == ["ip", "netns", "exec", "pdh-t-c"]
    assert "harness.serve.headless" in fa and "--headless" in fa and "--headless" not in la
    port = la[la.index("--master-port") + 1]
    for argv, rank in ((la, "0"), (fa, "1")):
        assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--node-rank") + 1] == rank
        assert argv[argv.index("--master-addr") + 1] == "10.213.0.3" and argv[argv.index("--master-port") + 1] == port
        assert argv[argv.index("--tensor-parallel-size") + 1] == "2"
    assert lead.env["VLLM_HOST_IP"] == "10.213.0.3" and follower.spec.env["VLLM_HOST_IP"] == "10.213.0.4"
    assert lead.env["VLLM_CPU_OMP_THREADS_BIND"] == "0" and follower.spec.env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert str(tmp_path / "decode-node1.log") == str(follower.spec.log_path)
    assert "pdh-t-c" in shown


def test_p_and_the_baseline_stay_on_one_node(tmp_path):
    cfg = E2EConfig(tp_d=2, hosts=RunHosts(prefill=A, decode=B, decode_nodes=(C,)))
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        for role in ("prefill", "baseline"):
            tp = 2 if role == "baseline" else 1
            want = WantedServer(role=role, tp=tp, model="/m", served_name="tiny", block_size=32, cpu_bind=None)
            srv = make_server(cfg, alloc, want, tmp_path)
            assert srv.followers == () and "--nnodes" not in srv.proc.spec.argv


def test_d_tp_must_split_over_its_nodes():
    with pytest.raises(ConfigError, match="does not split evenly over its 2 nodes"):
        E2EConfig(tp_d=3, hosts=RunHosts(prefill=A, decode=B, decode_nodes=(C,))).validate()
