"""The baseline phase: a plain (non-disaggregated) server at D's TP answers the prompts (and lm-eval), alone.

Its answers may come from a cache instead: the pairs of one matrix share them in memory, and on CPU they are kept on
disk between runs (harness/cache/baseline.py, keyed by ``baseline_key.py``) unless ``--fresh-baseline`` or
``PD_HARNESS_NO_BASELINE_CACHE=1``.
"""

from __future__ import annotations

import contextlib
import os
import time
from dataclasses import dataclass
from typing import Any

import requests

from harness.accuracy.lm_eval import EvalRun
from harness.cache import baseline as disk
from harness.checks.spec_decode import Acceptance, acceptance
from harness.core import progress
from harness.run.baseline_key import key_inputs, new_meta
from harness.run.context import RunContext
from harness.run.launch import Server
from harness.run.load import baseline_load
from harness.run.prefix import baseline_prefix
from harness.run.simulated import simulated
from harness.serve.ports import PortAllocator
from harness.serve.procs import start_all
from harness.serve.prometheus import Sample, parse_metrics
from harness.serve.servers import AttachedServers
from harness.workload.client import CompletionRun, run_completions
from harness.workload.load_client import LoadRun


@dataclass
class BaselineResult:
    completions: CompletionRun
    eval: EvalRun | None = None
    load: LoadRun | None = None  # the load phase's prompts, at the same concurrency, without the cancelled ones
    prefix: CompletionRun | None = None  # the prefix-cache scenarios' prompts, one at a time (D's prefix cache on)
    origin: dict[str, Any] | None = None  # which run computed these answers and when (for a report that reuses them)
    # speculative decoding: the baseline's acceptance over the sequential prompts (None: not measured, and why)
    acceptance: Acceptance | None = None
    acceptance_note: str | None = None


@dataclass
class _DiskLookup:
    key: str | None = None  # None: the disk cache is not used for this baseline (info["reason"] says why)
    inputs: dict[str, Any] | None = None
    entry: disk.Entry | None = None
    info: dict[str, Any] | None = None


def run_baseline(
    ctx: RunContext,
    alloc: PortAllocator,
    block_size: int | None,
    cpu_bind: str | None,
    attached_url: str | None = None,
    cache: dict[tuple, BaselineResult] | None = None,
) -> BaselineResult:
    """The baseline's answers: from ``cache`` (shared by the pairs of one matrix) when it has them, from a server
    started elsewhere (``attached_url``), from the disk cache, or from one launched here on D's cores.
    ``config.baseline_cache`` of the report says which, and from which run."""
    cfg = ctx.cfg
    t0 = time.monotonic()
    if attached_url:  # a server someone else runs: nothing here knows what it loaded, so nothing is cached
        ctx.report.config["baseline_cache"] = {
            "used": False,
            "key": None,
            "reason": "attach mode: the baseline server was started elsewhere",
        }
        return _attached(ctx, attached_url, t0)
    base = ctx.server(alloc, "baseline", cfg.tp_d, block_size, cpu_bind)  # not started: its command is part of the keys
    # the command whose answers the run compares with, launched or not (a repro bundle starts it again)
    ctx.report.config["baseline_command"] = base.command
    server_id = disk.command_identity(base.proc.spec.argv, base.proc.spec.env)
    key = _memory_key(ctx, server_id, block_size)
    if cache is not None and key in cache:
        hit = cache[key]
        _not_launched(ctx)
        ctx.report.config["baseline_reused"] = True
        ctx.report.config["baseline_cache"] = {"used": True, "where": "memory", **(hit.origin or {})}
        return hit
    look = _lookup(ctx, server_id, block_size)
    if look.entry is not None and _restore_load_plan(ctx, look) and _restore_prefix_plan(ctx, look):
        result = _from_disk(ctx, look, t0)
    else:
        result = _launched(ctx, base, t0)
        result.origin = {"key": look.key, "from_run": str(ctx.run_dir), "created": None}
        ctx.report.config["baseline_cache"] = _store(ctx, look, result, base.command)
        if result.completions.failures:
            return result
    if cache is not None:
        cache[key] = result
    return result


def _memory_key(ctx: RunContext, server_id: dict[str, Any], block_size: int | None) -> tuple:
    """What makes two pairs of one matrix share their baseline's answers."""
    cfg = ctx.cfg
    return (
        ctx.model,
        cfg.tp_d,
        block_size,
        cfg.python,
        cfg.max_tokens,
        cfg.seed,
        cfg.device,
        ctx.accuracy,
        cfg.load,
        ctx.pool_blocks(block_size),
        cfg.model_len,
        disk.canonical(server_id),
        cfg.axes.prefix_caching_d,
    )


