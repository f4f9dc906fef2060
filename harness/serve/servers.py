"""The P/D servers of a run, wherever they come from.

Two providers of one interface: ``LocalServers`` launches vLLM here (and owns the
processes), ``AttachedServers`` uses servers started elsewhere (another node,
Kubernetes, Ray) by URL. The pipeline runs the proxy, the requests, the proof
of transfer and the report the same way against either.
"""

from __future__ import annotations

import contextlib
import re
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from datetime import datetime
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
    def check(
        self, force: bool = False
    ) -> None: ...  # raise ProcessFailed for a server that died or logged a fatal line
    def logs(self) -> dict[str, str]: ...  # name -> log text (empty for servers we did not start)
    def leftover_pids(self) -> list[int]: ...


class LocalServers:
    """Servers this run launches and owns (``procs`` are not started yet)."""

    attached = False

    def __init__(
        self,
        prefill: list[tuple[str, ManagedProcess]],
        decode: list[tuple[str, ManagedProcess]],
        ready_timeout_s: float,
        stagger: bool = False,
        followers: Sequence[tuple[str, ManagedProcess]] = (),
        over_network: bool = False,
    ):
        pre, dec = self._pairs("prefill", prefill), self._pairs("decode", decode)
        self._procs = {ep.name: proc for ep, proc in pre + dec}
        # nodes of a TP group across hosts that serve no API of their own: owned, watched and stopped like the rest
        self._procs.update(dict(followers))
        # servers on other hosts: a live process is not enough, the harness must still reach them
        self._watch = HealthWatch([ep for ep, _ in pre + dec]) if over_network else None
        self.prefill = [ep for ep, _ in pre]
        self.decode = [ep for ep, _ in dec]
        self.ready_timeout_s = ready_timeout_s
        # Colocated GPU servers start one after another: vLLM sizes its KV cache from the memory free while it profiles.
        self.stagger = stagger

    @staticmethod
    def _pairs(role: str, items: list[tuple[str, ManagedProcess]]) -> list[tuple[Endpoint, ManagedProcess]]:
        return list(zip(endpoints(role, [url for url, _ in items]), [p for _, p in items], strict=True))

    @property
    def processes(self) -> list[ManagedProcess]:
        return list(self._procs.values())

    def start(self, stack: contextlib.ExitStack) -> dict[str, float]:
        ready: dict[str, float] = {}
        if not self.stagger:
            ready = start_all(self.processes, stack, self.ready_timeout_s)
        else:
            for p in self.processes:
                ready.update(start_all([p], stack, self.ready_timeout_s))
        if self._watch is not None:  # every server answered just now: their silence counts from here
            self._watch.arm()
        return ready

    def check(self, force: bool = False) -> None:
        for p in self.processes:
            p.check()
        gone = self._watch.probe(force) if self._watch is not None else None
        if gone is not None:
            proc = self._procs[gone.endpoint.name]
            raise ServerUnreachable(
                gone.endpoint.name,
                f"{gone.describe()} (over the network, while its process runs)",
                None,
                proc.spec.log_path,
                proc.log_text()[-2000:],
                after_ready=True,
            )

    def logs(self) -> dict[str, str]:
        return {name: p.log_text() for name, p in self._procs.items()}

    def exited(self, name: str) -> int | None:
        """``name``'s exit code once its process ended; None while it runs."""
        return self._procs[name].returncode

    def env_of(self, name: str) -> Mapping[str, str]:
        """The environment ``name`` was started with (e.g. its NIXL side-channel port)."""
        return self._procs[name].spec.env

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


# How long a server may answer no /health before it counts as gone: attached servers (generous: a live server on a
# loaded box answers late, and a death no one saw must not be stated), and servers launched here on another host
# (their process is watched too; the network is what this watch is for).
ATTACHED_HEALTH_GRACE_S = 30.0
NETWORK_HEALTH_GRACE_S = 4.0


def _seconds(s: float) -> str:
    return f"{s:.0f}" if s >= 10 else f"{s:.1f}"


@dataclass(frozen=True)
class Silence:
    """An endpoint that answered no /health for ``silent_s`` >= ``grace_s``; ``last_answer``: wall time of its last
    answer (or of the moment it was found ready)."""

    endpoint: Endpoint
    silent_s: float
    last_answer: float
    grace_s: float

    def describe(self) -> str:
        at = datetime.fromtimestamp(self.last_answer).strftime("%Y-%m-%d %H:%M:%S")
        return (
            f"{self.endpoint.url} stopped answering /health: no answer to /health for {_seconds(self.silent_s)} s "
            f"(grace {_seconds(self.grace_s)} s); last answer at {at}"
        )


