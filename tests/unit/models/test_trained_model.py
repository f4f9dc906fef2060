import json
from dataclasses import replace

import pytest

import harness.models.trained as tm
from harness.models.tiny import TinyModelSpec
from harness.models.trained import TrainedModelSpec, TrainSpec, ensure_trained_model, read_meta
from harness.tasks.gsm8k_offline import ITEMS, NAMES, TaskSpec, render_prompt, splits

# Seconds to train: one layer, a few steps, a small task.
TINY = TrainedModelSpec(
    arch=TinyModelSpec(kv_heads=1, heads=2, layers=1, head_dim=32, intermediate=64, vocab=600, init_std=0.02),
    task=TaskSpec(n_train=20, n_test=4, num_fewshot=2),
    train=TrainSpec(steps=4, batch_size=2, warmup=2),
    eval_limit=4,
)


def test_cache_key_follows_every_part_of_the_spec():
    base = TrainedModelSpec()
    assert base.key() == TrainedModelSpec().key()
    variants = [
        replace(base, arch=replace(base.arch, kv_heads=2)),
        replace(base, task=replace(base.task, seed=1)),
        replace(base, train=replace(base.train, steps=base.train.steps + 1)),
        replace(base, train=replace(base.train, seed=1)),
        replace(base, eval_limit=10),
    ]
    keys = {v.key() for v in variants}
    assert len(keys) == len(variants) and base.key() not in keys
    assert "-k2-" in variants[0].dirname() and "-k1-" in base.dirname()


def test_default_keeps_gqa_replication_at_tp2():
    a = TrainedModelSpec().arch
    assert (a.heads, a.kv_heads) == (4, 1) and a.head_dim in (32, 64, 80, 96, 112, 128)


def test_tokenizer_keeps_task_words_and_numbers_whole(tmp_path):
    from transformers import AutoTokenizer

    spec = TrainedModelSpec()
    tm.train_tokenizer(spec.arch, tmp_path, tm.tokenizer_corpus(spec.task))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    words = [f" {n}" for n in range(2, 100)] + [f" {w}" for w in NAMES + ITEMS]
    assert [w for w in words if len(tok(w, add_special_tokens=False).input_ids) != 1] == []
    # the harness's fixed prompts keep one token per word (1 token up to many blocks, inside the CPU context)
    from harness.workload.prompts import prompt_set

    assert [len(tok(p.text, add_special_tokens=False).input_ids) for p in prompt_set(0)] == [
        p.words for p in prompt_set(0)
    ]
    assert len(tok("Answer:", add_special_tokens=False).input_ids) == 2  # no BOS added
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert (cfg["bos_token"], cfg["eos_token"]) == ("<s>", "</s>")


def test_training_text_is_the_lm_eval_prompt_and_loss_is_on_answers_only(tmp_path):
    from transformers import AutoTokenizer

    spec = replace(TINY, train=replace(TINY.train, exact_prefix_share=1.0))
    tm.train_tokenizer(spec.arch, tmp_path, tm.tokenizer_corpus(spec.task))
    tok = AutoTokenizer.from_pretrained(tmp_path)
    text = tm.training_texts(spec)[0]
    shots = splits(spec.task)["train"][:2]
    question = text.rsplit("Question: ", 1)[1].split("\nAnswer:")[0]
    answer = text.rsplit("\nAnswer: ", 1)[1].split("\n\n")[0]
    assert text == render_prompt(shots, {"question": question}) + " " + answer + "\n\nQuestion:"
    ids, mask = tm.encode(tok, text)
    trained_on = tok.decode([i for i, m in zip(ids, mask, strict=False) if m])
    assert trained_on == "".join(f" {e['answer']}\n\n" for e in shots + [{"answer": answer}])


def test_small_training_is_deterministic_and_cached(tmp_path):
    a = ensure_trained_model(TINY, tmp_path / "c1", log_every=0)
    b = ensure_trained_model(TINY, tmp_path / "c2", log_every=0)
    assert (a / "model.safetensors").read_bytes() == (b / "model.safetensors").read_bytes()
    mtime = (a / "model.safetensors").stat().st_mtime_ns
    assert ensure_trained_model(TINY, tmp_path / "c1") == a and (a / "model.safetensors").stat().st_mtime_ns == mtime
    meta = read_meta(a)
    assert meta["steps"] == 4 and meta["heldout_n"] == 4 and meta["train_seconds"] >= 0 and meta["final_train_loss"] > 0
    cfg = json.loads((a / "config.json").read_text())
    assert (cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]) == (2, 1, 32)
    other = ensure_trained_model(replace(TINY, train=replace(TINY.train, seed=1)), tmp_path / "c1", log_every=0)
    assert (other / "model.safetensors").read_bytes() != (a / "model.safetensors").read_bytes()


def test_a_crashed_build_is_not_cached(tmp_path, monkeypatch):
    def crash(spec, out, log_every):
        (out / "model.safetensors").write_text("partial")
        raise RuntimeError("killed")

    monkeypatch.setattr(tm, "build", crash)
    with pytest.raises(RuntimeError):
        ensure_trained_model(TINY, tmp_path)
    assert list(tmp_path.iterdir()) == []


def test_bad_specs_are_refused():
    with pytest.raises(ValueError):
        replace(TINY, train=replace(TINY.train, steps=0)).validate()
    with pytest.raises(ValueError):
        replace(TINY, arch=replace(TINY.arch, kv_heads=3)).validate()  # 2 heads, 3 KV heads
    with pytest.raises(ValueError):
        replace(TINY, train=replace(TINY.train, batch_size=100_000)).validate()  # more questions than exist