def _from_disk(ctx: RunContext, look: _DiskLookup, t0: float) -> BaselineResult:
    """The answers of the disk cache's entry ``look`` found; the server is not launched."""
    e = look.entry
    assert e is not None
    _not_launched(ctx)
    result = BaselineResult(e.completions, e.eval, e.load, e.prefix, origin=_origin(look.key, e.meta))
    ctx.timed("baseline_cache_read", t0)
    ctx.report.config["baseline_cache"] = {
        "used": True,
        "where": "disk",
        **(result.origin or {}),
        "entry": str(disk.entry_path(disk.cache_root(), look.key or "")),
        "source_timings_s": e.meta.get("timings_s", {}),
        **_notes(look),
    }
    progress.current().phase(
        f"baseline: answers from the cache, computed by {e.meta.get('from_run')} "
        f"at {e.meta.get('created')} (--fresh-baseline computes them again)"
    )
    return result


def _store(ctx: RunContext, look: _DiskLookup, result: BaselineResult, command: str) -> dict:
    """Write freshly computed answers to the disk cache where they may be; what happened, for the report."""
    info = look.info or {}
    if look.key is None:
        return info
    why_not = disk.cacheable(result)
    if why_not is not None:
        return {**info, "stored": False, "not_stored_because": why_not}
    meta = new_meta(ctx, command)
    try:
        assert look.inputs is not None
        disk.write_entry(
            disk.cache_root(),
            look.key,
            look.inputs,
            result,
            meta,
            ctx.load_requests,
            ctx.load_prompts,
            ctx.prefix_cases,
            ctx.prefix_prompts,
        )
    except (
        OSError,
        ValueError,
        TypeError,
    ) as e:  # a cache that cannot be written costs the next run time, not this one
        return {**info, "stored": False, "store_error": f"{type(e).__name__}: {e}"}
    result.origin = _origin(look.key, meta)
    return {**info, "stored": True}


def _origin(key: str | None, meta: dict[str, Any]) -> dict[str, Any]:
    return {"key": key, "from_run": meta.get("from_run"), "created": meta.get("created")}


def _notes(look: _DiskLookup) -> dict[str, Any]:
    note = ((look.inputs or {}).get("model") or {}).get("note")
    return {"model_note": note} if note else {}


def _not_launched(ctx: RunContext) -> None:
    # The server was built for its command line but never started: the report lists only what ran.
    ctx.report.commands.pop("baseline", None)
    ctx.report.logs.pop("baseline", None)


def _lookup(ctx: RunContext, server_id: dict[str, Any], block_size: int | None) -> _DiskLookup:
    """The disk cache's key and entry for this baseline; whatever goes wrong is a miss with its reason, never an
    error."""
    cfg = ctx.cfg
    if disk.disabled():
        return _DiskLookup(
            info={"used": False, "key": None, "reason": f"{disk.ENV_DISABLE}={os.environ.get(disk.ENV_DISABLE)}"}
        )
    if cfg.axes.speculative_config is not None:  # the entry holds answers, not the acceptance the check compares
        return _DiskLookup(
            info={"used": False, "key": None, "reason": "speculative decoding: the baseline's acceptance is measured"}
        )
    if cfg.device != "cpu":
        return _DiskLookup(
            info={
                "used": False,
                "key": None,
                "reason": "GPU baselines are not cached (their numerics depend on "
                "the GPU and the kernels it picks, which the key does not hold)",
            }
        )
    try:
        inputs = key_inputs(ctx, server_id, block_size)
    except Exception as e:  # noqa: BLE001 - e.g. the interpreter cannot report its environment: launch, as without a cache
        return _DiskLookup(info={"used": False, "key": None, "reason": f"no key: {type(e).__name__}: {e}"})
    key = disk.cache_key(inputs)
    vllm = (inputs.get("python") or {}).get("vllm") or {}
    if vllm.get("editable"):  # its source can change under the same version and installed-files list
        return _DiskLookup(
            info={"used": False, "key": None, "reason": "vLLM is an editable install: its answers are not cached"}
        )
    look = _DiskLookup(
        key,
        inputs,
        info={
            "used": False,
            "key": key,
            **({"model_note": inputs["model"]["note"]} if inputs["model"].get("note") else {}),
        },
    )
    if cfg.fresh_baseline:
        look.info["reason"] = "--fresh-baseline"  # type: ignore[index]
        return look
    try:
        look.entry = disk.read_entry(disk.cache_root(), key)
    except disk.CacheMiss as e:
        look.info["reason"] = str(e)  # type: ignore[index]
    except Exception as e:  # noqa: BLE001 - never let a cache end a run
        look.info["reason"] = f"entry unreadable: {type(e).__name__}: {e}"  # type: ignore[index]
    return look