@dataclass
class _Health:
    """One endpoint's /health as the watch saw it (monotonic times, and the wall time of the last answer)."""

    last_ok: float
    last_ok_wall: float
    last_probe: float = float("-inf")
    probing: bool = False


class HealthWatch:
    """Liveness over the network: a server is unresponsive, not dead, until it has answered no /health for
    ``grace_s``. Each probe runs in a thread of its own with the grace as its timeout, so a slow answer still counts
    when it comes and a slow server never stalls the watch (nor the watch of the other servers)."""

    def __init__(
        self, endpoints: Sequence[Endpoint], probe_every_s: float = 1.0, grace_s: float = NETWORK_HEALTH_GRACE_S
    ):
        self.endpoints = list(endpoints)
        self.probe_every_s = probe_every_s
        self.grace_s = grace_s
        self._lock = threading.Lock()
        self._state: dict[str, _Health] = {}

    def arm(self) -> None:
        """Every endpoint answered just now (it is ready): its silence counts from here."""
        now, wall = time.monotonic(), time.time()
        with self._lock:
            self._state = {ep.name: _Health(now, wall) for ep in self.endpoints}

    def probe(self, force: bool = False) -> Silence | None:
        """Ask each endpoint's /health at most once per ``probe_every_s`` (without waiting for the answers) and return
        the first endpoint silent for the grace, or None. ``force``: ask now, and wait until each has answered since,
        or one has been silent for the grace."""
        if not self._state:
            self.arm()
        asked = time.monotonic()
        self._ask(0.0 if force else self.probe_every_s)
        while True:
            gone = self._silent()
            if gone is not None or not force:
                return gone
            with self._lock:
                if all(h.last_ok >= asked for h in self._state.values()):
                    return None
            time.sleep(0.05)
            self._ask(min(self.probe_every_s, 0.3))

    def _ask(self, every_s: float) -> None:
        now = time.monotonic()
        for ep in self.endpoints:
            with self._lock:
                h = self._state[ep.name]
                if h.probing or now - h.last_probe < every_s:
                    continue
                h.probing, h.last_probe = True, now
            threading.Thread(target=self._answer, args=(ep, h), name=f"health-{ep.name}", daemon=True).start()

    def _answer(self, ep: Endpoint, h: _Health) -> None:
        ok = http_ok(f"{ep.url}/health", timeout=self.grace_s)
        with self._lock:
            h.probing = False
            if ok:
                h.last_ok, h.last_ok_wall = time.monotonic(), time.time()

    def _silent(self) -> Silence | None:
        now = time.monotonic()
        with self._lock:
            for ep in self.endpoints:
                h = self._state[ep.name]
                if now - h.last_ok >= self.grace_s:
                    return Silence(ep, now - h.last_ok, h.last_ok_wall, self.grace_s)
        return None


class ServerUnreachable(ProcessFailed):
    """A server on another host whose process still runs, but which stopped answering over the network."""


class AttachedServers:
    """Servers started elsewhere: readiness and liveness from /health, proof of transfer from /metrics only."""

    attached = True

    def __init__(
        self,
        prefill_urls: Sequence[str],
        decode_urls: Sequence[str],
        ready_timeout_s: float = 60.0,
        probe_every_s: float = 1.0,
        health_grace_s: float = ATTACHED_HEALTH_GRACE_S,
        digest_dir: str | None = None,
    ):
        self.prefill = endpoints("prefill", prefill_urls)
        self.decode = endpoints("decode", decode_urls)
        self.digest_dir = digest_dir  # where the attached servers write KV digest records, if they were given one
        self.ready_timeout_s = ready_timeout_s
        self._watch = HealthWatch(self.all, probe_every_s, health_grace_s)

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
                raise ProcessFailed(
                    ep.name, f"{ep.url}/health did not answer 200 within {self.ready_timeout_s:.0f} s", None, None, ""
                )
            if pending:
                time.sleep(0.2)
        self._watch.arm()
        return {}

    def check(self, force: bool = False) -> None:
        """Probe /health at most once per ``probe_every_s``; ``force`` probes now and waits until it can decide. A
        server silent for less than the grace is unresponsive, not dead: no failure."""
        gone = self._watch.probe(force)
        if gone is not None:
            raise ProcessFailed(gone.endpoint.name, gone.describe(), None, None, "", after_ready=True)

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


