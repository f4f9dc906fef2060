"""The P/D phase: P and D (launched here or attached) and the proxy, the prompts through the proxy while the
servers are watched, D's /metrics and the proxy's counters around them, the smoke check and lm-eval."""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import requests

from harness.accuracy.checks import check_through_pd
from harness.accuracy.lm_eval import EvalRun
from harness.checks import smoke, transfer
from harness.checks.check import Check
from harness.checks.leak import IdleWatch, state_of, wait_idle
from harness.hosts.faults import LinkCutter, NetFaultError, block_ports, dropped_packets
from harness.models.config import load_models
from harness.run.context import RunContext
from harness.run.load import PDLoad, pd_load
from harness.run.prefix import PDPrefix, pd_prefix
from harness.run.simulated import simulated
from harness.run.watch import run_watched
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
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
    with contextlib.ExitStack() as stack:
        for role, secs in servers.start(stack).items():
            ctx.report.timings_s[f"{role}_launch_to_ready"] = secs
        proxy, proxy_url = ctx.proxy(alloc, [ep.url for ep in servers.prefill], [ep.url for ep in servers.decode])
        ctx.report.timings_s["proxy_launch_to_ready"] = start_all([proxy], stack, 60)["proxy"]
        start_net_fault(ctx, stack, servers)
        watch = [servers, proxy]
        idle = {name: state_of(samples) for name, samples in server_metrics(servers).items()}
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
        # P's lease bounds how long it may keep a finished request's blocks; vLLM's default where none is set.
        lease = ctx.cfg.lease_s if ctx.cfg.lease_s is not None else VLLM_DEFAULT_LEASE_S
        out.idle = wait_idle(lambda: server_metrics(servers), idle, ctx.cfg.load.leak_deadline_s, lease)
        out.idle.cancels = dict((out.final_stats or {}).get("cancelled_ids") or {})
        out.idle.faulted = list((out.final_stats or {}).get("faulted_ids") or [])
        ctx.timed("pd_idle_wait", t_idle)
        t_stop = time.monotonic()
    if ctx.gpu is not None and isinstance(servers, LocalServers):
        ctx.gpu.after("pd", servers.seen_pids())
    ctx.report.timings_s["pd_teardown"] = time.monotonic() - t_stop
    ctx.timed("pd_phase", t0)
    ctx.leftovers += servers.leftover_pids() + proxy.leftover_pids()
    out.logs = servers.logs()  # after teardown, so the logs are complete
    return out


def start_net_fault(ctx: RunContext, stack: contextlib.ExitStack, servers: ServerSet) -> None:
    """--net-fault, put in place now (side-channel-blocked) or when the proxy holds a request (p-link-down); what it
    did, read back (or why it could not), goes into the report's config.net_fault_fired when the phase ends."""
    fault, p_host = ctx.cfg.net_fault, ctx.cfg.hosts.prefill
    if fault == "none" or not isinstance(servers, LocalServers):
        return
    if fault == "side-channel-blocked":
        first = int(servers.env_of("prefill")["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        rule = block_ports(p_host, first, ctx.cfg.tp_p)  # one port per P rank
        fired: dict[str, object] = {"fault": fault, "host": p_host.name, "rule": rule}

        def record_block() -> None:
            try:
                fired["dropped_packets"] = dropped_packets(p_host, first, ctx.cfg.tp_p)
            except NetFaultError as e:
                fired["error"] = str(e)
            ctx.report.config["net_fault_fired"] = fired

        stack.callback(record_block)
        return
    cutter = LinkCutter(p_host, ctx.hold_dir)

    def record_cut() -> None:
        cutter.stop()
        ctx.report.config["net_fault_fired"] = dict(cutter.fired) or {
            "fault": fault,
            "fired": False,
            "error": cutter.error,
        }

    cutter.start()
    stack.callback(record_cut)


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
