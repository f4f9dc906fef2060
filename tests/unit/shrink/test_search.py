"""The shrink search with a fake oracle: which axes a failure needs, the smallest failing configuration, the budget."""

import json

import pytest

from harness.core.errors import ConfigError
from harness.shrink.cli import render, start_of
from harness.shrink.search import Probe, Settings, shrink

# The block-size finding as measured: fails whenever P's and D's block sizes differ, at any TP, load or prefix cache.
START = Settings(tp_p=1, tp_d=2, block_size_p=32, block_size_d=64, prefix_caching_d=True, load_requests=96)


def oracle(rule):
    seen = []

    def probe(s: Settings) -> Probe:
        seen.append(s)
        return Probe(s, rule(s))

    return probe, seen


def test_a_block_size_failure_shrinks_to_p1_d1_with_unequal_blocks():
    probe, seen = oracle(lambda s: "output-mismatch" if s.block_size_p != s.block_size_d else "ok")
    r = shrink(START, "output-mismatch", probe)
    assert r.minimal == Settings(1, 1, 32, 64, False, 0, None) and r.cut is None
    verdicts = {a.axis: a.verdict for a in r.axes}
    assert verdicts == {
        "load": "irrelevant",
        "prefix cache": "irrelevant",
        "KV dtype": "minimal",
        "TP": "irrelevant",
        "block sizes": "needed",
    }
    needed = next(a for a in r.axes if a.axis == "block sizes")
    assert needed.words.startswith("needs block_size_p 32 != block_size_d 64 (simpler: ")
    assert "block 32/32: ok" in needed.words and "block 64/64: ok" in needed.words
    assert len(seen) == 5 and "needs block_size_p 32 != block_size_d 64" in r.summary()
    assert "KV dtype not needed (already KV dtype auto in the run)" in r.summary()


def test_another_class_on_a_simpler_setting_keeps_the_axis():
    # at TP 1/1 the pair is refused for another reason: TP is then needed for *this* failure
    probe, _ = oracle(lambda s: "unsupported" if s.tp_d == 1 else "output-mismatch")
    r = shrink(Settings(1, 2, 32, 32), "output-mismatch", probe)
    tp = next(a for a in r.axes if a.axis == "TP")
    assert tp.verdict == "needed" and "(simpler: P TP1 -> D TP1: unsupported)" in tp.words
    assert r.minimal.tp_d == 2


def test_the_budget_cuts_the_search_and_says_so():
    probe, seen = oracle(lambda s: "output-mismatch")
    r = shrink(START, "output-mismatch", probe, max_probes=2)
    assert len(seen) == 2 and r.cut == "2 probes, the budget is 2"
    assert [a.verdict for a in r.axes] == ["irrelevant", "irrelevant", "minimal", "undecided", "undecided"]
    assert "[CUT: 2 probes" in r.summary()
    clock = iter([0.0, 0.0, 10.0, 5000.0, 5000.0])
    r = shrink(START, "output-mismatch", oracle(lambda s: "ok")[0], max_seconds=100, clock=lambda: next(clock))
    assert (r.cut or "").endswith("the budget is 100 s")


def test_settings_validate_when_built_and_become_e2e_flags():
    with pytest.raises(ValueError, match="TP sizes must be >= 1"):
        Settings(0, 1, None, None)
    assert Settings(2, 4, 32, 64, True, 0, "fp8").flags() == [
        "--tp-p",
        "2",
        "--tp-d",
        "4",
        "--load-requests",
        "0",
        "--block-size-p",
        "32",
        "--block-size-d",
        "64",
        "--kv-cache-dtype",
        "fp8",
        "--prefix-caching-d",
    ]


def report(top=None, **over):
    cfg = {
        "tp_p": 1,
        "tp_d": 2,
        "block_size_p": 32,
        "block_size_d": 64,
        "device": "cpu",
        "python": "/venv/bin/python",
        "model": None,
        "resolved_model": "/no/such/folder",
        "max_tokens": 16,
        "proxy_fault": "none",
        "decode_kv_fault": None,
        "load": {"requests": 96},
        "axes": {"prefix_caching_d": False, "kv_cache_dtype": None, "attention_backend": "CPU_MLA"},
    }
    cfg.update(over)
    return {"verdict": "fail", "failure": {"class": "output-mismatch"}, "config": cfg, **(top or {})}


def test_what_a_run_folder_gives_the_search_and_what_is_refused():
    cls, start, carried, bad = start_of(report())
    assert cls == "output-mismatch" and start == Settings(1, 2, 32, 64, False, 96, None) and bad == ()
    assert carried[:2] == ["--device", "cpu"] and "--attention-backend" in carried and "CPU_MLA" in carried
    assert "--model" not in carried  # the run's default model: the probes build the same one
    for top, cfg, said in (
        ({"verdict": "pass", "failure": None}, {}, "the run passed"),
        ({}, {"attach": {"x": 1}}, "attach"),
        ({}, {"proxy_fault": "corrupt-block-ids"}, "injected fault"),
        ({"simulated": "SIMULATED"}, {}, "simulated"),
    ):
        with pytest.raises(ConfigError, match=said):
            start_of(report(top, **cfg))


def test_the_report_page_names_the_minimal_command(tmp_path):
    probe, _ = oracle(lambda s: "output-mismatch" if s.block_size_p != s.block_size_d else "ok")
    r = shrink(START, "output-mismatch", probe)
    md = render(r, ["--device", "cpu"], tmp_path)
    assert (
        "`python -m harness e2e --device cpu --tp-p 1 --tp-d 1 --load-requests 0 --block-size-p 32 --block-size-d 64`"
    ) in md
    assert "- **block sizes** (needed): needs block_size_p 32 != block_size_d 64" in md
    assert json.dumps(r.to_dict())  # shrink.json is plain JSON


def test_one_failing_prompt_alone_is_tried_shortest_first():
    probe, seen = oracle(lambda s: "output-mismatch" if s.prompts != ("p01-w2",) else "ok")
    r = shrink(Settings(1, 1, 32, 64), "output-mismatch", probe, failing_prompts=("p01-w2", "p03-w5", "p09-w32"))
    assert r.minimal.prompts == ("p03-w5",) and r.minimal.flags()[-2:] == ["--prompts", "p03-w5"]
    prompts = next(a for a in r.axes if a.axis == "prompts")
    assert prompts.verdict == "irrelevant"
    assert prompts.words == "one prompt is enough (still output-mismatch with prompt p03-w5 alone)"
    assert [s.prompts for s in seen if s.prompts] == [("p01-w2",), ("p03-w5",)]


def test_the_failing_prompts_of_a_run_come_shortest_first():
    d = report()
    d["comparison"] = {
        "top_k": 5,
        "prompts": [
            {"prompt_id": "p09-w32", "status": "mismatch", "max_logprob_delta": None, "divergence": {"position": 0}},
            {"prompt_id": "p02-w3", "status": "mismatch", "max_logprob_delta": None, "divergence": {"position": 0}},
            {"prompt_id": "p00-w1", "status": "exact", "max_logprob_delta": 0.0},
        ],
    }
    d["load"] = {
        "comparison": {
            "prompts": [
                {
                    "prompt_id": "load001-t31",
                    "status": "mismatch",
                    "max_logprob_delta": 0.1,
                    "divergence": {"position": 0},
                }
            ]
        }
    }
    assert start_of(d)[3] == ("p02-w3", "p09-w32")  # load requests are not sequential prompts
