"""The P/D phase: P and D (launched here or attached) and the proxy, the prompts through the proxy while the
servers are watched, D's /metrics and the proxy's counters around them, the smoke check and lm-eval. With a
``--net-fault``, the fault; and when the phase fails (the fault's classified ending), the fault undone and P's blocks
followed back to idle before teardown. A fault that did not end the phase is undone as the phase ends."""

from __future__ import annotations

import abc
import contextlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import requests

from harness.accuracy.checks import check_through_pd
from harness.accuracy.lm_eval import EvalRun
from harness.checks import smoke, transfer
from harness.checks.check import Check
from harness.checks.kv_digest import DigestRecord, record_files
from harness.checks.kv_digest import load as load_digests
from harness.checks.leak import (
    FAULT_CHECK_NAME,
    LEASE_MARGIN_S,
    IdleWatch,
    ServerState,
    check_released_after_fault,
    state_of,
    states_of,
    wait_idle,
)
from harness.hosts.faults import LinkCutter, NetFaultError, block_ports, dropped_packets, unblock_ports
from harness.hosts.placement import Host
from harness.models.config import load_models
from harness.run.context import RunContext
from harness.run.load import PDLoad, pd_load
from harness.run.prefix import PDPrefix, pd_prefix
from harness.run.simulated import simulated
from harness.run.watch import run_watched
from harness.serve.ports import PortAllocator
from harness.serve.procs import ManagedProcess, start_all
from harness.serve.prometheus import Sample
from harness.serve.servers import LocalServers, MetricsUnavailable, ServerSet, decode_metrics, read_json, server_metrics
from harness.workload.client import CompletionRun, run_completions


@dataclass
class PDResult:
    completions: CompletionRun
    metrics_before: list[Sample]  # D's /metrics around the prompts
    metrics_after: list[Sample]
    proxy_stats: dict  # the proxy's counters after the prompts
    logs: dict[str, str]  # the servers' logs, read after teardown (empty for servers started elsewhere)
    attached: bool
    smoke: Check | None = None
    eval: EvalRun | None = None
    through: Check | None = None  # lm-eval's requests took the P/D path
    load: PDLoad | None = None
    prefix: PDPrefix | None = None  # the prefix-cache scenarios (D's prefix cache on)
    idle: IdleWatch | None = None  # P and D back to idle after the run
    final_stats: dict | None = None  # the proxy's counters at the end (faulted request ids among them)
    environs: dict[str, dict[str, str] | None] | None = None  # each server process's environment (None: attached)
    # the KV digest records P and D wrote, and each rank's reason for writing none (None: servers started elsewhere)
    digests: tuple[list[DigestRecord], list[str]] | None = None


def local_servers(
    ctx: RunContext, alloc: PortAllocator, block_sizes: tuple[int | None, int | None], binds: list[str | None]
) -> LocalServers:
    pre = ctx.server(alloc, "prefill", ctx.cfg.tp_p, block_sizes[0], binds[0])
    dec = ctx.server(alloc, "decode", ctx.cfg.tp_d, block_sizes[1], binds[1], ctx.cfg.kv_layout_d)
    return LocalServers(
        [(pre.url, pre.proc)],
        [(dec.url, dec.proc)],
        ctx.cfg.ready_timeout_s,
        stagger=ctx.gpu is not None and ctx.gpu.plan.stagger_start,
        followers=[(name, proc) for name, proc, _ in (*pre.followers, *dec.followers)],
        over_network=ctx.cfg.hosts.over_network,
    )


VLLM_DEFAULT_LEASE_S = 30  # nixl base_scheduler: kv_lease_duration


