"""Where a completion's token lies in its text: the character span of the token at a divergence.

Completions are requested with token ids (the comparison needs them), so the server's answer says nothing of
token boundaries in the text. The model's own tokenizer (its ``tokenizer.json``, read offline) decodes the
ids before and through the token; a span is given only when that decoding is exactly how the server's text
begins, so a highlight is never a guess.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

Decode = Callable[[Sequence[int]], str]


def tokenizer_file(model: str) -> Path | None:
    """The model's tokenizer.json: in its folder, or in the local hub cache for a hub id (never downloaded)."""
    local = Path(model) / "tokenizer.json"
    if local.is_file():
        return local
    if Path(model).exists():
        return None
    try:
        from huggingface_hub import try_to_load_from_cache

        hit = try_to_load_from_cache(model, "tokenizer.json")
    except Exception:  # no hub library, or not a hub id
        return None
    return Path(hit) if isinstance(hit, str) else None


def load_decoder(model: str) -> tuple[Decode | None, str]:
    """(decode, "") or (None, why not)."""
    path = tokenizer_file(model)
    if path is None:
        return None, f"no tokenizer.json for {model} here (local folder or hub cache)"
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception as e:  # a tokenizer this library cannot read: no spans, said so
        return None, f"{path} could not be read: {type(e).__name__}: {e}"
    return (lambda ids: tok.decode(list(ids), skip_special_tokens=True)), ""


def token_span(ids: Sequence[int], position: int, text: str, decode: Decode) -> tuple[int, int] | None:
    """Characters [start, end) of token ``position`` in ``text``; (len, len) when the completion ended before it.

    Given only when the decoded ids before and through the token are prefixes of the server's ``text``, and the
    token's text is stable: it does not rewrite what came before, and the next token does not rewrite it (a byte
    of a multi-byte character has no text of its own). Anything else is None: no place is claimed."""
    if position < 0 or position > len(ids):
        return None
    before = decode(ids[:position])
    if position == len(ids):
        return (len(text), len(text)) if before == text else None
    through = decode(ids[: position + 1])
    if not (through.startswith(before) and text.startswith(through)):
        return None
    if position + 1 < len(ids) and not decode(ids[: position + 2]).startswith(through):
        return None
    return (len(before), len(through))


def divergence_spans(
    prompts: list[dict], ids: dict[str, dict[str, Sequence[int]]], texts: dict[str, dict[str, str]], decode: Decode
) -> dict[str, dict[str, list[int] | None]]:
    """For each prompt of a comparison block that diverged: the span of the divergent token in each side's text."""
    out: dict[str, dict[str, list[int] | None]] = {}
    for p in prompts:
        div = p.get("divergence")
        pid = p.get("prompt_id")
        if not div or pid not in ids:
            continue
        spans: dict[str, list[int] | None] = {}
        for side in ("baseline", "pd"):
            side_ids, text = ids[pid].get(side), texts.get(pid, {}).get(side)
            span = (
                None if side_ids is None or text is None else token_span(side_ids, int(div["position"]), text, decode)
            )
            spans[side] = list(span) if span else None
        out[pid] = spans
    return out