def _restore_load_plan(ctx: RunContext, look: _DiskLookup) -> bool:
    """The cached answers are for the entry's load prompts: P/D must send the same ones. A run that has its own already
    (a matrix plans them on D first) uses the entry only if they are equal."""
    e = look.entry
    assert e is not None and look.info is not None
    if not ctx.cfg.load.enabled:
        return True
    if not ctx.load_requests:
        ctx.load_requests, ctx.load_prompts = list(e.load_requests), dict(e.load_prompts)
        return True
    if [r.to_dict() for r in ctx.load_requests] == [
        r.to_dict() for r in e.load_requests
    ] and ctx.load_prompts == e.load_prompts:
        return True
    look.info["reason"] = "the entry answered other load prompts than this run's"
    look.entry = None
    return False


def _restore_prefix_plan(ctx: RunContext, look: _DiskLookup) -> bool:
    """Likewise for D's prefix-cache scenarios: P/D must send the prompts the cached answers are for."""
    e = look.entry
    assert e is not None and look.info is not None
    if not ctx.cfg.axes.prefix_caching_d:
        return True
    if e.prefix is None or not e.prefix_cases:
        look.info["reason"] = "the entry has no prefix-cache scenario answers"
    elif not ctx.prefix_prompts:
        ctx.prefix_cases, ctx.prefix_prompts = list(e.prefix_cases), dict(e.prefix_prompts)
        return True
    elif ctx.prefix_cases == e.prefix_cases and ctx.prefix_prompts == e.prefix_prompts:
        return True
    else:
        look.info["reason"] = "the entry answered other prefix-cache prompts than this run's"
    look.entry = None
    return False


def _launched(ctx: RunContext, base: Server, t0: float) -> BaselineResult:
    if ctx.gpu is not None:
        ctx.gpu.before("baseline")
    with contextlib.ExitStack() as stack:
        ready = start_all([base.proc], stack, ctx.cfg.ready_timeout_s)
        ctx.report.timings_s["baseline_launch_to_ready"] = ready["baseline"]
        t1 = time.monotonic()
        before = _spec_metrics(ctx, base.url)
        result = BaselineResult(run_completions(base.url, ctx.served_name, ctx.prompts, ctx.gen, "baseline-"))
        if before is not None:
            result.acceptance, result.acceptance_note = _acceptance(base.url, before)
        ctx.timed("baseline_requests", t1)
        result.load = baseline_load(ctx, base.url)
        result.prefix = baseline_prefix(ctx, base.url)
        if ctx.accuracy is not None and not simulated(ctx):  # stand-ins would only be scored on their words
            result.eval = ctx.lm_eval(base.url, "baseline", [base.proc])
        t_stop = time.monotonic()
    ctx.report.timings_s["baseline_teardown"] = time.monotonic() - t_stop
    if ctx.gpu is not None:
        ctx.gpu.after("baseline", base.proc.seen_pids())
    ctx.timed("baseline_phase", t0)
    ctx.leftovers += base.proc.leftover_pids()
    return result


def _spec_metrics(ctx: RunContext, url: str) -> list[Sample] | None:
    """The baseline's /metrics before its prompts, when the run decodes speculatively (None: it does not, or unread)."""
    if ctx.cfg.axes.speculative_config is None or simulated(ctx):
        return None
    try:
        return _read_metrics(url)
    except requests.RequestException:
        return []


def _read_metrics(url: str) -> list[Sample]:
    r = requests.get(f"{url}/metrics", timeout=30)
    r.raise_for_status()
    return parse_metrics(r.text)


def _acceptance(url: str, before: list[Sample]) -> tuple[Acceptance | None, str | None]:
    try:
        after = _read_metrics(url)
    except requests.RequestException as e:
        return None, f"the baseline's /metrics could not be read: {type(e).__name__}"
    got = acceptance(before, after)
    return got, None if got is not None else "the baseline exports no spec-decode counters"


def _attached(ctx: RunContext, url: str, t0: float) -> BaselineResult:
    """A baseline server started elsewhere: the same requests (and lm-eval run), nothing launched."""
    base = AttachedServers([], [url], health_grace_s=ctx.cfg.health_grace_s)
    base.start(contextlib.ExitStack())
    result = BaselineResult(run_completions(url, ctx.served_name, ctx.prompts, ctx.gen, "baseline-"))
    ctx.timed("baseline_requests", t0)
    result.load = baseline_load(ctx, url)
    result.prefix = baseline_prefix(ctx, url)
    if ctx.accuracy is not None:
        result.eval = ctx.lm_eval(url, "baseline", [base])
    ctx.timed("baseline_phase", t0)
    return result
