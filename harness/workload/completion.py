"""A greedy completion as the comparison needs it: token ids and top-k logprobs per position, parsed from
an OpenAI-style answer requested with ``logprobs=k`` and ``return_tokens_as_token_ids``."""

from __future__ import annotations

from dataclasses import dataclass

_PREFIX = "token_id:"


@dataclass(frozen=True)
class Completion:
    prompt_id: str
    token_ids: tuple[int, ...]
    top_logprobs: tuple[dict[int, float], ...]
    text: str
    finish_reason: str | None = None
    prompt_tokens: int | None = None


def _token_id(tok: str, prompt_id: str) -> int:
    if not isinstance(tok, str) or not tok.startswith(_PREFIX):
        raise ValueError(f"{prompt_id}: token {tok!r} is not 'token_id:N' (request return_tokens_as_token_ids)")
    try:
        return int(tok[len(_PREFIX) :])
    except ValueError:
        raise ValueError(f"{prompt_id}: token {tok!r} is not 'token_id:N'") from None


def parse_completion(prompt_id: str, response_json: dict) -> Completion:
    try:
        choice = response_json["choices"][0]
    except (KeyError, IndexError, TypeError):
        raise ValueError(f"{prompt_id}: response has no choices") from None
    lp = choice.get("logprobs")
    if not lp or lp.get("tokens") is None:
        raise ValueError(f"{prompt_id}: response has no logprobs (request logprobs=k)")
    ids = tuple(_token_id(t, prompt_id) for t in lp["tokens"])
    tops = []
    for top in lp.get("top_logprobs") or [None] * len(ids):
        tops.append({_token_id(t, prompt_id): float(v) for t, v in (top or {}).items()})
    while len(tops) < len(ids):
        tops.append({})
    usage = response_json.get("usage") or {}
    return Completion(
        prompt_id, ids, tuple(tops), choice.get("text", ""), choice.get("finish_reason"), usage.get("prompt_tokens")
    )
