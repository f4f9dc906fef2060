"""After a --net-fault ended the P/D phase: the fault recorded, undone, and P's blocks followed back to idle before
teardown, as a check or a skipped check with why (never a pass); the fault's own failure stays the run's."""

import contextlib
from pathlib import Path

import pytest

from harness.checks.leak import FAULT_CHECK_NAME, state_of
from harness.hosts.faults import NetFaultError
from harness.hosts.placement import hosts_from_dict
from harness.render.run_markdown import render_markdown
from harness.run import failures, pd
from harness.run.config import E2EConfig
from harness.run.context import RunContext
from harness.run.report import Report
from harness.serve.ports import PortAllocator
from harness.serve.procs import ProcessFailed
from harness.serve.prometheus import parse_metrics
from harness.serve.servers import Endpoint, LocalServers, ServerUnreachable
from harness.workload.client import GenerationSettings
from tests.helpers import TextServer
from tests.unit.checks.test_leak import metrics

POOL = 32768


class MetricsStandIn(TextServer):
    """P's /metrics, its text given per read by ``script`` (read count -> text)."""

    def __init__(self, script):
        self.script, self.reads = script, 0
        super().__init__(self.read)

    def read(self) -> str:
        self.reads += 1
        return self.script(self.reads)


@pytest.fixture
def p_metrics():
    made = []

    def start(script) -> MetricsStandIn:
        made.append(MetricsStandIn(script))
        return made[-1]

    yield start
    for m in made:
        m.close()


class FakeServers(LocalServers):
    """P at ``p_url`` (a stand-in /metrics); no process is started. ``rc``: P's exit code (None: it runs)."""

    def __init__(self, p_url: str, rc: int | None = None, log: str = ""):
        self.prefill = [Endpoint("prefill", p_url, "prefill")]
        self.decode = [Endpoint("decode", "http://127.0.0.1:9", "decode")]
        self.rc, self.log, self.checked = rc, log, 0

    def start(self, stack):
        return {}

    def check(self, force=False):
        self.checked += 1

    def exited(self, name):
        return self.rc

    def logs(self):
        return {"prefill": self.log, "decode": ""}

    def leftover_pids(self):
        return []


class FakeFault:
    """A fault whose record and undo are logged in ``events``; ``undo_error``: the undo fails; ``on_undo``: run at the
    undo (what the servers do once the fault is gone)."""

    def __init__(self, events: list, undo_error: str | None = None, on_undo=None):
        self.events, self.undo_error, self.on_undo = events, undo_error, on_undo
        self.fired: dict[str, object] = {"fault": "p-link-down"}

    def record(self):
        self.events.append("record")

    def undo(self):
        self.events.append("undo")
        if self.undo_error:
            raise NetFaultError(self.undo_error)
        if self.on_undo:
            self.on_undo()
        self.fired["undone"] = True


class FakeProxy:
    def __init__(self, events: list):
        self.events = events

    def kill(self):
        self.events.append("proxy killed")

    def leftover_pids(self):
        return []


NS_HOSTS = {  # P on a namespace host of its own, as a network fault needs (never created: the servers are fakes)
    "hosts": {
        "a": {"address": "10.201.0.2", "netns": "pdh-t-a"},
        "b": {"address": "10.201.0.3", "netns": "pdh-t-b"},
    },
    "prefill": "a",
    "decode": "b",
}


def make_ctx(tmp_path: Path) -> RunContext:
    cfg = E2EConfig(net_fault="p-link-down", kv_lease_s=30, hosts=hosts_from_dict(NS_HOSTS))
    return RunContext(cfg, tmp_path / "run", Report(config={}), [], GenerationSettings())


IDLE = {"prefill": state_of(parse_metrics(metrics(blocks=POOL))), "decode": state_of(parse_metrics(metrics()))}
LEASE_LINE = "WARNING Releasing expired KV blocks for request cmpl-pd-p02-0 which were retrieved by 0 remote worker(s)"


def test_the_fault_is_recorded_then_undone_then_ps_blocks_are_followed_to_idle(tmp_path, p_metrics):
    # P holds 2 blocks for two reads, then its lease frees them
    p = p_metrics(lambda n: metrics(usage=2 / POOL, blocks=POOL) if n < 3 else metrics(expired=2, blocks=POOL))
    events: list = []
    ctx, servers = make_ctx(tmp_path), FakeServers(p.url, log=LEASE_LINE)
    pd.after_fault(ctx, servers, FakeProxy(events), FakeFault(events), IDLE)  # type: ignore[arg-type]
    assert events == ["record", "proxy killed", "undo"]
    [check] = ctx.report.checks
    assert check.name == FAULT_CHECK_NAME and check.passed, check.detail
    assert check.data is not None
    assert check.data["lease_expiries"] == 2 and check.data["held_when_followed"]["prefill"]["kv_blocks"] == 2
    assert set(check.data["servers"]) == {"prefill"}  # P's /metrics only: D is not followed
    assert check.data["lease_s"] == 30 and check.data["expired_requests"][0]["request_id"] == "cmpl-pd-p02-0"
    assert servers.checked == 0 and ctx.report.skipped_checks == []
    assert "pd_fault_follow_up" in ctx.report.timings_s
    # the trace keeps each change, not each poll: 2 blocks held, then freed with 2 expiries
    trace = check.data["trace"]
    assert [(t["kv_blocks"], t["expired"]) for t in trace] == [(2, 0), (0, 2)] and p.reads == 3
    assert trace[0]["t_s"] <= trace[1]["t_s"] and trace[1]["server"] == "prefill"


