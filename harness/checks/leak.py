"""After a run, P and D must be idle again: no request running or waiting, KV usage back to its value before the
first request, no request whose KV lease expired. A server that keeps blocks after its requests ended leaks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

from harness.checks.check import Check
from harness.serve.prometheus import Sample, first_present, metric_sum

RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
KV_USAGE = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")  # the name changed between releases
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
# KV usage is a share of the pool; a gauge read while a block is being freed may lag by less than this.
KV_EPSILON = 1e-6


@dataclass(frozen=True)
class ServerState:
    running: float | None
    waiting: float | None
    kv_usage: float | None  # 0..1; None when this vLLM exports no usage gauge
    expired: float | None  # requests whose KV lease expired (P side)

    def to_dict(self) -> dict:
        return asdict(self)


def state_of(samples: list[Sample]) -> ServerState:
    usage = first_present(samples, KV_USAGE)
    return ServerState(metric_sum(samples, RUNNING), metric_sum(samples, WAITING), usage[1] if usage else None,
                       metric_sum(samples, EXPIRED))


def problems(name: str, s: ServerState, idle_kv: float | None) -> list[str]:
    out = []
    if s.running is None and s.waiting is None and s.kv_usage is None:
        return [f"{name} exports none of {RUNNING}, {WAITING}, {'/'.join(KV_USAGE)}"]
    if s.running:
        out.append(f"{name} still runs {s.running:g} request(s)")
    if s.waiting:
        out.append(f"{name} still has {s.waiting:g} waiting request(s)")
    if s.kv_usage is not None and s.kv_usage > (idle_kv or 0.0) + KV_EPSILON:
        out.append(f"{name} KV usage {100 * s.kv_usage:.2f}% (idle before the run: {100 * (idle_kv or 0.0):.2f}%)")
    if s.expired:
        out.append(f"{name} had {s.expired:g} request(s) whose KV lease expired")
    return out


def wait_idle(read: Callable[[], dict[str, list[Sample]]], idle_kv: dict[str, float | None], deadline_s: float,
              poll_s: float = 0.5, clock=time.monotonic, sleep=time.sleep) -> tuple[dict[str, ServerState], float]:
    """Poll ``read`` (server name -> /metrics) until every server is idle or ``deadline_s`` passed;
    the last states and the seconds waited."""
    t0 = clock()
    while True:
        states = {name: state_of(samples) for name, samples in read().items()}
        waited = clock() - t0
        if not any(problems(n, s, idle_kv.get(n)) for n, s in states.items()) or waited >= deadline_s:
            return states, waited
        sleep(poll_s)


def check_no_leak(states: dict[str, ServerState], idle_kv: dict[str, float | None], waited_s: float, deadline_s: float) -> Check:
    found = [p for n, s in states.items() for p in problems(n, s, idle_kv.get(n))]
    data = {"servers": {n: s.to_dict() for n, s in states.items()}, "idle_kv_usage": idle_kv, "waited_s": round(waited_s, 2)}
    if found:
        return Check("no_kv_leak", False, f"not idle {deadline_s:g} s after the last request: " + "; ".join(found), data)
    return Check("no_kv_leak", bool(states), f"{len(states)} servers idle {waited_s:.1f} s after the last request "
                 "(no request running or waiting, KV usage back to idle, no lease expired)" if states else "no server to check", data)
