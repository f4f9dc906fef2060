"""The sequential prompts in the served model's own tokens, and the context a run's servers get, fitted to them.

The sequential prompts are fixed word texts, each meant to be as many tokens as it has words (1 up to ~10 KV blocks,
block edges n·B and n·B ± 1), as the trained model's tokenizer makes them (the tiny models' make the longer ones
longer). For a model the harness did not make, each prompt is built as exactly that many of the model's own tokens
instead (``model_prompts``: token ids from its ``tokenizer.json``, read offline); the harness's own models keep their
word texts byte for byte (their baseline-cache keys and recorded prompts do not change). A model without a readable
``tokenizer.json`` keeps the word texts, which its tokenizer may make longer.

Before anything starts, the context is fitted: the default ``max_model_len`` (512 on CPU) grows to hold the longest
prompt and its answer, up to the model's own limit; a context given by hand, or a model limit, that cannot hold
them is a one-line error (both sides would otherwise answer HTTP 400 and the run fail for a reason that is ours).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path

from harness.core.errors import ConfigError
from harness.models import tiny, trained
from harness.run.config import E2EConfig
from harness.workload.prompts import Prompt, prompt_set, token_exact

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
        if self.model_limit is not None and self.need > self.model_limit:
            raise ConfigError(
                f"{what} a context of {self.need} with its answer, past the model's own limit of {self.model_limit} "
                "(max_position_embeddings); leave the long prompts out with --prompts"
            )
        if self.need <= default:  # within a smaller limit of the model's own, which a server would not go past
            return min(default, self.model_limit) if self.model_limit else default
        fitted = -(-self.need // CONTEXT_STEP) * CONTEXT_STEP
        return min(fitted, self.model_limit) if self.model_limit else fitted


def prompt_fit(counts: Mapping[str, int], max_tokens: int, model_limit: int | None) -> PromptFit | None:
    """The fit of prompts of these token counts (None: no prompt)."""
    if not counts:
        return None
    longest = max(counts, key=lambda k: counts[k])
    return PromptFit(longest, counts[longest], counts[longest] + max_tokens, model_limit)


def selected_prompts(cfg: E2EConfig) -> list[Prompt]:
    """The sequential prompts of the run as word texts: every one, or those --prompts names (in the set's order)."""
    prompts = prompt_set(cfg.seed)
    return prompts if cfg.prompt_ids is None else [p for p in prompts if p.id in cfg.prompt_ids]


def harness_made(model: str | None) -> bool:
    """The local tiny or trained model (no ``--model``), or a folder the harness built (a matrix's tiny models)."""
    return model is None or tiny.is_built(Path(model)) or trained.is_built(Path(model))


def load_encoder(model: str) -> tuple[Callable[[str], list[int]], Path] | None:
    """``model``'s tokenizer as text -> ids (special tokens added as the tokenizer adds them) and its
    tokenizer.json; None where there is no tokenizer.json here (local folder or hub cache) or this library cannot
    read it."""
    from harness.workload.token_text import tokenizer_file

    path = tokenizer_file(model)
    if path is None:
        return None
    try:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(path))
    except Exception:  # a tokenizer this library cannot read: the word texts, and the server's own check judges them
        return None
    return (lambda text: list(tok.encode(text).ids)), path


@dataclass(frozen=True)
class SequentialPrompts:
    prompts: list[Prompt]
    exact_in: Path | None = None  # the tokenizer.json they are token ids of, exactly ``words`` long (None: word texts)

    def lengths(self) -> dict[str, int]:
        """Each prompt's length: in tokens where exact, else its words (the tokens it is meant to have)."""
        return {p.id: len(p.ids) if p.ids is not None else p.words for p in self.prompts}

    def record(self) -> dict:
        """For the report: how the prompts were built, and their lengths."""
        return {
            "token_exact": self.exact_in is not None,
            "tokenizer": None if self.exact_in is None else str(self.exact_in),
            "lengths": self.lengths(),
            "lengths_are": "tokens" if self.exact_in is not None else "words",
        }


def model_prompts(cfg: E2EConfig, model: str | None) -> SequentialPrompts:
    """The run's sequential prompts for ``model``: word texts for the harness's own models, token ids of exactly the
    intended length for any other whose tokenizer.json is here. ConfigError (one line) where its tokenizer cannot
    make a prompt that long."""
    prompts = selected_prompts(cfg)
    if harness_made(model):
        return SequentialPrompts(prompts)
    assert model is not None
    enc = load_encoder(model)
    if enc is None:
        return SequentialPrompts(prompts)
    encode, path = enc
    try:
        return SequentialPrompts(token_exact(prompts, encode, cfg.seed), path)
    except ValueError as e:
        raise ConfigError(f"{model}: the sequential prompts cannot be made in its tokens ({e})") from None


def token_counts(model: str, texts: Mapping[str, str]) -> dict[str, int] | None:
    """Each text's length in ``model``'s tokens, special tokens included as the server adds them (None: no readable
    tokenizer.json here)."""
    enc = load_encoder(model)
    if enc is None:
        return None
    encode, _ = enc
    return {k: len(encode(t)) for k, t in texts.items()}


def fit_model_len(cfg: E2EConfig) -> E2EConfig:
    """``cfg`` with a context that holds its sequential prompts in the served model's tokens. The local tiny and
    trained models (no ``--model``) are the harness's own: their prompts fit by construction."""
    if cfg.model is None:
        return cfg
    from harness.models.hub import read_config

    built = model_prompts(cfg, cfg.model)
    texts = {p.id: p.text for p in built.prompts}
    counts = built.lengths() if built.exact_in is not None else token_counts(cfg.model, texts)
    model_cfg = read_config(cfg.model) or {}
    limit = model_cfg.get("max_position_embeddings")
    fit = prompt_fit(counts or {}, cfg.max_tokens, limit if isinstance(limit, int) and limit > 0 else None)
    if fit is None:
        return cfg
    default = replace(cfg, max_model_len=None).model_len
    context = fit.context(cfg.max_model_len, default)
    return cfg if context == cfg.model_len else replace(cfg, max_model_len=context)