def test_the_failure_is_classified_from_the_logs_as_they_were_before_the_follow_up(tmp_path, p_metrics):
    """P's lease expiring while its blocks are followed must not turn D's handshake-timeout into kv-lease-expired."""
    p = p_metrics(lambda n: metrics(blocks=POOL))
    d_log, p_log = tmp_path / "decode.log", tmp_path / "prefill.log"
    d_log.write_text(
        "zmq.error.Again: Resource temporarily unavailable\n"
        + "ERROR NIXL transfer failure: handshake_setup_failed\n" * 3
    )
    p_log.write_text("INFO serving\n")
    ctx = make_ctx(tmp_path)
    events: list[str] = []
    ctx.report.logs = {"prefill": str(p_log), "decode": str(d_log)}

    def lease_runs_out():
        p_log.write_text(p_log.read_text() + LEASE_LINE + "\n")

    fault = FakeFault(events, on_undo=lease_runs_out)
    pd.after_fault(ctx, FakeServers(p.url), FakeProxy(events), fault, IDLE)  # type: ignore[arg-type]
    fatal = ProcessFailed("decode", "fatal log line: handshake_setup_failed (seen 3 times)", None, d_log, "", True)
    assert failures.from_exception(fatal, ctx.logs_for_failure)["class"] == "handshake-timeout"
    assert failures.from_exception(fatal, ctx.read_logs)["class"] == "kv-lease-expired"  # what the logs say now


def test_a_fault_that_cannot_be_undone_is_a_skipped_check_never_a_pass(tmp_path, p_metrics):
    p = p_metrics(lambda n: metrics(blocks=POOL))
    events: list = []
    ctx, fault = make_ctx(tmp_path), FakeFault(events, undo_error="host a: links still down: ['pa1']")
    pd.after_fault(ctx, FakeServers(p.url), FakeProxy(events), fault, IDLE)  # type: ignore[arg-type]
    assert ctx.report.checks == [] and p.reads == 0  # P was not read through a fault still in place
    [skip] = ctx.report.skipped_checks
    assert skip["name"] == FAULT_CHECK_NAME and "could not be undone" in skip["reason"] and "pa1" in skip["reason"]
    assert fault.fired["undo_error"] == "host a: links still down: ['pa1']"


def test_a_p_that_died_is_a_skipped_check_with_its_exit_code(tmp_path):
    with PortAllocator() as alloc:
        dead = f"http://127.0.0.1:{alloc.port()}"  # nothing listens there
        ctx = make_ctx(tmp_path)
        events: list[str] = []
        servers = FakeServers(dead, rc=-9)
        pd.after_fault(ctx, servers, FakeProxy(events), FakeFault(events), IDLE)  # type: ignore[arg-type]
    assert ctx.report.checks == [] and servers.checked == 0  # a failed read names no other server's failure
    [skip] = ctx.report.skipped_checks
    assert "P cannot be read after the fault was undone (its process exited (-9))" in skip["reason"]


def test_run_pd_re_raises_the_faults_failure_after_the_follow_up(tmp_path, monkeypatch):
    events: list = []
    ctx, servers, fault = make_ctx(tmp_path), FakeServers("http://127.0.0.1:9"), FakeFault(events)
    failure = ServerUnreachable("prefill", "stopped answering /health over the network", None, None, "", True)

    def fails(*a):
        events.append("phase failed")
        raise failure

    monkeypatch.setattr(ctx, "proxy", lambda *a: (FakeProxy(events), "http://127.0.0.1:9"))
    monkeypatch.setattr(pd, "start_all", lambda *a: {"proxy": 0.1})
    monkeypatch.setattr(pd, "start_net_fault", lambda *a: fault)
    monkeypatch.setattr(
        pd,
        "server_metrics",
        lambda s, eps=None, **kw: (
            {"prefill": parse_metrics(metrics(blocks=POOL))}
            if eps is not None
            else {"prefill": parse_metrics(metrics(blocks=POOL)), "decode": parse_metrics(metrics())}
        ),
    )
    monkeypatch.setattr(pd, "serve_pd", fails)
    with pytest.raises(ServerUnreachable) as raised, PortAllocator() as alloc:
        pd.run_pd(ctx, alloc, servers)
    assert raised.value is failure  # the fault's own failure, untouched
    assert events == ["phase failed", "record", "proxy killed", "undo"]
    [check] = ctx.report.checks
    assert check.data is not None
    assert check.passed and check.data["outcome"] == "idle"
    # a failed run that carries the check renders: the failure leads, the check is in the table
    ctx.report.failure = {"class": "server-unreachable", "reason": "prefill: stopped answering", "excerpt": ""}
    md = render_markdown(ctx.report.to_dict())
    assert "**FAIL**" in md and "Reason: prefill: stopped answering" in md
    assert f"| {FAULT_CHECK_NAME} | pass |" in md and "Class: `server-unreachable`" in md


