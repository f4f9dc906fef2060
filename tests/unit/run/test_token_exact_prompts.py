"""A model the harness did not make gets its sequential prompts as its own token ids, each exactly its intended
length; the harness's own models keep their word texts byte for byte (baseline-cache keys, prompts.json). The model
here is a tiny random Phi-3 (a family the harness has no entry for) with a byte-level BPE trained locally: tokenizer
and config only, nothing loads it."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest
from tokenizers import Tokenizer

from harness.cache import baseline as bc
from harness.run import pipeline
from harness.run.baseline_key import key_inputs
from harness.run.config import E2EConfig
from harness.run.context import RunContext
from harness.run.prompt_fit import harness_made, model_prompts
from harness.run.prompts_file import read_prompts, write_prompts
from harness.run.report import Report
from harness.workload import client
from harness.workload.client import GenerationSettings, run_completions
from harness.workload.prompts import prompt_set
from tests.tiny_phi3 import build_tiny_phi3
from tests.unit.workload.test_prompts import PINNED


@pytest.fixture(scope="module")
def phi3(tmp_path_factory) -> Path:
    return build_tiny_phi3(tmp_path_factory.mktemp("phi3") / "tiny-phi3", weights=False)


@pytest.fixture
def own_model(phi3, tmp_path) -> Path:
    """The same files as a folder the harness built (what models/tiny.py leaves beside a tiny model)."""
    folder = Path(shutil.copytree(phi3, tmp_path / "tiny-llama-own"))
    (folder / "model.safetensors").write_bytes(b"")
    (folder / "harness_tiny_model.json").write_text("{}")
    return folder


def test_the_tiny_phi3s_prompts_are_exactly_their_intended_lengths_in_its_tokenizer(phi3):
    from transformers import AutoTokenizer

    assert not harness_made(str(phi3))
    built = model_prompts(E2EConfig(model=str(phi3)), str(phi3))
    assert built.exact_in == phi3 / "tokenizer.json"
    tok = Tokenizer.from_file(str(phi3 / "tokenizer.json"))
    served = AutoTokenizer.from_pretrained(phi3)  # how a server tokenizes the same text
    for p in built.prompts:
        assert p.ids is not None and len(p.ids) == p.words == int(p.id.split("-w")[1])
        assert list(p.ids) == tok.encode(p.text).ids[: p.words] == served(p.text).input_ids[: p.words]
    words = {p.id: len(tok.encode(p.text).ids) for p in prompt_set(0)}
    assert words["p17-w240"] > 400  # the word texts alone miss their lengths in this tokenizer
    assert built.record()["lengths"] == {p.id: p.words for p in prompt_set(0)} and built.record()["token_exact"]


def test_the_harness_own_models_keep_their_word_texts(own_model):
    assert harness_made(str(own_model)) and harness_made(None)
    for model in (str(own_model), None):
        built = model_prompts(E2EConfig(model=model), model)
        assert built.prompts == prompt_set(0) and built.exact_in is None
        assert built.record()["lengths_are"] == "words"


def ctx_for(tmp_path: Path, model: Path) -> RunContext:
    cfg = E2EConfig(python="/envs/a/bin/python", model=str(model), run_dir=tmp_path / "run")
    gen = GenerationSettings(max_tokens=cfg.max_tokens, logprobs=cfg.logprobs, seed=cfg.seed)
    prompts = model_prompts(cfg, str(model)).prompts
    return RunContext(cfg, tmp_path / "run", Report(config={}), prompts, gen, model=str(model), served_name="m")


def key_prompts(ctx: RunContext, monkeypatch, tmp_path: Path) -> list:
    monkeypatch.setattr(bc, "cache_root", lambda: tmp_path / "cache")
    monkeypatch.setattr(bc, "python_identity", lambda python: {"executable": python})
    return key_inputs(ctx, {"argv": [], "env": {}}, 32, environ={})["prompts"]


def test_baseline_cache_keys_hold_the_word_texts_for_the_harness_own_models_and_the_ids_for_another(
    own_model, phi3, tmp_path, monkeypatch
):
    own = key_prompts(ctx_for(tmp_path, own_model), monkeypatch, tmp_path)
    assert hashlib.sha256(bc.canonical(own).encode()).hexdigest() == PINNED[0]  # keys as before
    other = key_prompts(ctx_for(tmp_path, phi3), monkeypatch, tmp_path)
    assert [(pid, len(ids)) for pid, ids in other] == [(p.id, p.words) for p in prompt_set(0)]


def test_prompts_json_records_the_ids_sent_and_their_lengths(own_model, phi3, tmp_path):
    write_prompts(ctx_for(tmp_path, phi3), tmp_path)
    data = json.loads((tmp_path / "prompts.json").read_text())
    assert data["sequential_tokens"] == {p.id: p.words for p in prompt_set(0)}
    assert {k: len(v) for k, v in read_prompts(tmp_path).items()} == data["sequential_tokens"]
    write_prompts(ctx_for(tmp_path, own_model), tmp_path)
    data = json.loads((tmp_path / "prompts.json").read_text())
    assert data["sequential"] == {p.id: p.text for p in prompt_set(0)} and data["sequential_tokens"] == {}


def test_a_run_resolves_its_prompts_in_the_served_models_tokens_and_reports_their_lengths(phi3, tmp_path):
    run = pipeline.PDRun(E2EConfig(model=str(phi3), run_dir=tmp_path / "run"))
    run.report.versions = {"vllm": "0.32.0"}  # what run() reads from the serving interpreter first
    run._resolve()
    rec = run.report.config["sequential_prompts"]
    assert rec["token_exact"] and rec["lengths"] == {p.id: p.words for p in prompt_set(0)}
    assert [len(p.ids or ()) for p in run.ctx.prompts] == [p.words for p in prompt_set(0)]


def test_the_client_sends_the_ids_as_the_prompt(phi3, monkeypatch):
    sent: list = []

    class Response:
        status_code = 200

        def __init__(self, prompt):
            self.prompt = prompt

        def json(self):
            usage = {"prompt_tokens": len(self.prompt)}
            return {"choices": [{"text": "", "logprobs": {"tokens": ["token_id:7"]}}], "usage": usage}

    class Session:
        def __enter__(self):
            return self

        def __exit__(self, *a):
            return False

        def post(self, url, json, headers, timeout):
            sent.append(json["prompt"])
            return Response(json["prompt"])

    monkeypatch.setattr(client.requests, "Session", Session)
    prompts = model_prompts(E2EConfig(model=str(phi3)), str(phi3)).prompts
    out = run_completions("http://x", "m", prompts, GenerationSettings())
    assert sent == [list(p.ids or ()) for p in prompts]
    assert {c.prompt_id: c.prompt_tokens for c in out.completions} == {p.id: p.words for p in prompt_set(0)}
