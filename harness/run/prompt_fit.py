"""The context a run's servers get, fitted to its prompts in the served model's own tokens.

The sequential prompts are fixed word texts whose lengths in tokens (1 up to ~10 KV blocks) hold for the tokenizers
the harness builds. Another model's tokenizer (byte-level, say) makes them longer: with the default
``max_model_len`` (512 on CPU) both sides would answer HTTP 400 and the run fail for a reason that is ours. So, before
anything starts, the prompts are counted with the model's ``tokenizer.json`` (read offline): the default context grows
to hold the longest prompt and its answer, up to the model's own limit; a context given by hand, or a model limit,
that cannot hold them is a one-line error.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, replace

from harness.core.errors import ConfigError
from harness.run.config import E2EConfig

CONTEXT_STEP = 64  # a grown context is rounded up to this (a whole number of blocks of every common size)


@dataclass(frozen=True)
class PromptFit:
    longest_id: str
    longest_tokens: int
    need: int  # the longest prompt plus its answer
    model_limit: int | None  # the model's max_position_embeddings (None: not in its config)

    def context(self, given: int | None, default: int) -> int:
        """The max_model_len the run gets; ConfigError (one line) where none can hold the prompts."""
        what = f"prompt {self.longest_id} is {self.longest_tokens} tokens in this model's tokenizer, so it needs"
        if given is not None:
            if self.need > given:
                raise ConfigError(
                    f"{what} a context of {self.need} with its answer; --max-model-len is {given} (raise it, or "
                    "leave it out to have it fitted)"
                )
            return given
        if self.need <= default:
            return default
        if self.model_limit is not None and self.need > self.model_limit:
            raise ConfigError(
                f"{what} a context of {self.need} with its answer, past the model's own limit of {self.model_limit} "
                "(max_position_embeddings); leave the long prompts out with --prompts"
            )
        fitted = -(-self.need // CONTEXT_STEP) * CONTEXT_STEP
        return min(fitted, self.model_limit) if self.model_limit else fitted


def prompt_fit(counts: Mapping[str, int], max_tokens: int, model_limit: int | None) -> PromptFit | None:
    """The fit of prompts of these token counts (None: no prompt)."""
    if not counts:
        return None
    longest = max(counts, key=lambda k: counts[k])
    return PromptFit(longest, counts[longest], counts[longest] + max_tokens, model_limit)


def token_counts(model: str, texts: Mapping[str, str]) -> dict[str, int] | None:
    """Each text's length in ``model``'s tokens, special tokens included as the server adds them (None: no readable
    tokenizer.json here)."""
    from harness.workload.token_text import tokenizer_file

    path = tokenizer_file(model)
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception:  # a tokenizer this library cannot read: the server's own check stays the judge
        return None
    return {k: len(tok.encode(t).ids) for k, t in texts.items()}


def fit_model_len(cfg: E2EConfig) -> E2EConfig:
    """``cfg`` with a context that holds its sequential prompts in the served model's tokens. The local tiny and
    trained models (no ``--model``) are the harness's own: their prompts fit by construction."""
    if cfg.model is None:
        return cfg
    from harness.models.hub import read_config
    from harness.run.pipeline import selected_prompts

    counts = token_counts(cfg.model, {p.id: p.text for p in selected_prompts(cfg)})
    model_cfg = read_config(cfg.model) or {}
    limit = model_cfg.get("max_position_embeddings")
    fit = prompt_fit(counts or {}, cfg.max_tokens, limit if isinstance(limit, int) and limit > 0 else None)
    if fit is None:
        return cfg
    default = replace(cfg, max_model_len=None).model_len
    context = fit.context(cfg.max_model_len, default)
    return cfg if context == cfg.model_len else replace(cfg, max_model_len=context)
