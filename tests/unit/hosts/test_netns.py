import subprocess

import pytest

from harness.hosts.netns import NamespaceLab, hosts_problem, namespace_problem, plan_lab
from harness.hosts.placement import Host, RunHosts


def test_plan_gives_each_host_a_namespace_an_address_and_a_link():
    plan = plan_lab(["ctl", "a", "b"], tag="t1")
    assert [(h.name, h.address, h.netns) for h in plan.hosts] == [
        ("ctl", "10.213.0.1", "pdh-t1-ctl"),
        ("a", "10.213.0.2", "pdh-t1-a"),
        ("b", "10.213.0.3", "pdh-t1-b"),
    ]
    assert plan.switch == "pdh-t1-switch" and plan.namespaces[0] == plan.switch
    assert all(len(n) <= 15 for pair in plan.links for n in pair)


@pytest.mark.parametrize(
    "names, tag, words", [([], "t", "distinct"), (["a", "a"], "t", "distinct"), (["a"], "x" * 14, "15 characters")]
)
def test_plan_refuses_what_linux_would(names, tag, words):
    with pytest.raises(ValueError, match=words):
        plan_lab(names, tag)


def test_plan_refuses_more_hosts_than_the_subnet_holds():
    with pytest.raises(ValueError, match="room for 2 hosts"):
        plan_lab(["a", "b", "c"], "t", subnet="10.0.0.0/30")


def test_hosts_problem_names_a_missing_namespace():
    hosts = RunHosts(prefill=Host("a", "10.0.0.1", "pdh-none-such-a"), decode=Host("b", "127.0.0.1"))
    problem = hosts_problem(hosts)
    assert problem is not None and "pdh-none-such-a" in problem
    assert hosts_problem(RunHosts()) is None


NO_LAB = namespace_problem()


@pytest.mark.skipif(NO_LAB is not None, reason=f"cannot make network namespaces here: {NO_LAB}")
def test_a_lab_links_its_hosts_cuts_one_off_and_leaves_nothing():
    def reach(lab, src, dst):
        code = f"import socket; socket.create_connection(('{lab.hosts[dst].address}', 9), timeout=2)"
        out = subprocess.run(lab.hosts[src].wrap(["python3", "-c", code]), capture_output=True, text=True)
        return "ConnectionRefused" in out.stderr  # a host answered (nothing listens on port 9)

    with NamespaceLab(["a", "b"]) as lab:
        assert reach(lab, "a", "b")
        lab.link("b", up=False)
        assert not lab.link_is_up("b")
        assert not reach(lab, "a", "b")  # the fault took effect: b is cut off
        lab.link("b", up=True)
        assert reach(lab, "a", "b")
        made = lab.plan.namespaces
    assert lab.remaining() == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(n in listed for n in made)


def test_a_host_elsewhere_without_a_namespace_is_refused_with_the_way_out():
    hosts = RunHosts(prefill=Host("a", "192.0.2.10"), decode=Host("b", "127.0.0.1"))  # TEST-NET-1: never local
    problem = hosts_problem(hosts)
    assert problem is not None and "192.0.2.10" in problem and "attach mode" in problem
