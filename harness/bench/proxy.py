"""Proxy overhead: the harness's proxy against an upstream-design reference, over the same fast backend.

``python -m harness bench proxy`` starts one bench backend (serving both the
prefill and the decode role), the harness's proxy (``toy_proxy_server.py``,
started exactly as a run starts it) and the reference proxy, all as managed
processes on allocated ports. Then:

- latency at concurrency 1, in alternating blocks over three targets
  (the backend called directly with the same two hops a proxy makes, each
  proxy), so background load hits all three alike; a proxy's added latency is
  its percentile minus the direct percentile;
- throughput at each concurrency level, each measurement a fixed request count
  under a time limit, repeated in rounds with the order rotated, median taken.

The load generator is a raw asyncio HTTP/1.1 client with one keep-alive
connection per worker and pre-encoded requests, so on 2 cores it costs far
less than the proxies it measures.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.core.paths import REPO_ROOT
from harness.serve.ports import PortAllocator
from harness.serve.procs import ManagedProcess, ProcessSpec, start_all

DEFAULT_CONCURRENCY = (1, 10, 100)
TARGET_P50_ADDED_MS = 1.0  # at concurrency 1
TARGET_RATIO = 1.5  # toy / reference throughput
TARGET_RATIO_CONCURRENCY = 100
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4
CLIENT_BODY = {"model": "bench", "prompt": PROMPT, "max_tokens": 16, "temperature": 0}


# -- pure parts -------------------------------------------------------------------------------


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    if not values:
        raise ValueError("percentile of no values")
    if not 0 <= q <= 100:
        raise ValueError(f"q must be in 0..100, got {q}")
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def ratio(value: float | None, reference: float | None) -> float | None:
    if value is None or not reference:
        return None
    return value / reference


@dataclass(frozen=True)
class LatencyStats:
    samples: int
    p50_ms: float
    p99_ms: float
    mean_ms: float

    @classmethod
    def of(cls, seconds: list[float]) -> LatencyStats:
        ms = [1000 * s for s in seconds]
        return cls(len(ms), percentile(ms, 50), percentile(ms, 99), statistics.fmean(ms))


@dataclass(frozen=True)
class Level:
    """One throughput measurement: a fixed request count under a time limit."""

    concurrency: int
    requested: int
    completed: int
    errors: int
    elapsed_s: float
    hit_time_limit: bool

    @property
    def rps(self) -> float:
        return self.completed / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass
class TargetResult:
    name: str
    latency: LatencyStats | None = None
    levels: dict[int, list[Level]] = field(default_factory=dict)  # concurrency -> one Level per round

    def throughput_rps(self) -> dict[int, float]:
        return {c: statistics.median(lv.rps for lv in runs) for c, runs in sorted(self.levels.items()) if runs}


@dataclass(frozen=True)
class TargetCheck:
    name: str
    target: str
    value: float | None
    met: bool | None  # None: not measured in this run


def proxy_summary(res: TargetResult, direct: TargetResult, reference: TargetResult) -> dict:
    """The JSON of one proxy: added latency over the direct calls and throughput against the reference."""
    assert res.latency is not None and direct.latency is not None
    rps, ref_rps = res.throughput_rps(), reference.throughput_rps()
    return {
        "p50_ms": res.latency.p50_ms,
        "p99_ms": res.latency.p99_ms,
        "p50_added_ms": res.latency.p50_ms - direct.latency.p50_ms,
        "p99_added_ms": res.latency.p99_ms - direct.latency.p99_ms,
        "throughput_rps": {str(c): v for c, v in rps.items()},
        "throughput_ratio_vs_reference": {str(c): ratio(v, ref_rps.get(c)) for c, v in rps.items()},
        "runs": {str(c): [{**asdict(lv), "rps": lv.rps} for lv in runs] for c, runs in sorted(res.levels.items())},
        "latency_samples": res.latency.samples,
    }


def target_checks(summary: dict) -> list[TargetCheck]:
    toy = summary["proxies"]["toy"]
    p50 = toy["p50_added_ms"]
    r = toy["throughput_ratio_vs_reference"].get(str(TARGET_RATIO_CONCURRENCY))
    return [
        TargetCheck("toy_p50_added_ms_at_c1", f"< {TARGET_P50_ADDED_MS:g} ms", p50, p50 < TARGET_P50_ADDED_MS),
        TargetCheck(
            f"toy_throughput_ratio_at_c{TARGET_RATIO_CONCURRENCY}",
            f">= {TARGET_RATIO:g}x the reference",
            r,
            None if r is None else r >= TARGET_RATIO,
        ),
    ]


def summarize(direct: TargetResult, toy: TargetResult, reference: TargetResult, config: dict) -> dict:
    assert direct.latency is not None
    d: dict = {
        "config": config,
        "direct": {
            "p50_ms": direct.latency.p50_ms,
            "p99_ms": direct.latency.p99_ms,
            "throughput_rps": {str(c): v for c, v in direct.throughput_rps().items()},
        },
        "proxies": {
            "toy": proxy_summary(toy, direct, reference),
            "reference": proxy_summary(reference, direct, reference),
        },
    }
    d["targets"] = [asdict(t) for t in target_checks(d)]
    return d


def render(d: dict) -> str:
    cfg = d["config"]
    levels = [str(c) for c in cfg["concurrency"]]
    lines = [
        f"proxy benchmark: {cfg['requests']} requests per measurement, {cfg['rounds']} round(s), time limit "
        f"{cfg['time_limit_s']:g} s, load average before {cfg['load_average_before']} "
        f"after {cfg.get('load_average_after')}",
        f"direct (client -> backend, P hop then D hop): p50 {d['direct']['p50_ms']:.3f} ms, "
        f"p99 {d['direct']['p99_ms']:.3f} ms",
        "",
        f"{'proxy':<10} {'p50 added':>10} {'p99 added':>10} "
        + " ".join(f"{'c=' + c + ' req/s':>14}" for c in levels)
        + " "
        + " ".join(f"{'ratio c=' + c:>11}" for c in levels),
    ]
    rows = [("direct", None)] + list(d["proxies"].items())
    for name, p in rows:
        if p is None:
            rps = d["direct"]["throughput_rps"]
            lines.append(f"{name:<10} {'-':>10} {'-':>10} " + " ".join(f"{rps.get(c, 0):>14.0f}" for c in levels))
            continue
        ratios = " ".join(f"{_fmt(p['throughput_ratio_vs_reference'].get(c)):>11}" for c in levels)
        lines.append(
            f"{name:<10} {p['p50_added_ms']:>8.3f}ms {p['p99_added_ms']:>8.3f}ms "
            + " ".join(f"{p['throughput_rps'].get(c, 0):>14.0f}" for c in levels)
            + " "
            + ratios
        )
    lines.append("")
    for t in d["targets"]:
        status = "not measured" if t["met"] is None else ("MET" if t["met"] else "MISSED")
        lines.append(f"target {t['name']}: {t['target']}; measured {_fmt(t['value'])} -> {status}")
    return "\n".join(lines)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


# -- the load generator -----------------------------------------------------------------------


def request_bytes(host: str, port: int, path: str, body: dict, request_id: str | None = None) -> bytes:
    data = json.dumps(body).encode()
    rid = f"x-request-id: {request_id}\r\n" if request_id else ""
    return (
        f"POST {path} HTTP/1.1\r\nhost: {host}:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n{rid}\r\n"
    ).encode() + data


@dataclass(frozen=True)
class Target:
    """Where one logical request goes: one HTTP request per hop, sent in order on one connection."""

    name: str
    host: str
    port: int
    hops: tuple[bytes, ...]


def direct_target(host: str, port: int) -> Target:
    """The backend called as a proxy calls it: the prefill hop, then the decode hop with P's params."""
    from harness.bench.backend import KV_TRANSFER_PARAMS
    from harness.proxy.app import prefill_body

    p = request_bytes(host, port, "/v1/completions", prefill_body(CLIENT_BODY))
    d = request_bytes(host, port, "/v1/completions", {**CLIENT_BODY, "kv_transfer_params": KV_TRANSFER_PARAMS})
    return Target("direct", host, port, (p, d))