# A refused connection is a server closing its port on the way out (vLLM's API server stops listening, then takes
# seconds to stop its engine and exit): its death, with its log, is the story, not the read that raced it.
EXIT_GRACE_S = 15.0


def dying_first(servers: ServerSet, grace_s: float = EXIT_GRACE_S, poll_s: float = 0.25) -> None:
    """Raise the failure of a server that dies within ``grace_s`` (ProcessFailed, ...); return if none does."""
    deadline = time.monotonic() + grace_s
    while True:
        servers.check(force=True)
        if time.monotonic() >= deadline:
            return
        time.sleep(poll_s)


def server_metrics(
    servers: ServerSet, endpoints: list[Endpoint] | None = None, timeout_s: float = 30.0, check: bool = True
) -> dict[str, list[Sample]]:
    """/metrics of each server (default: every P and D) by its name. A dead server fails as such first, unless
    ``check`` is False (after a run's failure, which named its cause already: a failed read is then only that); one
    that refused the connection is given EXIT_GRACE_S to show it is exiting."""
    out: dict[str, list[Sample]] = {}
    for ep in servers.prefill + servers.decode if endpoints is None else endpoints:
        try:
            r = requests.get(f"{ep.url}/metrics", timeout=timeout_s)
            r.raise_for_status()
        except requests.RequestException as e:
            if check:  # a server that died is the real story: say so, with its log
                dying_first(servers, EXIT_GRACE_S if isinstance(e, requests.ConnectionError) else 0.0)
            raise MetricsUnavailable(ep.name, f"GET {ep.url}/metrics: {type(e).__name__}: {e}") from None
        out[ep.name] = parse_metrics(r.text)
    return out


def decode_metrics(servers: ServerSet, timeout_s: float = 30.0) -> list[Sample]:
    """Every decode server's /metrics in one list (the proof sums over them)."""
    return [s for samples in server_metrics(servers, servers.decode, timeout_s).values() for s in samples]


@dataclass(frozen=True)
class Served:
    """What a running vLLM server says about itself. vLLM 0.32.0 exports neither its device nor its model dtype in
    /metrics (``vllm:cache_config_info`` carries the CacheConfig only: block size, KV cache dtype, blocks, ...) nor in
    /v1/models (model, served name, max_model_len); only ``/server_info``, served with VLLM_SERVER_DEV_MODE=1, has
    both."""

    url: str
    model: str | None = None  # /v1/models root: the path or hub id it loaded
    name: str | None = None  # the served model name
    max_model_len: int | None = None
    device: str | None = None  # cpu / gpu (another platform: its own name), from /server_info
    dtype: str | None = None  # the model's dtype (bfloat16, float32, ...), from /server_info
    cache: Mapping[str, str] = field(default_factory=dict)  # the labels of vllm:cache_config_info
    unread: tuple[str, ...] = ()  # what could not be read, one line each
    tp: int | None = None  # tensor_parallel_size, from /server_info (vLLM 0.32.0 serves it nowhere else)

    def to_dict(self) -> dict:
        return {**asdict(self), "cache": dict(self.cache), "unread": list(self.unread)}


@dataclass(frozen=True)
class Attach:
    """Attach mode: the servers of the run were started elsewhere and are given by URL."""

    prefill_urls: tuple[str, ...]
    decode_urls: tuple[str, ...]
    baseline_url: str | None = None  # None: the harness launches the baseline here
    served: tuple[Served, ...] = ()  # what the servers said before the run (read_attached)
    sources: Mapping[str, str] = field(default_factory=dict)  # run setting (device, dtype, ...) -> where it came from
    digest_dir: str | None = None  # the folder the attached servers write KV digests to (--attached-kv-digest)

    @property
    def urls(self) -> tuple[str, ...]:
        return self.prefill_urls + self.decode_urls + ((self.baseline_url,) if self.baseline_url else ())

    def to_dict(self) -> dict:
        return {
            "prefill_urls": list(self.prefill_urls),
            "decode_urls": list(self.decode_urls),
            "baseline_url": self.baseline_url,
            "served": [s.to_dict() for s in self.served],
            "sources": dict(self.sources),
            "digest_dir": self.digest_dir,
        }