def test_without_a_fault_a_failed_phase_follows_nothing(tmp_path, monkeypatch):
    events: list = []
    ctx = make_ctx(tmp_path)
    monkeypatch.setattr(ctx, "proxy", lambda *a: (FakeProxy(events), "http://127.0.0.1:9"))
    monkeypatch.setattr(pd, "start_all", lambda *a: {"proxy": 0.1})
    monkeypatch.setattr(pd, "start_net_fault", lambda *a: None)
    monkeypatch.setattr(pd, "server_metrics", lambda *a, **kw: {})
    monkeypatch.setattr(pd, "serve_pd", lambda *a: (_ for _ in ()).throw(RuntimeError("boom")))
    with pytest.raises(RuntimeError, match="boom"), PortAllocator() as alloc:
        pd.run_pd(ctx, alloc, FakeServers("http://127.0.0.1:9"))
    assert events == [] and ctx.report.checks == [] and ctx.report.skipped_checks == []


class BlockRecorder:
    """Stands in for iptables in P's namespace (harness.run.pd's block_ports, unblock_ports, dropped_packets): each
    call is logged; ``refuse``: the removal does not read back gone."""

    def __init__(self, monkeypatch, refuse: str | None = None):
        self.calls: list[str] = []
        self.refuse = refuse
        monkeypatch.setattr(pd, "block_ports", self.block)
        monkeypatch.setattr(pd, "unblock_ports", self.unblock)
        monkeypatch.setattr(pd, "dropped_packets", lambda host, first, count: 4)

    def block(self, host, first, count):
        self.calls.append(f"block {first}+{count}")
        return f"-A INPUT -p tcp --dport {first} -j DROP"

    def unblock(self, host, first, count):
        self.calls.append(f"unblock {first}+{count}")
        if self.refuse:
            raise NetFaultError(self.refuse)
        return ["-P INPUT ACCEPT"]


class SideChannelServers(FakeServers):
    def __init__(self):
        super().__init__("http://127.0.0.1:9")

    def env_of(self, name):
        return {"VLLM_NIXL_SIDE_CHANNEL_PORT": "5600"}


def side_channel_ctx(tmp_path: Path) -> RunContext:
    cfg = E2EConfig(net_fault="side-channel-blocked", hosts=hosts_from_dict(NS_HOSTS))
    return RunContext(cfg, tmp_path / "run", Report(config={}), [], GenerationSettings())


def test_a_fault_that_did_not_end_the_phase_is_undone_as_the_phase_ends(tmp_path, monkeypatch):
    rec, ctx = BlockRecorder(monkeypatch), side_channel_ctx(tmp_path)
    with contextlib.ExitStack() as stack:
        fault = pd.start_net_fault(ctx, stack, SideChannelServers())
        assert fault is not None
        assert rec.calls == ["block 5600+1"]  # in place from the start
    assert rec.calls == ["block 5600+1", "unblock 5600+1"]  # lifted with the phase, not left for the lab's teardown
    fired = ctx.report.config["net_fault_fired"]
    assert fired is fault.fired and fired["undone"] and fired["dropped_packets"] == 4


def test_a_fault_already_undone_after_the_failure_is_not_undone_twice(tmp_path, monkeypatch):
    rec, ctx = BlockRecorder(monkeypatch, refuse="rule still there"), side_channel_ctx(tmp_path)
    with contextlib.ExitStack() as stack:
        fault = pd.start_net_fault(ctx, stack, SideChannelServers())
        assert fault is not None
        pd.after_fault(ctx, SideChannelServers(), FakeProxy([]), fault, IDLE)  # type: ignore[arg-type]
    assert rec.calls == ["block 5600+1", "unblock 5600+1"]  # the failed undo is recorded, not retried at teardown
    assert fault.fired["undo_error"] == "rule still there" and not fault.fired.get("undone")
    [skip] = ctx.report.skipped_checks
    assert "could not be undone" in skip["reason"]


def test_an_undo_that_fails_at_the_phase_end_is_recorded_and_teardown_goes_on(tmp_path, monkeypatch):
    BlockRecorder(monkeypatch, refuse="rule still there")
    ctx = side_channel_ctx(tmp_path)
    with contextlib.ExitStack() as stack:
        fault = pd.start_net_fault(ctx, stack, SideChannelServers())
        assert fault is not None
    assert fault.fired["undo_error"] == "rule still there"
