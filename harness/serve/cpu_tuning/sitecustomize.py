"""CPU tuning for NIXL P/D servers, injected by the harness via PYTHONPATH.

Active only when the harness sets PD_HARNESS_NIXL_PTHR_DELAY_US or
PD_HARNESS_SKIP_NIXL_PINNING; otherwise importing this file does nothing.
It changes scheduling only, never what is computed:
- NIXL's Python API hard-wires its progress thread's delay to 0 us, a busy
  poll that burns a core per agent; we set the configured delay instead.
- vLLM's CPU NIXL worker pins its main thread to the last core of each NUMA
  node; on a 2-core box every server then shares core 1, so we skip that call
  and let the harness's explicit OpenMP binding decide.
- vLLM's shared-memory RPC queues busy-spin for 1 s after every read; with a
  P/D pair stepping every millisecond that is several spinning processes on
  2 cores, starving the threads that do the handshake and the transfer. The
  configured busy-loop time (0: sleep on the queue's notification) is used.
  A sleeping reader rechecks the queue every 5 s in case a notification was
  dropped (the notifying socket keeps one message); the recheck interval is
  shortened so that such a drop costs milliseconds, not 5 s.
- vLLM's engine loop sleeps 1 ms between steps that run no model (a request
  waiting for remote KV, or P holding blocks for D). On 2 cores those idle
  steps of P and D, each an RPC to every worker, kept the CPUs full while a
  NIXL handshake waited to be scheduled; the idle sleep is lengthened to the
  configured time. Steps that run the model never sleep.
"""

import importlib.abc
import importlib.machinery
import os
import sys
import time

_DELAY = os.environ.get("PD_HARNESS_NIXL_PTHR_DELAY_US")
_SKIP_PIN = os.environ.get("PD_HARNESS_SKIP_NIXL_PINNING") == "1"
_NIXL_API = {"nixl_cu12._api", "nixl_cu13._api", "nixl_rocm._api"}
_NIXL_WORKER = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
_SHM = "vllm.distributed.device_communicators.shm_broadcast"
_BUSY_LOOP = os.environ.get("PD_HARNESS_SHM_BUSY_LOOP_S")
_RECHECK_MS = os.environ.get("PD_HARNESS_SHM_RECHECK_MS")
_ENGINE_CORE = "vllm.v1.engine.core"
_IDLE_SLEEP_MS = os.environ.get("PD_HARNESS_ENGINE_IDLE_SLEEP_MS")
_MODULES = _NIXL_API | {_NIXL_WORKER, _SHM, _ENGINE_CORE}


def _log(msg):
    print(f"[pd-harness cpu tuning] {msg}", file=sys.stderr, flush=True)


class _AgentWithDelay:
    """Stands in for the nixlBind module inside nixl's _api: same names, but the
    agent constructor gets the configured progress-thread delay."""

    def __init__(self, bind, delay_us):
        self._bind = bind
        self._delay = delay_us

    def __getattr__(self, name):
        return getattr(self._bind, name)

    def nixlAgent(self, name, config):
        config.pthrDelay = self._delay
        return self._bind.nixlAgent(name, config)


class _OsWithoutPinning:
    """Stands in for ``os`` inside vLLM's NIXL worker module only."""

    def __getattr__(self, name):
        return getattr(os, name)

    @staticmethod
    def sched_setaffinity(pid, cores):
        _log(f"skipped NIXL worker core pinning to {sorted(cores)}")


def _patch(module):
    if module.__name__ in _NIXL_API and _DELAY is not None and hasattr(module, "nixlBind"):
        module.nixlBind = _AgentWithDelay(module.nixlBind, int(_DELAY))
        _log(f"NIXL progress thread delay set to {_DELAY} us")
    elif module.__name__ == _NIXL_WORKER and _SKIP_PIN:
        module.os = _OsWithoutPinning()
    elif module.__name__ == _ENGINE_CORE and _IDLE_SLEEP_MS is not None and hasattr(module, "time"):
        module.time = _TimeWithIdleSleep(int(_IDLE_SLEEP_MS) / 1000)
        _log(f"engine idle sleep set to {_IDLE_SLEEP_MS} ms")
    elif module.__name__ == _SHM:
        if _BUSY_LOOP is not None and hasattr(module, "SpinCondition"):
            _set_busy_loop(module.SpinCondition, float(_BUSY_LOOP))
        if _RECHECK_MS is not None and hasattr(module, "SHM_READER_RECHECK_INTERVAL_MS"):
            module.SHM_READER_RECHECK_INTERVAL_MS = int(_RECHECK_MS)
            _log(f"shared-memory queue recheck interval set to {_RECHECK_MS} ms")
        elif _RECHECK_MS is not None and hasattr(module, "SpinCondition"):
            # Older vLLM (0.21) has no recheck: a sleeping reader whose notification was dropped waits forever.
            _cap_wait(module.SpinCondition, int(_RECHECK_MS))


def _set_busy_loop(cls, seconds):
    init = cls.__init__

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = seconds

    cls.__init__ = __init__
    _log(f"shared-memory queue busy loop set to {seconds} s")


def _cap_wait(cls, cap_ms):
    wait = cls.wait

    def capped(self, timeout_ms=None):
        return wait(self, timeout_ms=cap_ms if timeout_ms is None else min(timeout_ms, cap_ms))

    cls.wait = capped
    _log(f"shared-memory queue recheck interval set to {cap_ms} ms (wait capped)")


class _TimeWithIdleSleep:
    """Stands in for ``time`` inside vLLM's engine-core module only: its one sleep is the idle wait between steps."""

    def __init__(self, min_s):
        self._min_s = min_s

    def __getattr__(self, name):
        return getattr(time, name)

    def sleep(self, seconds):
        time.sleep(max(seconds, self._min_s))


class _Loader(importlib.abc.Loader):
    def __init__(self, inner):
        self._inner = inner

    def create_module(self, spec):
        return self._inner.create_module(spec)

    def exec_module(self, module):
        self._inner.exec_module(module)
        _patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _MODULES:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


if _DELAY is not None or _SKIP_PIN or _BUSY_LOOP is not None or _RECHECK_MS is not None or _IDLE_SLEEP_MS is not None:
    sys.meta_path.insert(0, _Finder())
