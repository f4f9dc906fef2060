"""A model the harness did not make (another tokenizer) gets its prompts in its own tokens at their intended lengths
and a context that holds them, or a one-line refusal before anything starts — never 18 prompts of which some are
answered HTTP 400."""

from __future__ import annotations

import json

import pytest
from tokenizers import Regex, Tokenizer, models, pre_tokenizers

from harness.core.errors import ConfigError
from harness.run.config import E2EConfig
from harness.run.prompt_fit import fit_model_len, model_prompts, token_counts
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
    assert chars is not None
    assert words == {p.id: p.words for p in prompt_set(0)}  # the harness's kind of tokenizer: a word is a token
    assert chars["p17-w240"] == len(texts["p17-w240"]) > 1000


def harness_made(folder: str) -> str:
    """``folder`` as one the harness built: what models/tiny.py leaves beside a tiny model's files."""
    from pathlib import Path

    (Path(folder) / "model.safetensors").write_bytes(b"")
    (Path(folder) / "harness_tiny_model.json").write_text("{}")
    return folder


def test_another_models_prompts_are_its_tokens_at_their_intended_lengths(tmp_path):
    cfg = E2EConfig(model=local_model(tmp_path, "char", 4096))
    assert fit_model_len(cfg) == cfg  # 240 tokens and the answer fit the default context
    built = model_prompts(cfg, cfg.model)
    assert built.lengths() == {p.id: p.words for p in prompt_set(0)} and built.record()["token_exact"]


def test_the_context_grows_to_hold_the_longest_prompt_and_its_answer_within_the_models_limit(tmp_path):
    cfg = fit_model_len(E2EConfig(model=local_model(tmp_path, "char", 4096), max_tokens=400))
    assert cfg.model_len == 640  # 240 + 400, rounded up to 64
    own = fit_model_len(E2EConfig(model=harness_made(local_model(tmp_path, "char", 4000))))
    longest = len(next(p.text for p in prompt_set(0) if p.id == "p17-w240"))  # the harness's own: its word texts
    assert own.model_len >= longest + own.max_tokens and own.model_len % 64 == 0 and own.model_len <= 4000


def test_a_model_whose_limit_cannot_hold_the_prompts_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError) as e:
        fit_model_len(E2EConfig(model=local_model(tmp_path, "char", 200)))
    assert "p17-w240 is 240 tokens" in str(e.value) and "limit of 200" in str(e.value) and "\n" not in str(e.value)
    small = E2EConfig(model=local_model(tmp_path, "char", 300))
    assert fit_model_len(small).model_len == 300  # the prompts fit; the default 512 would be past the model's limit


def test_a_context_given_by_hand_is_kept_or_refused_never_changed(tmp_path):
    model = local_model(tmp_path, "char", 4096)
    with pytest.raises(ConfigError, match="--max-model-len is 200"):
        fit_model_len(E2EConfig(model=model, max_model_len=200))
    assert fit_model_len(E2EConfig(model=model, max_model_len=2048)).model_len == 2048


def test_prompts_that_fit_change_nothing(tmp_path):
    cfg = E2EConfig(model=local_model(tmp_path, "word", 512))
    assert fit_model_len(cfg) == cfg
    assert fit_model_len(E2EConfig()) == E2EConfig()  # the local tiny model: the harness's own tokenizer
