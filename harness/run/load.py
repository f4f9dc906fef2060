"""The load phase: many unique prompts at a fixed concurrency through P/D, some cancelled by the client, each
answer compared with the baseline's; what the servers and the proxy saw around it, for the load checks.

The plan is made once per run (its prompts are token ids from the first server that is up); the baseline
answers the same prompts at the same concurrency, without the cancelled ones.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import requests

from harness.run.context import RunContext
from harness.run.watch import run_watched
from harness.serve.prometheus import Sample
from harness.serve.servers import ServerSet, read_json, server_metrics
from harness.workload.load import plan_load, token_prompts
from harness.workload.load_client import LoadRun, run_load

# A prefill abort closes the connection this share of P's median prefill-hop time after sending: inside P's work.
PREFILL_ABORT_SHARE = 0.5
MIN_PREFILL_ABORT_S = 0.002


@dataclass
class PDLoad:
    run: LoadRun
    prefill_abort_s: float
    stats_before: dict
    stats_after: dict
    metrics_after: dict[str, list[Sample]] = field(default_factory=dict)  # by server name (prefill, decode[i], ...)


def prepare(ctx: RunContext, url: str) -> None:
    """Plan the load phase and turn its prompts into token ids with ``url``'s tokenizer (once per run)."""
    if not ctx.cfg.load.enabled or ctx.load_requests:
        return
    bs = ctx.cfg.block_sizes()[1] or 16
    reqs = plan_load(ctx.cfg.load, bs, ctx.cfg.model_len, ctx.cfg.max_tokens, ctx.cfg.seed)
    ctx.load_prompts = token_prompts(reqs, tokenizer(url, ctx.served_name), ctx.cfg.seed)
    ctx.load_requests = reqs


def tokenizer(url: str, model: str) -> Callable[[str], list[int]]:
    """A served model's tokenizer through its server's /tokenize (text -> ids, BOS included where the model adds
    one)."""

    def tokenize(text: str) -> list[int]:
        r = requests.post(f"{url}/tokenize", json={"model": model, "prompt": text}, timeout=60)
        r.raise_for_status()
        return list(r.json()["tokens"])

    return tokenize


def baseline_load(ctx: RunContext, url: str) -> LoadRun | None:
    if not ctx.cfg.load.enabled:
        return None
    prepare(ctx, url)
    t0 = time.monotonic()
    out = run_load(
        url,
        ctx.served_name,
        ctx.load_requests,
        ctx.load_prompts,
        ctx.gen,
        ctx.cfg.load.concurrency,
        run_tag="baseline-",
        with_aborts=False,
    )
    ctx.timed("baseline_load", t0)
    return out


def pd_load(ctx: RunContext, proxy_url: str, servers: ServerSet, watch: list) -> PDLoad | None:
    """The load through the proxy while the servers are watched (a dead server ends it at once)."""
    if not ctx.cfg.load.enabled:
        return None
    prepare(ctx, servers.decode[0].url)
    before = read_json(f"{proxy_url}/proxy/stats", "proxy")
    hops = before.get("prefill_hop_ms") or []
    abort_s = max(MIN_PREFILL_ABORT_S, PREFILL_ABORT_SHARE * statistics.median(hops) / 1000) if hops else 0.02
    t0 = time.monotonic()
    run = run_watched(
        lambda: run_load(
            proxy_url,
            ctx.served_name,
            ctx.load_requests,
            ctx.load_prompts,
            ctx.gen,
            ctx.cfg.load.concurrency,
            abort_s,
            "pd-",
        ),
        watch,
        "pd-load",
    )
    ctx.timed("pd_load", t0)
    after = read_json(f"{proxy_url}/proxy/stats", "proxy")
    return PDLoad(run, abort_s, before, after, server_metrics(servers))