def run_pd(ctx: RunContext, alloc: PortAllocator, servers: ServerSet) -> PDResult:
    t0 = time.monotonic()
    if ctx.gpu is not None:
        ctx.gpu.before("pd")
    digest_dir = getattr(servers, "digest_dir", None) if servers.attached else None
    earlier = record_files(Path(digest_dir)) if digest_dir else frozenset()  # another run's records are not this one's
    with contextlib.ExitStack() as stack:
        for role, secs in servers.start(stack).items():
            ctx.report.timings_s[f"{role}_launch_to_ready"] = secs
        proxy, proxy_url = ctx.proxy(alloc, [ep.url for ep in servers.prefill], [ep.url for ep in servers.decode])
        ctx.report.timings_s["proxy_launch_to_ready"] = start_all([proxy], stack, 60)["proxy"]
        fault = start_net_fault(ctx, stack, servers)
        idle = states_of(server_metrics(servers))
        try:
            out = serve_pd(ctx, servers, proxy_url, [servers, proxy], idle)
        except Exception:
            if fault is not None and isinstance(servers, LocalServers):  # the fault's ending: servers still up
                after_fault(ctx, servers, proxy, fault, idle)
            raise  # the fault's own failure stays the run's class
        t_stop = time.monotonic()
    if ctx.gpu is not None and isinstance(servers, LocalServers):
        ctx.gpu.after("pd", servers.seen_pids())
    ctx.report.timings_s["pd_teardown"] = time.monotonic() - t_stop
    ctx.timed("pd_phase", t0)
    ctx.leftovers += servers.leftover_pids() + proxy.leftover_pids()
    out.logs = servers.logs()  # after teardown, so the logs are complete
    if not servers.attached and ctx.cfg.kv_digest:
        out.digests = load_digests(ctx.run_dir / "kv_digest")  # after teardown, so every record is written
    elif digest_dir and ctx.cfg.kv_digest:  # attached: written before each request's first token, so all are there
        out.digests = load_digests(Path(digest_dir), earlier)
    return out


def serve_pd(
    ctx: RunContext, servers: ServerSet, proxy_url: str, watch: list, idle: dict[str, ServerState]
) -> PDResult:
    """Everything the phase does with its servers up: the prompts, the counters, smoke, prefix, load, lm-eval, and
    P and D followed back to ``idle`` (read before the first request)."""
    before = decode_metrics(servers)
    t1 = time.monotonic()
    completions = watched_requests(ctx, proxy_url, watch)
    ctx.timed("pd_requests", t1)
    after = decode_metrics(servers)
    stats = proxy_stats(proxy_url, servers)
    out = PDResult(completions, before, after, stats, {}, servers.attached, smoke=smoke_check(ctx, proxy_url))
    if isinstance(servers, LocalServers):  # while they serve: engine cores and workers are up by now
        out.environs = servers.environs()
    out.prefix = pd_prefix(ctx, proxy_url, servers, watch)  # before the load churns D's cache
    out.load = pd_load(ctx, proxy_url, servers, watch)
    if ctx.accuracy is not None and not simulated(ctx):  # stand-ins would only be scored on their words
        acc_before = decode_metrics(servers)
        stats_before = proxy_stats(proxy_url, servers)
        out.eval = ctx.lm_eval(proxy_url, "pd", watch)
        stats_after = proxy_stats(proxy_url, servers)
        xfers = transfer.delta(acc_before, decode_metrics(servers), transfer.XFER_COUNT).delta
        out.through = check_through_pd(out.eval.n, stats_before, stats_after, xfers)
    out.final_stats = proxy_stats(proxy_url, servers)
    t_idle = time.monotonic()
    out.idle = wait_idle(lambda: server_metrics(servers), idle, ctx.cfg.load.leak_deadline_s, lease_of(ctx))
    out.idle.cancels = dict((out.final_stats or {}).get("cancelled_ids") or {})
    out.idle.faulted = list((out.final_stats or {}).get("faulted_ids") or [])
    ctx.timed("pd_idle_wait", t_idle)
    return out


def lease_of(ctx: RunContext) -> int:
    """P's lease bounds how long it may keep a finished request's blocks; vLLM's default where none is set."""
    return ctx.cfg.lease_s if ctx.cfg.lease_s is not None else VLLM_DEFAULT_LEASE_S