def proxy_target(name: str, host: str, port: int) -> Target:
    return Target(name, host, port, (request_bytes(host, port, "/v1/completions", CLIENT_BODY),))


class Conn:
    """One keep-alive HTTP/1.1 connection; reads Content-Length and chunked answers in full."""

    def __init__(self, host: str, port: int):
        self.host, self.port = host, port
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        self.reader, self.writer = await asyncio.open_connection(self.host, self.port)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()
        self.reader = self.writer = None

    async def send(self, raw: bytes) -> int:
        if self.writer is None:
            await self.open()
        assert self.reader is not None and self.writer is not None
        self.writer.write(raw)
        head = await self.reader.readuntil(b"\r\n\r\n")
        lines = head.decode("latin-1").split("\r\n")
        status = int(lines[0].split(" ", 2)[1])
        length, chunked, close = None, False, False
        for line in lines[1:]:
            name, _, value = line.partition(":")
            name, value = name.strip().lower(), value.strip().lower()
            if name == "content-length":
                length = int(value)
            elif name == "transfer-encoding":
                chunked = "chunked" in value
            elif name == "connection":
                close = value == "close"
        if chunked:
            while True:
                size = int((await self.reader.readline()).split(b";", 1)[0], 16)
                await self.reader.readexactly(size + 2)
                if size == 0:
                    break
        elif length is not None:
            await self.reader.readexactly(length)
        else:
            await self.reader.read()  # no length: the body ends with the connection
            close = True
        if close:
            self.close()
        return status

    async def call(self, target: Target) -> bool:
        """One logical request; True when every hop answered 200. A broken connection is reopened next time."""
        try:
            for raw in target.hops:
                if await self.send(raw) != 200:
                    return False
            return True
        except (OSError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ValueError, IndexError):
            self.close()
            return False


