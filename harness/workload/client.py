"""Greedy completions with logprobs, the way the comparison needs them."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import requests

from harness.core import progress
from harness.workload.completion import Completion, parse_completion
from harness.workload.prompts import Prompt


@dataclass(frozen=True)
class TokenPrompt:
    """A prompt given as token ids: its length in tokens is exact."""

    id: str
    text: list[int]

    @property
    def payload(self) -> list[int]:
        return self.text


@dataclass(frozen=True)
class GenerationSettings:
    max_tokens: int = 16
    logprobs: int = 5  # top-k kept for the tolerance rule
    seed: int = 0
    timeout_s: float = 180.0

    def body(self, model: str, prompt: str | list[int]) -> dict:
        return {
            "model": model,
            "prompt": prompt,
            "max_tokens": self.max_tokens,
            "temperature": 0.0,
            "logprobs": self.logprobs,
            "return_tokens_as_token_ids": True,
            "seed": self.seed,
        }


class RequestFailed(RuntimeError):
    def __init__(self, prompt_id: str, status: int | None, detail: str):
        self.prompt_id, self.status, self.detail = prompt_id, status, detail
        super().__init__(f"{prompt_id}: HTTP {status}: {detail}")


@dataclass
class CompletionRun:
    completions: list[Completion] = field(default_factory=list)
    latencies_s: dict[str, float] = field(default_factory=dict)
    failures: list[RequestFailed] = field(default_factory=list)


def run_completions(
    base_url: str,
    model: str,
    prompts: Sequence[Prompt | TokenPrompt],
    gen: GenerationSettings,
    run_tag: str = "",
    around: Callable[[str], Callable[[], None]] | None = None,
) -> CompletionRun:
    """Send prompts one at a time (a fixed batch composition keeps greedy runs comparable).

    ``around(prompt_id)`` is called before each request and returns what to call once it is answered (e.g. read
    a server's counters on both sides of each request)."""
    out = CompletionRun()
    label = run_tag.rstrip("-") or "requests"
    sent = [0, time.monotonic()]  # prompts sent so far, when the last one went out

    def status() -> str:
        failed = f", {len(out.failures)} failed" if out.failures else ""
        return f"{label}: prompt {sent[0]}/{len(prompts)} sent, waiting {time.monotonic() - sent[1]:.0f} s{failed}"

    rep = progress.current()
    with (
        rep.step(f"{label} requests", "requests", announce=f"{label}: sending {len(prompts)} prompts to {base_url}"),
        requests.Session() as s,
    ):
        rep.status(status)
        for p in prompts:
            t0 = time.monotonic()
            sent[0], sent[1] = sent[0] + 1, t0
            headers = {"X-Request-Id": f"{run_tag}{p.id}"} if run_tag else {}
            after = around(p.id) if around is not None else None
            try:
                r = s.post(
                    f"{base_url}/v1/completions",
                    json=gen.body(model, p.payload),
                    headers=headers,
                    timeout=gen.timeout_s,
                )
            except requests.RequestException as e:
                out.failures.append(RequestFailed(p.id, None, f"{type(e).__name__}: {e}"))
                continue
            out.latencies_s[p.id] = time.monotonic() - t0
            if r.status_code != 200:
                out.failures.append(RequestFailed(p.id, r.status_code, r.text[:2000]))
                continue
            try:
                out.completions.append(parse_completion(p.id, r.json()))
            except ValueError as e:
                out.failures.append(RequestFailed(p.id, r.status_code, str(e)))
                continue
            if after is not None:
                after()
    return out