class NetFault(abc.ABC):
    """A --net-fault in place during the P/D phase. ``record`` puts what it did, read back, into the report's
    config.net_fault_fired (once); ``undo`` lifts it (raises NetFaultError unless it reads back undone); ``close`` at
    the phase's end does both where not done yet."""

    def __init__(self, ctx: RunContext, fired: dict[str, object]):
        self.ctx, self.fired, self._recorded = ctx, fired, False

    @abc.abstractmethod
    def _read(self) -> None:
        """What the fault did, into ``fired`` (no fault follows it)."""

    @abc.abstractmethod
    def _lift(self) -> None:
        """Lift the fault and read it back, into ``fired``."""

    def record(self) -> None:
        if self._recorded:
            return
        self._recorded = True
        self._read()
        self.ctx.report.config["net_fault_fired"] = self.fired

    def undo(self) -> None:
        self.record()
        self._lift()
        self.fired["undone"] = True

    def close(self) -> None:
        """Record, then undo unless done already: a fault that did not end the run is lifted with the phase, not left
        in P's namespace until the lab goes. Never raises (teardown goes on); an error is recorded."""
        self.record()
        if self.fired.get("undone") or "undo_error" in self.fired:
            return
        try:
            self.undo()
        except NetFaultError as e:
            self.fired["undo_error"] = str(e)


class PortBlock(NetFault):
    """side-channel-blocked: the DROP rule for P's side-channel ports (one per P rank), in place from creation."""

    def __init__(self, ctx: RunContext, host: Host, first: int, count: int):
        super().__init__(ctx, {"fault": ctx.cfg.net_fault, "host": host.name})
        self.host, self.first, self.count = host, first, count
        self.fired["rule"] = block_ports(host, first, count)

    def _read(self) -> None:
        """The rule's packet counter: before the rule is removed, or at teardown."""
        try:
            self.fired["dropped_packets"] = dropped_packets(self.host, self.first, self.count)
        except NetFaultError as e:
            self.fired["error"] = str(e)

    def _lift(self) -> None:
        self.fired["rules_after"] = unblock_ports(self.host, self.first, self.count)


class LinkCut(NetFault):
    """p-link-down: P's links cut by a thread when the proxy holds a request between hops."""

    def __init__(self, ctx: RunContext, host: Host):
        super().__init__(ctx, {})
        self.cutter = LinkCutter(host, ctx.hold_dir)
        self.cutter.start()

    def _read(self) -> None:
        """What the cutter did (or why it could not); stopped first, so no cut follows."""
        self.cutter.stop()
        self.fired = self.cutter.fired or {"fault": self.ctx.cfg.net_fault, "fired": False, "error": self.cutter.error}

    def _lift(self) -> None:
        self.fired.update(self.cutter.restore())


