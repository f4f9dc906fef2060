"""The P/D servers of a run, wherever they come from.

Two providers of one interface: ``LocalServers`` launches vLLM here (and owns the
processes), ``AttachedServers`` uses servers started elsewhere (another node,
Kubernetes, Ray) by URL. The pipeline runs the proxy, the requests, the proof
of transfer and the report the same way against either.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import psutil
import requests

from harness.serve.procs import ManagedProcess, ProcessFailed, http_ok, start_all
from harness.serve.prometheus import Sample, parse_metrics


@dataclass(frozen=True)
class Endpoint:
    role: str  # prefill, decode or baseline
    url: str
    name: str  # unique in the run: "decode", or "decode[1]" when there are several


def endpoints(role: str, urls: Sequence[str]) -> list[Endpoint]:
    return [Endpoint(role, u.rstrip("/"), role if len(urls) == 1 else f"{role}[{i}]") for i, u in enumerate(urls)]


class ServerSet(Protocol):
    prefill: list[Endpoint]
    decode: list[Endpoint]
    attached: bool

    def start(self, stack: contextlib.ExitStack) -> dict[str, float]: ...  # launch->ready seconds by name
    def check(self, force: bool = False) -> None: ...  # raise ProcessFailed for a server that died or logged a fatal line
    def logs(self) -> dict[str, str]: ...  # name -> log text (empty for servers we did not start)
    def leftover_pids(self) -> list[int]: ...


class LocalServers:
    """Servers this run launches and owns (``procs`` are not started yet)."""

    attached = False

    def __init__(self, prefill: list[tuple[str, ManagedProcess]], decode: list[tuple[str, ManagedProcess]], ready_timeout_s: float,
                 stagger: bool = False):
        pre, dec = self._pairs("prefill", prefill), self._pairs("decode", decode)
        self._procs = {ep.name: proc for ep, proc in pre + dec}
        self.prefill = [ep for ep, _ in pre]
        self.decode = [ep for ep, _ in dec]
        self.ready_timeout_s = ready_timeout_s
        # Colocated GPU servers start one after another: vLLM sizes its KV cache from the memory free while it profiles.
        self.stagger = stagger

    @staticmethod
    def _pairs(role: str, items: list[tuple[str, ManagedProcess]]) -> list[tuple[Endpoint, ManagedProcess]]:
        return list(zip(endpoints(role, [url for url, _ in items]), [p for _, p in items]))

    @property
    def processes(self) -> list[ManagedProcess]:
        return list(self._procs.values())

    def start(self, stack: contextlib.ExitStack) -> dict[str, float]:
        if not self.stagger:
            return start_all(self.processes, stack, self.ready_timeout_s)
        ready: dict[str, float] = {}
        for p in self.processes:
            ready.update(start_all([p], stack, self.ready_timeout_s))
        return ready

    def check(self, force: bool = False) -> None:
        for p in self.processes:
            p.check()

    def logs(self) -> dict[str, str]:
        return {name: p.log_text() for name, p in self._procs.items()}

    def leftover_pids(self) -> list[int]:
        return [pid for p in self.processes for pid in p.leftover_pids()]

    def seen_pids(self) -> list[int]:
        return [pid for p in self.processes for pid in p.seen_pids()]

    def environs(self) -> dict[str, dict[str, str] | None]:
        """Each live process of every server's tree -> its environment (None where it cannot be read)."""
        out: dict[str, dict[str, str] | None] = {}
        for name, proc in self._procs.items():
            if proc.pid is None:
                continue
            try:
                tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
            except psutil.Error:
                continue
            for p in tree:
                try:
                    env = dict(p.environ())
                except psutil.NoSuchProcess:  # it exited meanwhile: nothing left to report
                    continue
                except psutil.Error:
                    env = None
                # vLLM names its engine and worker processes with setproctitle, which may reuse the memory that
                # /proc/<pid>/environ shows: without PATH it is no environment, so it counts as unreadable.
                out[f"{name} pid {p.pid}"] = env if env and "PATH" in env else None
        return out