async def measure_latency(
    targets: list[Target], n: int, time_limit_s: float, warmup: int, block: int = 100
) -> dict[str, list[float]]:
    """Concurrency 1, in alternating blocks of ``block`` requests per target (order rotated each round): background
    load hits every target alike, and one target's leftover work (its access log, say) lands on its own next request
    rather than on another target's."""
    conns = {t.name: Conn(t.host, t.port) for t in targets}
    out: dict[str, list[float]] = {t.name: [] for t in targets}
    try:
        for t in targets:
            for _ in range(warmup):
                await conns[t.name].call(t)
        deadline = time.monotonic() + time_limit_s
        done, k = 0, 0
        while done < n and time.monotonic() < deadline:
            size = min(block, n - done)
            for t in targets[k:] + targets[:k]:
                conn, samples = conns[t.name], out[t.name]
                for _ in range(size):
                    t0 = time.perf_counter()
                    if await conn.call(t):
                        samples.append(time.perf_counter() - t0)
            done += size
            k = (k + 1) % len(targets)
    finally:
        for c in conns.values():
            c.close()
    return out


async def measure_throughput(target: Target, concurrency: int, n: int, time_limit_s: float) -> Level:
    """``n`` requests over ``concurrency`` connections, or fewer when the time limit ends the measurement."""
    conns = [Conn(target.host, target.port) for _ in range(concurrency)]
    await asyncio.gather(*(c.open() for c in conns))  # connection set-up is not part of the measurement
    issued = completed = errors = 0
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    last = t0

    async def worker(conn: Conn) -> None:
        nonlocal issued, completed, errors, last
        while issued < n and time.perf_counter() < deadline:
            issued += 1
            if await conn.call(target):
                completed += 1
            else:
                errors += 1
            last = time.perf_counter()

    try:
        await asyncio.wait_for(asyncio.gather(*(worker(c) for c in conns)), timeout=time_limit_s + 30)
    except asyncio.TimeoutError:
        pass  # a hung request: what completed so far still counts, over the time spent
    finally:
        for c in conns:
            c.close()
    return Level(concurrency, n, completed, errors, last - t0, issued < n)


async def run_load(
    direct: Target,
    toy: Target,
    reference: Target,
    requests: int,
    concurrency: list[int],
    rounds: int,
    time_limit_s: float,
    warmup: int,
) -> tuple[TargetResult, TargetResult, TargetResult]:
    targets = [direct, toy, reference]
    res = {t.name: TargetResult(t.name) for t in targets}
    lat = await measure_latency(targets, requests, time_limit_s, warmup)
    for t in targets:
        if not lat[t.name]:
            raise RuntimeError(f"no successful request to {t.name} at concurrency 1")
        res[t.name].latency = LatencyStats.of(lat[t.name])
    for c in concurrency:
        for r in range(rounds):
            k = r % len(targets)
            for t in targets[k:] + targets[:k]:
                res[t.name].levels.setdefault(c, []).append(await measure_throughput(t, c, requests, time_limit_s))
    return res["direct"], res["toy"], res["reference"]


