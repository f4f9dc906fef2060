"""Failure classifier: server logs and HTTP errors matched against known signatures (pure)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.checks.transfer import LEASE_PATTERNS
from harness.serve.procs import tail_text

CONTEXT_LINES = 3


@dataclass(frozen=True)
class Signature:
    cls: str
    pattern: re.Pattern[str]
    meaning: str
    # Evidence spread over several logs (e.g. P's release and D's late read): every matching line, by source.
    every_line: bool = False


def _sig(cls: str, pattern: str, meaning: str, every_line: bool = False) -> Signature:
    return Signature(cls, re.compile(pattern, re.IGNORECASE), meaning, every_line)


# Most specific first: a #45330 traceback also contains "handshake_setup_failed".
SIGNATURES: tuple[Signature, ...] = (
    _sig(
        "assert-45330",
        r"Remote P worker KV layer cache must be of shape",
        "vLLM issue #45330: block-length assertion when a TP size exceeds the KV heads",
    ),
    _sig(
        "rejected-replicated-p-gt-d",
        r"tp_ratio < 0 and self\.transfer_topo\.is_kv_replicated",
        "replicated prefill TP larger than decode TP: refused at handshake by design",
    ),
    _sig("kv-layout-mismatch", r"Heterogeneous TP expects same kv_cache_layout", "P and D KV cache layouts differ"),
    _sig(
        "non-contiguous-heads",
        r"Heterogeneous TP head-dimension splitting requires contiguous heads",
        "head splitting needs a block-contiguous layout on P",
    ),
    # D's handshake when neither side's block size divides the other's (e.g. a hybrid model, whose attention block
    # vLLM sizes from the Mamba state per rank, so from TP): every transfer fails; before the lease class it causes.
    _sig(
        "block-size-mismatch",
        r"Local block size \d+ is not divisible by remote block size",
        "P's and D's KV block sizes cannot be matched (neither divides the other): refused at handshake",
    ),
    _sig("nixl-unavailable", r"NIXL is not available", "the nixl package is missing or failed to load"),
    _sig(
        "out-of-memory",
        r"CUDA out of memory|MemoryError|Not enough memory|No available memory for the cache blocks|"
        r"Cannot allocate memory",
        "a server ran out of memory",
    ),
    _sig(
        "kv-lease-expired",
        "|".join(p.pattern for p in LEASE_PATTERNS),
        "P released KV blocks on lease expiry before every D rank read them",
        every_line=True,
    ),
    _sig(
        "handshake-timeout",
        r"zmq\.error\.Again|handshake.*time[d ]*out|Timed out waiting for .*handshake",
        "the NIXL side-channel handshake timed out",
    ),
    # An error (never a warning) saying this build cannot do what was asked: an axis value vLLM refuses.
    _sig(
        "unsupported",
        # "Assertion failed, ...": an assert in one of vLLM's pydantic configs, as ValidationError reports it
        r"NotImplementedError: .+|"
        r"(?:(?:ValueError|RuntimeError|TypeError|AssertionError|Exception): |Assertion failed, ).*"
        r"(?:not supported|unsupported|is only supported|only supports|requires x86|does not satisfy every supported|"
        r"is currently only supported|requires attention implementations to .+, but \w+ does not)",
        "vLLM refuses a setting of this run (an axis value this build or device does not support)",
    ),
    _sig(
        "config-error",
        r"is not divisible by|must be divisible by|should be divisible by|ValidationError|"
        r"Invalid (?:value|argument)|error: argument|"
        r"No common block size",
        "vLLM refused its configuration",
    ),
    _sig(
        "handshake-failed", r"handshake_setup_failed|handshake_failed", "the NIXL handshake failed for another reason"
    ),
)
# Classes no retry can cure: a run that logs one of them stops at once.
FATAL_CLASSES = (
    "assert-45330",
    "rejected-replicated-p-gt-d",
    "kv-layout-mismatch",
    "non-contiguous-heads",
    "block-size-mismatch",
    "nixl-unavailable",
    "unsupported",
)
# A failure vLLM retries with every request, fatal once it has come back this often (a side channel nothing answers
# on: each try waits 5 s, fails the request, and the next request tries again); the class is then the log's
# signature (handshake-timeout for zmq.error.Again). vLLM logs this line once per failed handshake.
HANDSHAKE_FAILED_LINE = r"NIXL transfer failure: handshake_setup_failed"
HANDSHAKE_FAILURES_FATAL = 3
REPEATED_FATAL = ((HANDSHAKE_FAILED_LINE, HANDSHAKE_FAILURES_FATAL),)
# Classes the pipeline gives when no log signature matched.
RUN_CLASSES = (
    "server-exited",
    "startup-timeout",
    "prefill-died",
    "decode-died",
    "proxy-died",
    "baseline-died",
    "output-mismatch",
    "logprob-mismatch",
    "kv-digest-mismatch",
    "accuracy-mismatch",
    "no-transfer",
    "kv-leak",
    "abort-not-fired",
    "checks-failed",
    "lm-eval-failed",
    "metrics-unavailable",
    "host-unreachable",
    "server-unreachable",
    "kv-not-over-network",
    "gpu-check-failed",
    "interrupted",
    "harness-error",
)
CLASSES = tuple(s.cls for s in SIGNATURES) + RUN_CLASSES + ("unknown",)
# The same signatures as log patterns for a server's fatal-line watch (case-insensitive, as above).
FATAL_PATTERNS = tuple("(?i)" + s.pattern.pattern for s in SIGNATURES if s.cls in FATAL_CLASSES)


@dataclass(frozen=True)
class Failure:
    cls: str
    excerpt: str
    source: str | None = None  # which log or error matched
    meaning: str = ""

    def to_dict(self) -> dict:
        return {"class": self.cls, "excerpt": self.excerpt, "source": self.source, "meaning": self.meaning}


def excerpt_around(text: str, start: int, context: int = CONTEXT_LINES) -> str:
    lines = text.splitlines()
    line_no = text.count("\n", 0, start)
    lo, hi = max(0, line_no - context), min(len(lines), line_no + context + 1)
    return "\n".join(lines[lo:hi])


def classify(texts: dict[str, str], exclude: frozenset[str] = frozenset()) -> Failure:
    """First signature (in priority order) found in any of ``texts`` (name -> log or error text); classes in
    ``exclude`` are not looked for (what the run's own checks already explained)."""
    for sig in SIGNATURES:
        if sig.cls in exclude:
            continue
        for source, text in texts.items():
            m = sig.pattern.search(text or "")
            if m:
                ex = every_matching_line(sig.pattern, texts) if sig.every_line else excerpt_around(text, m.start())
                return Failure(sig.cls, ex, source, sig.meaning)
    first = next((s for s, t in texts.items() if t), None)
    return Failure("unknown", tail_text(texts[first]) if first else "", first, "no known signature matched")


def every_matching_line(pattern: re.Pattern[str], texts: dict[str, str], limit: int = 4000) -> str:
    return "\n".join(
        f"{src}: {line}" for src, t in texts.items() for line in (t or "").splitlines() if pattern.search(line)
    )[:limit]
