"""The smoke check for real chat models (pure): one greedy completion that must start with "Paris".

From the #45330 report: through the proxy, "The capital of France is" must come back starting
with "Paris"; a server error or garbage means the KV did not arrive intact. It only makes sense for
trained hub models (the tiny random-weights model says nothing sensible).
"""

from __future__ import annotations

import re

from harness.checks.check import Check

SMOKE_PROMPT = "The capital of France is"
SMOKE_MAX_TOKENS = 10
EXPECTED = "Paris"
CHECK_NAME = "smoke_capital_of_france"


def smoke_request(model: str) -> dict:
    """The /v1/completions body: greedy, short, same on every side."""
    return {"model": model, "prompt": SMOKE_PROMPT, "max_tokens": SMOKE_MAX_TOKENS, "temperature": 0}


def judge_smoke(text: str | None, error: str | None = None, where: str = "P/D") -> Check:
    """Pass when the completion's first word is "Paris" (leading spaces, quotes or markdown allowed)."""
    data = {"prompt": SMOKE_PROMPT, "completion": text, "where": where}
    if error is not None:
        return Check(CHECK_NAME, False, f"{where}: the request failed: {error}", data)
    if text is None or not text.strip():
        return Check(CHECK_NAME, False, f"{where}: empty completion", data)
    first = re.match(r"[\s\"'*_`]*([^\s.,;:!?\"'*_`]*)", text)
    word = first.group(1) if first else ""
    if word == EXPECTED:
        return Check(CHECK_NAME, True, f"{where}: {SMOKE_PROMPT!r} -> {text[:60]!r}", data)
    if re.search(rf"\b{EXPECTED}\b", text):
        why = f"{EXPECTED!r} appears but is not the first word"
    elif "\ufffd" in text or not any(c.isalpha() for c in text):
        why = "garbage (no words or undecodable bytes)"
    else:
        why = f"no {EXPECTED!r}"
    return Check(CHECK_NAME, False, f"{where}: {why}: {text[:60]!r}", data)


def completion_text(response: dict) -> str | None:
    """The text of a /v1/completions answer, None when it has no choice."""
    choices = response.get("choices") or []
    return choices[0].get("text") if choices else None
