"""Proof that KV really moved over NIXL: pure functions over what the run observed."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from harness.checks.check import Check
from harness.checks.leak import expiries, explain_expiries
from harness.serve.prometheus import Sample, delta

XFER_COUNT = "vllm:nixl_xfer_time_seconds_count"
BYTES_SUM = "vllm:nixl_bytes_transferred_sum"
FAILED = "vllm:nixl_num_failed_transfers_total"
EXPIRED = "vllm:nixl_num_kv_expired_reqs_total"
TOKENS_BY_SOURCE = "vllm:prompt_tokens_by_source_total"

TRANSFER_PLAN = re.compile(r"Transfer plan: (TransferTopology\(.*\))")
COMPAT_PASSED = "NIXL compatibility check passed"
# vLLM prints its engine config at start-up; this proves the policy the server really runs with.
POLICY_FAIL = re.compile(r"kv_load_failure_policy='fail'")
# The checks that prove KV moved; failing any of them means "no transfer" unless a log says more.
TRANSFER_CHECKS = frozenset(
    {
        "prefill_returned_kv_transfer_params",
        "nixl_transfers_counted",
        "no_failed_transfers",
        "prompt_tokens_from_transfer",
        "transfer_plan_logged",
    }
)
# The checks that read D's log (not possible for servers started elsewhere).
LOG_CHECKS = ("transfer_plan_logged", "kv_load_failure_policy_fail")
LEASE_PATTERNS = (
    re.compile(r"Releasing expired KV blocks for request .*"),
    re.compile(r"Potentially invalid KV blocks for .*"),
)


def check_prefill_params(requests_sent: int, stats: dict) -> Check:
    with_params = int(stats.get("prefill_with_kv_transfer_params", 0))
    missing = int(stats.get("prefill_missing_kv_transfer_params", 0))
    ok = requests_sent > 0 and with_params >= requests_sent and missing == 0
    return Check(
        "prefill_returned_kv_transfer_params",
        ok,
        f"{with_params} of {requests_sent} prefill answers carried kv_transfer_params, {missing} did not",
        {"last_kv_transfer_params": stats.get("last_kv_transfer_params")},
    )


def check_nixl_metrics(
    before: list[Sample], after: list[Sample], requests_sent: int, prompt_tokens: int
) -> list[Check]:
    xfers = delta(before, after, XFER_COUNT)
    failed = delta(before, after, FAILED)
    expired = delta(before, after, EXPIRED)
    nbytes = delta(before, after, BYTES_SUM)
    ext = delta(before, after, TOKENS_BY_SOURCE, source="external_kv_transfer")
    return [
        Check(
            "nixl_transfers_counted",
            xfers.present and xfers.delta >= requests_sent > 0,
            f"D's {XFER_COUNT} grew by {xfers.delta:g} for {requests_sent} requests ({nbytes.delta:g} bytes)"
            if xfers.present
            else f"D's /metrics has no {XFER_COUNT}: no NIXL transfer was recorded",
            {"transfers": xfers.delta, "bytes": nbytes.delta},
        ),
        Check(
            "no_failed_transfers",
            failed.present and failed.delta == 0 and (not expired.present or expired.delta == 0),
            f"failed transfers {failed.delta:g}, expired requests {expired.delta:g}"
            if failed.present
            else f"D's /metrics has no {FAILED}; cannot show that no transfer failed",
        ),
        Check(
            "prompt_tokens_from_transfer",
            # D may recompute a request's last prompt token itself, so allow one per request.
            ext.present and prompt_tokens > 0 and ext.delta >= prompt_tokens - requests_sent,
            f"D took {ext.delta:g} prompt tokens from external KV transfer; the prompts had {prompt_tokens} "
            f"(at most one per request, {requests_sent}, may be recomputed locally)"
            if ext.present
            else f"D's /metrics has no {TOKENS_BY_SOURCE}{{source=external_kv_transfer}}",
        ),
    ]


DP_ENGINE_LABEL = "engine"  # vLLM labels each DP engine's series in its API server's /metrics


def check_dp_engines_received(before: list[Sample], after: list[Sample], dp: int) -> Check:
    """With D at data parallel ``dp``, every engine must have taken transfers: requests spread over the engines, and
    an engine whose NIXL side channel (one per DP rank) no P reached would otherwise hide behind the sum."""
    per = {str(e): delta(before, after, XFER_COUNT, **{DP_ENGINE_LABEL: str(e)}) for e in range(dp)}
    counts = {e: d.delta for e, d in per.items()}
    labelled = any(s.name == XFER_COUNT and DP_ENGINE_LABEL in s.labels for s in after)
    return Check(
        "dp_engines_each_received",
        labelled and all(c > 0 for c in counts.values()),
        f"D's transfers per DP engine: {', '.join(f'engine {e}: {c:g}' for e, c in counts.items())}"
        if labelled
        else f"D's /metrics has no {XFER_COUNT} labelled by {DP_ENGINE_LABEL}: transfers per DP engine unknown",
        {"per_engine": counts},
    )


def check_decode_log(log_text: str) -> list[Check]:
    plans = sorted(set(TRANSFER_PLAN.findall(log_text)))
    return [
        Check(
            "transfer_plan_logged",
            bool(plans) and COMPAT_PASSED in log_text,
            ("; ".join(plans) if plans else "D's log has no 'Transfer plan:' line")
            + ("" if COMPAT_PASSED in log_text else f"; no '{COMPAT_PASSED}'"),
            {"plans": plans},
        ),
        Check(
            "kv_load_failure_policy_fail",
            bool(POLICY_FAIL.search(log_text)),
            "D runs with kv_load_failure_policy='fail' (a failed transfer cannot be silently recomputed)"
            if POLICY_FAIL.search(log_text)
            else "D's log does not show kv_load_failure_policy='fail': a failed transfer could be silently recomputed",
        ),
    ]


def check_lease(
    logs: dict[str, str], cancels: Mapping[str, Sequence[str]] | None = None, faulted: Sequence[str] = ()
) -> Check:
    """No lease expired, but for requests the client cancelled before any D read them (the leak check's hold) and
    requests the harness's own proxy fault changed (their reads went wrong on purpose)."""
    by_cancel, by_fault, _ = explain_expiries(expiries(logs), cancels or {}, faulted)
    excused = {e.request_id for e in (*by_cancel, *by_fault)}
    hits = []
    for name, text in logs.items():
        for pat in LEASE_PATTERNS:
            hits += [
                f"{name}: {m.group(0).strip()}" for m in pat.finditer(text) if not any(r in m.group(0) for r in excused)
            ]
    detail = "no KV block lease expired" if not hits else f"{len(hits)} lease-expiry lines, first: {hits[0]}"
    if by_cancel:
        detail += (
            f" ({len(by_cancel)} other(s) expired for requests the client cancelled before any D read them: "
            "see no_kv_leak)"
        )
    if by_fault:
        detail += f" ({len(by_fault)} other(s) expired for requests the proxy fault changed)"
    data = {"lines": hits[:10]} if hits else None
    if by_cancel:
        data = {**(data or {}), "after_client_cancel": [e.request_id for e in by_cancel[:10]]}
    if by_fault:
        data = {**(data or {}), "after_injected_fault": [e.request_id for e in by_fault[:10]]}
    return Check("no_kv_lease_expiry", not hits, detail, data)
