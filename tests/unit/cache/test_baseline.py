"""The baseline's disk cache: model files hashed once, a hub model keyed by its revision, an entry round-trips, a
broken entry is a miss, writers never leave half an entry. Fakes only: no vLLM server, no serving interpreter."""

from __future__ import annotations

import json
import math
import threading
from dataclasses import dataclass
from pathlib import Path

import pytest

from harness.accuracy.lm_eval import EvalRun, Sample
from harness.cache import baseline as bc
from harness.workload.client import CompletionRun, RequestFailed
from harness.workload.completion import Completion
from harness.workload.load import LoadRequest
from harness.workload.load_client import LoadOutcome, LoadRun
from harness.workload.prefix import plan_prefix


@dataclass
class Answers:
    """What a baseline answered, as the cache stores it (the baseline phase's result has these and more)."""

    completions: CompletionRun
    load: LoadRun | None = None
    eval: EvalRun | None = None
    prefix: CompletionRun | None = None


@pytest.fixture
def cache_here(tmp_path) -> Path:
    return tmp_path / "cache"


def fake_model(tmp_path: Path) -> Path:
    """A model folder whose files the cache hashes (config, weights, tokenizer), under ``tmp_path``."""
    d = tmp_path / "model"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"num_attention_heads": 4, "num_key_value_heads": 1}))
    (d / "model.safetensors").write_bytes(b"\x00weights" * 100)
    (d / "tokenizer.json").write_text("{}")
    return d


@pytest.fixture
def model_dir(tmp_path) -> Path:
    return fake_model(tmp_path)


# -- what the key is made of ------------------------------------------------------------------------------------


def test_model_files_are_hashed_once_while_unchanged(tmp_path, model_dir, monkeypatch):
    memo = tmp_path / "memo.json"
    calls: list[Path] = []
    real = bc.sha256_of

    def counted(p: Path) -> str:
        calls.append(p)
        return real(p)

    monkeypatch.setattr(bc, "sha256_of", counted)
    h1 = bc.files_hash(model_dir, memo)
    assert len(calls) == 3
    assert bc.files_hash(model_dir, memo) == h1 and len(calls) == 3  # from the memo
    (model_dir / "tokenizer.json").write_text('{"x": 1}')
    h2 = bc.files_hash(model_dir, memo)
    assert h2 != h1 and len(calls) == 4  # only the changed file again
    (model_dir / "sub").mkdir()
    (model_dir / "sub" / "a").write_text("")
    assert bc.files_hash(model_dir, memo) != h2  # a new (even empty) file: another hash
    memo.write_text("not json")  # a broken memo is only a slower hash
    assert bc.files_hash(model_dir, memo) == bc.files_hash(model_dir, None)


def test_a_hub_model_is_keyed_by_its_cached_revision_or_by_its_id_with_a_note(tmp_path):
    hub = tmp_path / "hub"
    got = bc.model_identity("org/m", hub_cache=hub)
    assert got["revision"] is None and "id alone" in got["note"]
    ref = hub / "models--org--m" / "refs" / "main"
    ref.parent.mkdir(parents=True)
    ref.write_text("abc123\n")
    assert bc.model_identity("org/m", hub_cache=hub) == {"kind": "hub", "id": "org/m", "revision": "abc123"}


def test_threads_per_rank():
    assert bc.threads_per_rank("0") == "threads 1"
    assert bc.threads_per_rank("0-3|4,5") == "threads 4|2"
    assert bc.threads_per_rank("auto") == "auto"


# -- entries --------------------------------------------------------------------------------------------------------


def completion(pid: str, ids=(5, 7, 9), text="a b c") -> Completion:
    return Completion(
        pid, tuple(ids), tuple({t: -0.1 * i, t + 1: -2.5, 3: -math.inf} for i, t in enumerate(ids)), text, "length", 12
    )


def answers(failures=(), load_failed=False) -> Answers:
    comp = CompletionRun(
        [completion("p00-w1"), completion("p01-w2", (1, 2), "ünï")], {"p00-w1": 0.25, "p01-w2": 0.5}, list(failures)
    )
    reqs = [
        LoadRequest("load000-t33", 33, "k*bs+1", 16),
        LoadRequest("load001-t32", 32, "k*bs", 160, "decode", 3),
        LoadRequest("load002-t31", 31, "k*bs-1", 16, "prefill"),
    ]
    load = LoadRun(
        [
            LoadOutcome(
                reqs[0],
                "failed" if load_failed else "ok",
                None if load_failed else completion("load000-t33"),
                0.01,
                0.2,
            ),
            LoadOutcome(reqs[1], "skipped", detail="an abort request; not sent to a reference server"),
            LoadOutcome(reqs[2], "skipped"),
        ],
        1.5,
        2,
    )
    ev = EvalRun(
        "gsm8k_offline",
        0.5,
        {0: Sample(0, "h0", "#### 4", "4", True), 1: Sample(1, "h1", "x", "[invalid]", False)},
        "0.4.13",
        "/runs/a/lm_eval/baseline",
    )
    return Answers(comp, load, ev)


