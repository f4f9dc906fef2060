"""Failure mapping, in one place: how a run that did not get through (an exception) or whose checks failed
gets its class, reason, source and log excerpt."""

from __future__ import annotations

import signal
import traceback
from collections.abc import Callable

from harness.accuracy.lm_eval import AccuracyFailed
from harness.checks import transfer
from harness.checks.check import Check, failed_checks_reason
from harness.checks.classify import Failure, classify
from harness.checks.kv_digest import CHECK_NAME as KV_DIGEST_CHECK
from harness.checks.transport import CHECK_NAME as KV_NETWORK_CHECK
from harness.core.errors import ConfigError
from harness.gpu.nvml import GpuCheckFailed
from harness.hosts.reach import HostUnreachable
from harness.serve.procs import ProcessFailed
from harness.serve.servers import MetricsUnavailable, ServerUnreachable
from harness.workload.client import CompletionRun


def interrupted(e: KeyboardInterrupt) -> dict:
    """Ctrl-C, or SIGTERM turned into an interrupt by the CLI."""
    sig = signal.Signals(getattr(e, "signum", signal.SIGINT)).name
    return {"class": "interrupted", "reason": f"interrupted by {sig}", "source": None, "excerpt": ""}


def from_exception(e: Exception, logs: Callable[[], dict[str, str]]) -> dict:
    """The failure of a run that ended with ``e``; ``logs`` reads the run's logs (only when a class needs them)."""
    if isinstance(e, ServerUnreachable):
        reason = f"{e.name}: {e.reason}"
        return {
            "class": "server-unreachable",
            "reason": reason,
            "source": e.name,
            "log": str(e.log_path),
            "excerpt": e.log_tail,
        }
    if isinstance(e, ProcessFailed):
        return process_failure(e, logs())
    if isinstance(e, AccuracyFailed):
        return {"class": "lm-eval-failed", "reason": e.reason, "source": "lm-eval", "excerpt": e.log_tail}
    if isinstance(e, ConfigError):
        return {"class": "config-error", "reason": str(e), "source": "preflight", "excerpt": ""}
    if isinstance(e, GpuCheckFailed):
        return {"class": "gpu-check-failed", "reason": str(e), "source": "nvml", "excerpt": ""}
    if isinstance(e, HostUnreachable):
        return {"class": "host-unreachable", "reason": str(e), "source": e.host.name, "excerpt": ""}
    if isinstance(e, MetricsUnavailable):
        return {"class": "metrics-unavailable", "reason": str(e), "source": e.source, "excerpt": e.detail}
    # a harness bug must still leave a report that says what happened
    return {
        "class": "harness-error",
        "reason": f"{type(e).__name__}: {e}",
        "source": "harness",
        "excerpt": "".join(traceback.format_exception(e))[-4000:],
    }


def process_failure(e: ProcessFailed, logs: dict[str, str]) -> dict:
    """A server that died or never became ready: its log's signature if known, else how it failed.

    A server that failed during start-up (it exited, or logged a fatal error and was stopped) is
    ``server-exited``, a known signature in its log (e.g. vLLM refusing its configuration) kept as
    ``signature``; unless vLLM refused a setting this build or device cannot do: that is ``unsupported``,
    an outcome a matrix entry can expect."""
    f = classify({e.name: e.log_tail, **logs})
    if not e.after_ready and "not ready within" not in e.reason:
        out = {
            "class": "unsupported" if f.cls == "unsupported" else "server-exited",
            "reason": f"{e.name}: {e.reason}",
            "returncode": e.returncode,
            "log": str(e.log_path),
            "source": e.name,
            "excerpt": e.log_tail,
        }
        if f.cls != "unknown":
            out.update(signature=f.cls, signature_meaning=f.meaning, excerpt=f"{f.excerpt}\n...\n{e.log_tail}")
        return out
    if f.cls == "unknown":
        role = e.name.split("[")[0]
        if e.after_ready:  # it had been serving: prefill-died, decode-died, proxy-died, baseline-died
            cls = f"{role}-died"
        elif "not ready within" in e.reason:
            cls = "startup-timeout"
        else:
            cls = "server-exited" if e.returncode is not None else "unknown"
        f = Failure(cls, e.log_tail, e.name, e.reason)
    return {
        "class": f.cls,
        "reason": f"{e.name}: {e.reason}",
        "returncode": e.returncode,
        "log": str(e.log_path),
        "source": f.source,
        "excerpt": f.excerpt,
    }


def from_checks(checks: list[Check], logs: dict[str, str], request_runs: list[CompletionRun]) -> dict | None:
    """A run whose checks failed still gets a class: a known log signature first, else what the checks say."""
    failed = [c for c in checks if not c.passed]
    if not failed:
        return None
    reason = failed_checks_reason((c.name, c.detail) for c in failed)
    errors = {f"http-{f.prompt_id}": f.detail for f in [x for r in request_runs for x in r.failures][:5]}
    names = {c.name for c in failed}
    # lease expiries the checks explained (client cancels, the harness's own proxy fault) are no cause
    explained = frozenset() if "no_kv_lease_expiry" in names else frozenset({"kv-lease-expired"})
    f = classify({**logs, **errors}, explained)
    if f.cls == "unknown":
        cls = (
            "output-mismatch"
            if names & {"outputs_match_baseline", "load_outputs_match_baseline"}
            else "no-transfer"
            if names & (transfer.TRANSFER_CHECKS | {"accuracy_through_pd"})
            else "logprob-mismatch"
            if "logprobs_match_baseline" in names
            else "kv-digest-mismatch"
            if KV_DIGEST_CHECK in names
            else "kv-leak"
            if "no_kv_leak" in names
            else "abort-not-fired"
            if "load_aborts_fired" in names
            else "accuracy-mismatch"
            if any(n.startswith("accuracy_") for n in names)
            else "kv-not-over-network"
            if KV_NETWORK_CHECK in names
            else "checks-failed"
        )
        f = Failure(cls, reason[:2000], None, "checks failed")
    return {"class": f.cls, "reason": reason, "source": f.source, "excerpt": f.excerpt}