def model_card(url: str, timeout_s: float = 30.0) -> dict:
    """The first model of a running vLLM server's /v1/models (id, root, max_model_len)."""
    data = read_json(f"{url.rstrip('/')}/v1/models", url, timeout_s).get("data") or []
    if not data:
        raise MetricsUnavailable(url, "/v1/models lists no model")
    return data[0]


def served_model(url: str, timeout_s: float = 30.0) -> tuple[str, str]:
    """(model path or hub id, served name) of a running vLLM server, from its /v1/models."""
    card = model_card(url, timeout_s)
    return str(card.get("root") or card["id"]), str(card["id"])


def card_max_model_len(card: dict) -> int | None:
    v = card.get("max_model_len")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None


_DEVICES = {"cuda": "gpu", "cpu": "cpu"}
_TEXT_DTYPE = re.compile(r"\bdtype=(?:torch\.)?(\w+)")
_TEXT_DEVICE = re.compile(r"\bdevice_config=(?:device\(type=')?(\w+)")


def server_info_facts(info: dict) -> tuple[str | None, str | None]:
    """(device, model dtype) from vLLM's /server_info answer (config_format json, or text from an older vLLM)."""
    cfg = info.get("vllm_config")
    if isinstance(cfg, dict):
        device = (cfg.get("device_config") or {}).get("device")
        dtype = (cfg.get("model_config") or {}).get("dtype")
    elif isinstance(cfg, str):
        dev_m, dtype_m = _TEXT_DEVICE.search(cfg), _TEXT_DTYPE.search(cfg)
        device, dtype = dev_m and dev_m.group(1), dtype_m and dtype_m.group(1)
    else:
        return None, None
    device = str(device).split(":")[0] if device and str(device) != "None" else None
    dtype = str(dtype).removeprefix("torch.") if dtype and str(dtype) not in ("None", "auto") else None
    return (_DEVICES.get(device, device) if device else None), dtype


_TEXT_TP = re.compile(r"\btensor_parallel_size=(\d+)")


def server_info_tp(info: dict) -> int | None:
    """The tensor-parallel size in vLLM's /server_info answer (config_format json, or text), None where it is not."""
    cfg = info.get("vllm_config")
    if isinstance(cfg, dict):
        tp = (cfg.get("parallel_config") or {}).get("tensor_parallel_size")
    elif isinstance(cfg, str):
        m = _TEXT_TP.search(cfg)
        tp = int(m.group(1)) if m else None
    else:
        return None
    return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 0 else None


def cache_config_labels(samples: list[Sample]) -> dict[str, str]:
    for s in samples:
        if s.name == "vllm:cache_config_info":
            return {k: v for k, v in s.labels.items() if k != "engine"}
    return {}


def read_served(url: str, timeout_s: float = 10.0) -> Served:
    """What the server at ``url`` says about itself (never raises: what cannot be read is in ``unread``)."""
    url = url.rstrip("/")
    unread: list[str] = []
    card: dict = {}
    try:
        card = model_card(url, timeout_s)
    except MetricsUnavailable as e:
        unread.append(e.detail)
    cache: dict[str, str] = {}
    try:
        r = requests.get(f"{url}/metrics", timeout=timeout_s)
        r.raise_for_status()
        cache = cache_config_labels(parse_metrics(r.text))
    except (requests.RequestException, ValueError) as e:
        unread.append(f"GET {url}/metrics: {type(e).__name__}: {e}")
    device = dtype = tp = None
    try:
        info = read_json(f"{url}/server_info?config_format=json", url, timeout_s)
        device, dtype = server_info_facts(info)
        tp = server_info_tp(info)
    except MetricsUnavailable as e:
        unread.append(e.detail)
    root = card.get("root") or card.get("id")
    name = str(card["id"]) if card.get("id") else None
    length = card_max_model_len(card)
    return Served(url, str(root) if root else None, name, length, device, dtype, cache, tuple(unread), tp)


def read_attached(attach: Attach, timeout_s: float = 10.0) -> Attach:
    """``attach`` with what each of its servers (prefill, decode, then the baseline) says about itself."""
    return replace(attach, served=tuple(read_served(u, timeout_s) for u in attach.urls))