def run_async(coro):
    """Run on uvloop when installed, like the servers under test."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro), "asyncio"
    loop = uvloop.new_event_loop()  # not asyncio.Runner: the project supports Python 3.10
    try:
        return loop.run_until_complete(coro), "uvloop"
    finally:
        loop.close()


# -- processes --------------------------------------------------------------------------------


def backend_proc(
    alloc: PortAllocator,
    logs: Path,
    name: str,
    ready_after_s: float = 0.0,
    ready_file: Path | None = None,
    python: str = sys.executable,
) -> tuple[ManagedProcess, str]:
    port = alloc.port()
    argv = [
        python,
        "-m",
        "harness.bench.backend",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ready-after",
        str(ready_after_s),
    ]
    if ready_file is not None:
        argv += ["--ready-file", str(ready_file)]
    url = f"http://127.0.0.1:{port}"
    spec = ProcessSpec(
        name=name,
        argv=argv,
        log_path=logs / f"{name}.log",
        cwd=REPO_ROOT,
        health_url=f"{url}/health",
        ready_timeout_s=60,
        stop_grace_s=5,
    )
    return ManagedProcess(spec), url


def reference_proc(
    alloc: PortAllocator, logs: Path, prefill: list[str], decode: list[str], python: str = sys.executable
) -> tuple[ManagedProcess, str]:
    port = alloc.port()
    argv = [
        python,
        "-m",
        "harness.bench.reference_proxy",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefill",
        *prefill,
        "--decode",
        *decode,
    ]
    url = f"http://127.0.0.1:{port}"
    spec = ProcessSpec(
        name="reference_proxy",
        argv=argv,
        log_path=logs / "reference_proxy.log",
        cwd=REPO_ROOT,
        health_url=f"{url}/healthcheck",
        ready_timeout_s=60,
        stop_grace_s=5,
    )
    return ManagedProcess(spec), url


def toy_proc(alloc: PortAllocator, logs: Path, prefill: list[str], decode: list[str]) -> tuple[ManagedProcess, str]:
    """The harness's proxy with the very command line a run uses."""
    from harness.run.launch import make_proxy

    return make_proxy(sys.executable, alloc, prefill, decode, logs, timeout_s=300.0, name="toy_proxy")


def host_port(url: str) -> tuple[str, int]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def run_proxy_bench(
    requests: int = 2000,
    concurrency: list[int] | None = None,
    rounds: int = 3,
    time_limit_s: float = 20.0,
    warmup: int = 50,
    log_dir: Path | None = None,
) -> dict:
    concurrency = list(concurrency or DEFAULT_CONCURRENCY)
    logs = Path(log_dir) if log_dir else Path(tempfile.mkdtemp(prefix="bench-proxy-"))
    load_before = [round(x, 2) for x in os.getloadavg()]
    with PortAllocator() as alloc, contextlib.ExitStack() as stack:
        backend, b_url = backend_proc(alloc, logs, "bench_backend")
        start_all([backend], stack, 60)
        toy, toy_url = toy_proc(alloc, logs, [b_url], [b_url])
        ref, ref_url = reference_proc(alloc, logs, [b_url], [b_url])
        start_all([toy, ref], stack, 60)
        (direct_res, toy_res, ref_res), loop = run_async(
            run_load(
                direct_target(*host_port(b_url)),
                proxy_target("toy", *host_port(toy_url)),
                proxy_target("reference", *host_port(ref_url)),
                requests,
                concurrency,
                rounds,
                time_limit_s,
                warmup,
            )
        )
        for p in (backend, toy, ref):
            p.check()  # a proxy that died during the measurement fails the benchmark with its log tail
    config = {
        "requests": requests,
        "concurrency": concurrency,
        "rounds": rounds,
        "time_limit_s": time_limit_s,
        "warmup": warmup,
        "client_loop": loop,
        "cpus": os.cpu_count(),
        "logs": str(logs),
        "load_average_before": load_before,
        "load_average_after": [round(x, 2) for x in os.getloadavg()],
    }
    return summarize(direct_res, toy_res, ref_res, config)