class AttachedServers:
    """Servers started elsewhere: readiness and liveness from /health, proof of transfer from /metrics only."""

    attached = True
    MISSES = 2  # consecutive failed /health probes before a server counts as gone (one slow answer is no death)

    def __init__(self, prefill_urls: Sequence[str], decode_urls: Sequence[str], ready_timeout_s: float = 60.0, probe_every_s: float = 1.0):
        self.prefill = endpoints("prefill", prefill_urls)
        self.decode = endpoints("decode", decode_urls)
        self.ready_timeout_s = ready_timeout_s
        self.probe_every_s = probe_every_s
        self._misses: dict[str, int] = {}
        self._last_probe = 0.0

    @property
    def all(self) -> list[Endpoint]:
        return self.prefill + self.decode

    def start(self, stack: contextlib.ExitStack) -> dict[str, float]:
        """Nothing to launch: wait (briefly) until every server answers /health."""
        t0 = time.monotonic()
        pending = list(self.all)
        while pending:
            pending = [ep for ep in pending if not http_ok(f"{ep.url}/health")]
            if pending and time.monotonic() - t0 > self.ready_timeout_s:
                ep = pending[0]
                raise ProcessFailed(ep.name, f"{ep.url}/health did not answer 200 within {self.ready_timeout_s:.0f} s",
                                    None, None, "")
            if pending:
                time.sleep(0.2)
        return {}

    def check(self, force: bool = False) -> None:
        """Probe /health at most once per ``probe_every_s``; ``force`` probes now, as often as it takes to decide."""
        now = time.monotonic()
        if not force and now - self._last_probe < self.probe_every_s:
            return
        self._last_probe = now
        for _ in range(self.MISSES if force else 1):
            for ep in self.all:
                self._misses[ep.name] = 0 if http_ok(f"{ep.url}/health") else self._misses.get(ep.name, 0) + 1
                if self._misses[ep.name] >= self.MISSES:
                    raise ProcessFailed(ep.name, f"{ep.url} stopped answering /health", None, None, "", after_ready=True)
            if force and not any(self._misses.values()):
                return
            if force:
                time.sleep(0.3)

    def logs(self) -> dict[str, str]:
        return {}

    def leftover_pids(self) -> list[int]:
        return []


class MetricsUnavailable(RuntimeError):
    """A live server's /metrics (or the proxy's stats) could not be read."""

    def __init__(self, source: str, detail: str):
        self.source, self.detail = source, detail
        super().__init__(f"{source}: {detail}")


def read_json(url: str, source: str, timeout_s: float = 30.0) -> dict:
    try:
        r = requests.get(url, timeout=timeout_s)
        r.raise_for_status()
        return r.json()
    except (requests.RequestException, ValueError) as e:
        raise MetricsUnavailable(source, f"GET {url}: {type(e).__name__}: {e}") from None


def decode_metrics(servers: ServerSet, timeout_s: float = 30.0) -> list[Sample]:
    """Every decode server's /metrics in one list (the proof sums over them). A dead server fails as such first."""
    out: list[Sample] = []
    for ep in servers.decode:
        try:
            r = requests.get(f"{ep.url}/metrics", timeout=timeout_s)
            r.raise_for_status()
        except requests.RequestException as e:
            servers.check(force=True)  # a server that died is the real story: say so, with its log
            raise MetricsUnavailable(ep.name, f"GET {ep.url}/metrics: {type(e).__name__}: {e}") from None
        out += parse_metrics(r.text)
    return out


@dataclass(frozen=True)
class Attach:
    """Attach mode: the servers of the run were started elsewhere and are given by URL."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    baseline_url: str | None = None  # None: the harness launches the baseline here

    def to_dict(self) -> dict:
        return {"prefill_urls": list(self.prefill_urls), "decode_urls": list(self.decode_urls), "baseline_url": self.baseline_url}


def served_model(url: str, timeout_s: float = 30.0) -> tuple[str, str]:
    """(model path or hub id, served name) of a running vLLM server, from its /v1/models."""
    data = read_json(f"{url.rstrip('/')}/v1/models", url, timeout_s).get("data") or []
    if not data:
        raise MetricsUnavailable(url, "/v1/models lists no model")
    return str(data[0].get("root") or data[0]["id"]), str(data[0]["id"])
