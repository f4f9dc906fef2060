"""The prefix-cache scenarios (runs with D's prefix cache on): cold, full hit, partial hit and block-edge prompts
through P/D one at a time, D's prompt-token sources read around each; the baseline answers the same prompts.

The prompts are token ids made once per run (from the first server up); the split each request must show is
predicted from them (harness/workload/prefix.py) and judged in harness/checks/prefix_cache.py.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from harness.checks.prefix_cache import Sourced
from harness.checks.transfer import TOKENS_BY_SOURCE
from harness.run.context import RunContext
from harness.run.load import tokenizer
from harness.run.watch import run_watched
from harness.serve.prometheus import metric_sum
from harness.serve.servers import ServerSet, decode_metrics
from harness.workload.client import CompletionRun, TokenPrompt, run_completions
from harness.workload.load import unique_token_prompts
from harness.workload.prefix import (
    SOURCES,
    base_lengths,
    case_prompts,
    expected_sources,
    plan_prefix,
)

COUNTED_WITHIN_S = 5.0  # D's counters are updated as the request's first step is recorded: shortly after the answer


@dataclass
class PDPrefix:
    run: CompletionRun
    sourced: list[Sourced]


def prepare(ctx: RunContext, url: str) -> list[TokenPrompt]:
    """The scenario prompts as token ids from ``url``'s tokenizer (made once per run)."""
    if not ctx.prefix_prompts:
        cases = plan_prefix(ctx.cfg.block_sizes()[1] or 16)
        bases = unique_token_prompts(base_lengths(cases), tokenizer(url, ctx.served_name), ctx.cfg.seed)
        ctx.prefix_cases = cases
        ctx.prefix_prompts = case_prompts(cases, bases)
    return [TokenPrompt(c.id, ctx.prefix_prompts[c.id]) for c in ctx.prefix_cases]


def baseline_prefix(ctx: RunContext, url: str) -> CompletionRun | None:
    if not ctx.cfg.axes.prefix_caching_d:
        return None
    t0 = time.monotonic()
    out = run_completions(url, ctx.served_name, prepare(ctx, url), ctx.gen, "baseline-prefix-")
    ctx.timed("baseline_prefix", t0)
    return out


def pd_prefix(ctx: RunContext, proxy_url: str, servers: ServerSet, watch: list) -> PDPrefix | None:
    """The scenarios through the proxy, D's counters read before and after each request."""
    if not ctx.cfg.axes.prefix_caching_d:
        return None
    prompts = prepare(ctx, servers.decode[0].url)
    measured: dict[str, dict[str, float] | None] = {}

    def around(prompt_id: str):
        before = sources(servers)
        n = len(ctx.prefix_prompts[prompt_id])

        def after() -> None:
            measured[prompt_id] = counted(servers, before, n)

        return after

    t0 = time.monotonic()
    run = run_watched(
        lambda: run_completions(proxy_url, ctx.served_name, prompts, ctx.gen, "pd-prefix-", around), watch, "pd-prefix"
    )
    ctx.timed("pd_prefix", t0)
    expected = expected_sources([p.text for p in prompts], ctx.cfg.block_sizes()[1] or 16)
    sourced = [Sourced(c, e, measured.get(c.id)) for c, e in zip(ctx.prefix_cases, expected, strict=True)]
    return PDPrefix(run, sourced)


def sources(servers: ServerSet) -> dict[str, float] | None:
    """D's prompt tokens so far by source, summed over its servers (None: this vLLM does not export them)."""
    samples = decode_metrics(servers)  # D only: P's counters say nothing of where D took its tokens
    total = {s: metric_sum(samples, TOKENS_BY_SOURCE, source=s) for s in SOURCES}
    return None if any(v is None for v in total.values()) else total  # type: ignore[return-value]


def counted(servers: ServerSet, before: dict[str, float] | None, n_tokens: int) -> dict[str, float] | None:
    """What the request added to each source, once all of its ``n_tokens`` prompt tokens are counted."""
    if before is None:
        return None
    deadline = time.monotonic() + COUNTED_WITHIN_S
    while True:
        now = sources(servers)
        if now is None:
            return None
        grown = {s: now[s] - before[s] for s in SOURCES}
        if sum(grown.values()) >= n_tokens or time.monotonic() > deadline:
            return grown
        time.sleep(0.05)