def start_net_fault(ctx: RunContext, stack: contextlib.ExitStack, servers: ServerSet) -> NetFault | None:
    """--net-fault, put in place now (side-channel-blocked) or when the proxy holds a request (p-link-down); what it
    did, read back (or why it could not), goes into the report's config.net_fault_fired, and it is undone, when the
    phase ends (before the servers stop)."""
    fault, p_host = ctx.cfg.net_fault, ctx.cfg.hosts.prefill
    if fault == "none" or not isinstance(servers, LocalServers):
        return None
    if fault == "side-channel-blocked":
        first = int(servers.env_of("prefill")["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        made: NetFault = PortBlock(ctx, p_host, first, ctx.cfg.tp_p)
    else:
        made = LinkCut(ctx, p_host)
    stack.callback(made.close)
    return made


def after_fault(ctx: RunContext, servers: LocalServers, proxy: ManagedProcess, fault: NetFault, idle: dict) -> None:
    """The fault ended the phase: record it, undo it, and follow P's blocks back to idle (P's /metrics only), as the
    check FAULT_CHECK_NAME or, where P cannot be read, a skipped check with why. Never raises: the fault's own
    failure is the run's story. Bounded by P's lease + LEASE_MARGIN_S."""
    t0 = time.monotonic()
    # P's lease expiring during the follow-up would read as the failure's cause (kv-lease-expired): keep the logs now
    ctx.failure_logs = ctx.read_logs()
    try:
        fault.record()
        # the run is over: no new request may reach P (or make it hold blocks) while its blocks are followed; killed,
        # not stopped, since a graceful stop waits its whole grace for the request the fault stranded
        proxy.kill()
        fault.undo()
        check = follow_p(ctx, servers, idle)
    except NetFaultError as e:
        fault.fired["undo_error"] = str(e)
        skip_fault_check(ctx, f"the fault could not be undone, so P cannot be read: {e}")
    except MetricsUnavailable as e:
        rc = servers.exited(e.source) if e.source in {ep.name for ep in servers.prefill} else None
        state = "its process still runs" if rc is None else f"its process exited ({rc})"
        skip_fault_check(ctx, f"P cannot be read after the fault was undone ({state}): {e.detail}")
    except Exception as e:  # a harness bug here must not hide the fault's failure
        skip_fault_check(ctx, f"P's blocks could not be followed: {type(e).__name__}: {e}")
    else:
        ctx.report.checks.append(check)
    ctx.timed("pd_fault_follow_up", t0)


def follow_p(ctx: RunContext, servers: LocalServers, idle: dict[str, ServerState]) -> Check:
    """P's blocks followed to idle: up to the leak deadline, then (blocks held, nothing running) until P's lease +
    a margin frees them. Each change of P's blocks or counters on the way goes into the check's data (``trace``)."""
    lease = lease_of(ctx)
    p_idle = {ep.name: idle[ep.name] for ep in servers.prefill}
    trace: list[dict] = []
    watch = wait_idle(
        traced(lambda: server_metrics(servers, servers.prefill, timeout_s=10.0, check=False), trace),
        p_idle,
        min(ctx.cfg.load.leak_deadline_s, lease + LEASE_MARGIN_S),
        lease,
    )
    logs = {name: text for name, text in servers.logs().items() if name in p_idle}
    return check_released_after_fault(watch, ctx.cfg.net_fault, logs, trace)


def traced(read: Callable[[], dict[str, list[Sample]]], trace: list[dict]) -> Callable[[], dict[str, list[Sample]]]:
    """``read``, appending to ``trace`` each server's state whenever it differs from the last one seen (with the
    seconds since the first read): when blocks were freed, and by what, without a line per poll."""
    t0 = time.monotonic()
    last: dict[str, dict] = {}

    def read_and_trace() -> dict[str, list[Sample]]:
        samples = read()
        for name, got in samples.items():
            s = state_of(got)
            point = {"running": s.running, "waiting": s.waiting, "kv_blocks": s.kv_blocks, "expired": s.expired}
            if last.get(name) != point:
                last[name] = point
                trace.append({"t_s": round(time.monotonic() - t0, 2), "server": name, **point})
        return samples

    return read_and_trace


def skip_fault_check(ctx: RunContext, reason: str) -> None:
    ctx.report.skipped_checks.append({"name": FAULT_CHECK_NAME, "reason": reason})


def watched_requests(ctx: RunContext, url: str, watch: list) -> CompletionRun:
    """The sequential prompts through the proxy while the servers are watched."""
    return run_watched(lambda: run_completions(url, ctx.served_name, ctx.prompts, ctx.gen, "pd-"), watch, "pd-requests")


def proxy_stats(proxy_url: str, servers: ServerSet) -> dict:
    try:
        return read_json(f"{proxy_url}/proxy/stats", "proxy")
    except MetricsUnavailable:
        servers.check(force=True)  # a dead server is the story, not the unread counters
        raise


def smoke_check(ctx: RunContext, proxy_url: str) -> Check | None:
    """ "The capital of France is" -> "Paris" through P/D, for trained chat models (after the counted requests)."""
    entry = load_models().find(ctx.model)
    if entry is None or entry.hub_id is None:
        ctx.report.skipped_checks.append(
            {
                "name": smoke.CHECK_NAME,
                "reason": f"{ctx.served_name} is not a trained chat model "
                "of configs/models.yaml; its answer would say nothing",
            }
        )
        return None
    try:
        r = requests.post(
            f"{proxy_url}/v1/completions", json=smoke.smoke_request(ctx.served_name), timeout=ctx.cfg.request_timeout_s
        )
    except requests.RequestException as e:
        return smoke.judge_smoke(None, f"{type(e).__name__}: {e}")
    if r.status_code != 200:
        return smoke.judge_smoke(None, f"HTTP {r.status_code}: {r.text[:300]}")
    return smoke.judge_smoke(smoke.completion_text(r.json()))
