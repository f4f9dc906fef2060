"""Nothing leaves the machine: the variables that turn usage reporting off in every process the harness starts.

vLLM reports usage to a public server unless one of its do-not-track variables is set
(``vllm/usage/usage_lib.py`` ``is_usage_stats_enabled``); Ray and the Hugging Face hub have their own switches.
A test tool must not phone home, nor add thousands of test servers to vLLM's usage figures.
"""

from __future__ import annotations

from collections.abc import Mapping

# Sorted, so that a command line that shows them reads the same on every run.
NO_TRACK_ENV: dict[str, str] = {
    "DO_NOT_TRACK": "1",  # the cross-tool convention; vLLM reads it too
    "HF_HUB_DISABLE_TELEMETRY": "1",  # huggingface_hub's telemetry pings
    "RAY_USAGE_STATS_ENABLED": "0",  # Ray's usage reporting (a cluster engine vLLM may start)
    "VLLM_DO_NOT_TRACK": "1",
    "VLLM_NO_USAGE_STATS": "1",
}


def with_no_track(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` (or nothing) with every do-not-track variable set; a caller's own value cannot turn reporting back on."""
    return {**(env or {}), **NO_TRACK_ENV}


def missing_no_track(env: Mapping[str, str]) -> list[str]:
    """The do-not-track variables ``env`` lacks or sets to another value."""
    return [k for k, v in NO_TRACK_ENV.items() if env.get(k) != v]