def test_an_entry_round_trips_completions_load_and_eval(cache_here):
    r = answers()
    inputs = {"x": 1}
    k = bc.cache_key(inputs)
    assert r.load is not None
    reqs = [o.request for o in r.load.outcomes]
    prompts = {q.id: [1, 2, 3] for q in reqs}
    bc.write_entry(
        cache_here, k, inputs, r, {"from_run": "/runs/a", "created": "2026-01-01T00:00:00+00:00"}, reqs, prompts
    )
    e = bc.read_entry(cache_here, k)
    assert e.completions == r.completions and e.load == r.load and e.eval == r.eval
    assert e.completions.completions[0].top_logprobs[0][3] == -math.inf  # int token ids and -inf survive JSON
    assert e.load_requests == reqs and e.load_prompts == prompts
    assert e.meta["from_run"] == "/runs/a"
    failed = answers(failures=[RequestFailed("p02-w3", 500, "boom")])
    bc.write_entry(cache_here, k, inputs, failed, {})
    got = bc.read_entry(cache_here, k).completions.failures[0]
    assert (got.prompt_id, got.status, got.detail) == ("p02-w3", 500, "boom")


@pytest.mark.parametrize("damage", ["truncated", "not json", "tampered answer", "other format", "other key", "empty"])
def test_a_broken_entry_is_a_miss(cache_here, damage):
    inputs = {"x": 1}
    k = bc.cache_key(inputs)
    path = bc.write_entry(cache_here, k, inputs, answers(), {})
    text = path.read_text()
    d = json.loads(text)
    if damage == "truncated":
        path.write_text(text[: len(text) // 2])
    elif damage == "not json":
        path.write_text("\x00\x01garbage")
    elif damage == "tampered answer":
        d["payload"]["result"]["completions"]["completions"][0]["token_ids"][0] = 99
        path.write_text(json.dumps(d))
    elif damage == "other format":
        d["format"] = 999
        path.write_text(json.dumps(d))
    elif damage == "other key":
        d["inputs"] = {"x": 2}
        path.write_text(json.dumps(d))
    else:
        path.write_text("")
    with pytest.raises(bc.CacheMiss):
        bc.read_entry(cache_here, k)


def test_two_writers_never_leave_half_an_entry(cache_here):
    inputs = {"x": 1}
    k = bc.cache_key(inputs)
    stop = threading.Event()
    seen: list[str] = []
    errors: list[BaseException] = []

    def writer(n: int):
        try:
            for i in range(25):
                bc.write_entry(cache_here, k, inputs, answers(), {"from_run": f"/runs/{n}-{i}"})
        except Exception as e:  # noqa: BLE001 - a thread's failure is surfaced by the assertion below
            errors.append(e)

    def reader():
        while not stop.is_set():
            try:
                seen.append(bc.read_entry(cache_here, k).meta["from_run"])
            except bc.CacheMiss as e:
                assert str(e) == "no entry", e  # before the first rename only; never a half entry
                seen.append("miss")

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(4)]
    r = threading.Thread(target=reader)
    r.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    r.join()
    assert not errors
    assert any(s != "miss" for s in seen)
    assert bc.read_entry(cache_here, k).meta["from_run"].startswith("/runs/")
    assert [p.name for p in (cache_here / k).iterdir()] == [bc.ENTRY_FILE]  # no temporary file left behind


def test_the_prefix_cache_scenarios_answers_and_prompts_round_trip(cache_here):
    r = answers()
    r.prefix = CompletionRun(
        [completion("pfx-3bs-cold"), completion("pfx-3bs-again", (4, 4))], {"pfx-3bs-cold": 0.1}, []
    )
    cases = plan_prefix(32)[:2]
    prompts = {c.id: list(range(c.length)) for c in cases}
    inputs = {"x": 2}
    k = bc.cache_key(inputs)
    bc.write_entry(cache_here, k, inputs, r, {}, prefix_cases=cases, prefix_prompts=prompts)
    e = bc.read_entry(cache_here, k)
    assert e.prefix == r.prefix and e.prefix_cases == cases and e.prefix_prompts == prompts
    r.prefix.failures.append(RequestFailed("pfx-short-cold", 500, "boom"))
    assert "prefix-cache" in (bc.cacheable(r) or "")  # a failed scenario request is no answer to reuse
