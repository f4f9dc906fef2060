"""A model the harness did not make (another tokenizer) gets a context that holds the run's prompts in its own
tokens, or a one-line refusal before anything starts — never 18 prompts of which some are answered HTTP 400."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from harness.core.errors import ConfigError
from harness.run.config import E2EConfig
from harness.run.prompt_fit import fit_model_len, token_counts
from harness.workload.prompts import VOCAB, prompt_set


def local_model(tmp_path, level: str, limit: int | None):
    """A model folder with a config.json and a char- or word-level tokenizer.json (no weights: nothing loads it)."""
    folder = tmp_path / f"model-{level}-{limit}"
    folder.mkdir()
    cfg = {"model_type": "phi3", "num_attention_heads": 4, "num_key_value_heads": 1, "hidden_size": 64}
    if limit is not None:
        cfg["max_position_embeddings"] = limit
    (folder / "config.json").write_text(json.dumps(cfg))
    units = sorted({c for w in VOCAB for c in w} | {" "}) if level == "char" else sorted(set(VOCAB))
    vocab = {u: i for i, u in enumerate(["[UNK]", *units])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = (
        pre_tokenizers.Split(Regex("."), behavior="isolated") if level == "char" else pre_tokenizers.WhitespaceSplit()
    )
    tok.save(str(folder / "tokenizer.json"))
    return str(folder)


def test_prompts_are_counted_in_the_models_own_tokens(tmp_path):
    texts = {p.id: p.text for p in prompt_set(0)}
    words = token_counts(local_model(tmp_path, "word", 512), texts)
    chars = token_counts(local_model(tmp_path, "char", 512), texts)
    assert words == {p.id: p.words for p in prompt_set(0)}  # the harness's kind of tokenizer: a word is a token
    assert chars["p17-w240"] == len(texts["p17-w240"]) > 1000


def test_the_context_grows_to_hold_the_longest_prompt_within_the_models_limit(tmp_path):
    cfg = fit_model_len(E2EConfig(model=local_model(tmp_path, "char", 4096)))
    longest = len(next(p.text for p in prompt_set(0) if p.id == "p17-w240"))
    assert cfg.model_len >= longest + cfg.max_tokens and cfg.model_len % 64 == 0 and cfg.model_len <= 4096


def test_a_model_whose_limit_cannot_hold_the_prompts_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        fit_model_len(E2EConfig(model=local_model(tmp_path, "char", 1024)))
    assert "p17-w240" in str(e.value) and "1024" in str(e.value) and "\n" not in str(e.value)


def test_a_context_given_by_hand_is_kept_or_refused_never_changed(tmp_path):
    model = local_model(tmp_path, "char", 4096)
    with pytest.raises(ConfigError, match="--max-model-len is 512"):
        fit_model_len(E2EConfig(model=model, max_model_len=512))
    assert fit_model_len(E2EConfig(model=model, max_model_len=2048)).model_len == 2048


def test_prompts_that_fit_change_nothing(tmp_path):
    cfg = E2EConfig(model=local_model(tmp_path, "word", 512))
    assert fit_model_len(cfg) == cfg
    assert fit_model_len(E2EConfig()) == E2EConfig()  # the local tiny model: the harness's own tokenizer
