"""Accuracy: lm-eval's command line, reading its output, the per-sample diff, the tolerance and the checks (no
servers)."""

import json
from pathlib import Path

import pytest

from harness.accuracy.checks import accuracy_checks, check_through_pd, diff_samples, max_differing, score_tolerance
from harness.accuracy.lm_eval import AccuracyFailed, lm_eval_argv, read_eval_output
from harness.accuracy.settings import AccuracySettings

S = AccuracySettings(task="gsm8k_offline", include_path="/tasks/offline", limit=50)


def write_output(root, answers, task="gsm8k_offline", score=None, prompt="p"):
    """An lm-eval output folder as 0.4.13 writes it: results_*.json and samples_<task>_*.jsonl under a model folder."""
    d = root / "tiny-llama"
    d.mkdir(parents=True, exist_ok=True)
    right = sum(ok for _, ok in answers.values())
    score = right / len(answers) if score is None else score
    (d / "results_2026-12-03T10-00-00.json").write_text(
        json.dumps(
            {
                "results": {task: {"exact_match,strict-match": score, "exact_match,flexible-extract": 0.0}},
                "lm_eval_version": "0.4.13",
            }
        )
    )
    rows = []
    for doc_id, (text, ok) in answers.items():
        for flt in ("strict-match", "flexible-extract"):
            rows.append(
                {
                    "doc_id": doc_id,
                    "resps": [[text]],
                    "filtered_resps": [text.split("#### ")[-1]],
                    "filter": flt,
                    "prompt_hash": f"{prompt}{doc_id}",
                    "exact_match": float(ok) if flt == "strict-match" else 0.0,
                }
            )
    (d / f"samples_{task}_2026-12-03T10-00-00.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return root


def answers(n=40, wrong=(), differ=()):
    return {i: (f"x #### {i}" if i not in differ else f"y #### {i}", i not in wrong) for i in range(n)}


def test_the_command_line_is_the_same_for_both_runs_but_the_url():
    a = lm_eval_argv("/py", "http://127.0.0.1:1", "m", S, Path("/out/pd"))
    b = lm_eval_argv("/py", "http://127.0.0.1:2", "m", S, Path("/out/baseline"))
    assert a[:3] == ["/py", "-m", "lm_eval"] and "--log_samples" in a and "--use_cache" not in a
    margs = a[a.index("--model_args") + 1]
    assert "base_url=http://127.0.0.1:1/v1/completions" in margs
    assert "tokenizer_backend=None" in margs and "tokenized_requests=False" in margs
    assert a[a.index("--include_path") + 1] == "/tasks/offline" and a[a.index("--limit") + 1] == "50"
    assert [x for x in a if "127.0.0.1" not in x and "/out/" not in x] == [
        x for x in b if "127.0.0.1" not in x and "/out/" not in x
    ]


def test_reads_score_and_samples_of_the_chosen_filter(tmp_path):
    run = read_eval_output(write_output(tmp_path, answers(wrong={3})), S)
    assert run.n == 40 and run.score == pytest.approx(39 / 40) and run.lm_eval_version == "0.4.13"
    assert run.samples[3].correct is False and run.samples[0].response == "x #### 0" and run.samples[0].extracted == "0"


def test_no_output_is_a_clear_failure(tmp_path):
    with pytest.raises(AccuracyFailed, match="no results"):
        read_eval_output(tmp_path, S)


def test_diff_names_differing_responses_and_flips(tmp_path):
    base = read_eval_output(write_output(tmp_path / "b", answers()), S)
    pd = read_eval_output(write_output(tmp_path / "p", answers(wrong={5}, differ={5, 7})), S)
    d = diff_samples(base, pd)
    assert (d.compared, d.differing, d.flips, d.unpaired) == (40, [5, 7], [(5, True, False)], [])


def test_a_different_prompt_is_not_compared(tmp_path):
    base = read_eval_output(write_output(tmp_path / "b", answers(4)), S)
    pd = read_eval_output(write_output(tmp_path / "p", answers(4), prompt="q"), S)
    assert diff_samples(base, pd).unpaired == [0, 1, 2, 3]


def test_tolerance_shrinks_with_more_samples_and_is_never_below_one_sample():
    assert score_tolerance(100, 0.9) == pytest.approx(0.09)
    assert score_tolerance(400, 0.9) < score_tolerance(100, 0.9)
    assert score_tolerance(50, 1.0) == pytest.approx(1 / 50)
    assert max_differing(40) == 2 and max_differing(10) == 1


def test_identical_runs_pass_every_check(tmp_path):
    base = read_eval_output(write_output(tmp_path / "b", answers(wrong={1})), S)
    pd = read_eval_output(write_output(tmp_path / "p", answers(wrong={1})), S)
    checks, block = accuracy_checks(base, pd, AccuracySettings(task="gsm8k_offline", min_baseline_score=0.8))
    assert all(c.passed for c in checks), checks
    assert {c.name for c in checks} == {
        "accuracy_samples_paired",
        "accuracy_pd_within_tolerance",
        "accuracy_responses_agree",
        "accuracy_baseline_meaningful",
    }
    assert (block["samples"], block["delta"], block["differing_responses"], block["score_flips"]) == (40, 0.0, 0, 0)


def test_a_broken_transfer_fails_with_reasons(tmp_path):
    base = read_eval_output(write_output(tmp_path / "b", answers()), S)
    broken = read_eval_output(write_output(tmp_path / "p", answers(wrong=set(range(30)), differ=set(range(30)))), S)
    checks = {c.name: c for c in accuracy_checks(base, broken, S)[0]}
    assert (
        not checks["accuracy_pd_within_tolerance"].passed
        and "delta -0.750" in checks["accuracy_pd_within_tolerance"].detail
    )
    assert (
        not checks["accuracy_responses_agree"].passed
        and "30/40 responses differ" in checks["accuracy_responses_agree"].detail
    )
    assert "doc 0: baseline 'x #### 0' vs P/D 'y #### 0'" in checks["accuracy_responses_agree"].detail


def test_a_few_differing_responses_with_equal_scores_still_fail_the_agreement(tmp_path):
    base = read_eval_output(write_output(tmp_path / "b", answers()), S)
    pd = read_eval_output(write_output(tmp_path / "p", answers(differ={1, 2, 3})), S)
    checks = {c.name: c.passed for c in accuracy_checks(base, pd, S)[0]}
    assert checks["accuracy_pd_within_tolerance"] and not checks["accuracy_responses_agree"]


def test_baseline_too_weak_and_expected_score(tmp_path):
    base = read_eval_output(write_output(tmp_path / "b", answers(wrong=set(range(20)))), S)
    pd = read_eval_output(write_output(tmp_path / "p", answers(wrong=set(range(20)))), S)
    checks = {
        c.name: c.passed
        for c in accuracy_checks(
            base, pd, AccuracySettings(task="gsm8k_offline", min_baseline_score=0.8, expected_score=0.41)
        )[0]
    }
    assert checks["accuracy_baseline_meaningful"] is False and checks["accuracy_matches_expected"] is False
    checks = {
        c.name: c.passed
        for c in accuracy_checks(base, pd, AccuracySettings(task="gsm8k_offline", expected_score=0.52))[0]
    }
    assert checks["accuracy_matches_expected"] is True


def test_lm_eval_requests_must_take_the_pd_path():
    before = {"prefill_with_kv_transfer_params": 16, "prefill_missing_kv_transfer_params": 0}
    ok = check_through_pd(
        40, before, {"prefill_with_kv_transfer_params": 56, "prefill_missing_kv_transfer_params": 0}, 40
    )
    assert ok.passed
    assert not check_through_pd(40, before, {"prefill_with_kv_transfer_params": 56}, 0).passed  # no NIXL read
    assert not check_through_pd(40, before, {"prefill_with_kv_transfer_params": 30}, 40).passed  # bypassed P


def test_an_unresolved_task_is_a_programming_error():
    with pytest.raises(ValueError):
        lm_eval_argv("/py", "http://x", "m", AccuracySettings(), Path("/out"))


def test_the_model_decides_task_include_path_and_the_bar():
    from pathlib import Path

    from harness.accuracy.resolve import resolve_accuracy
    from harness.models.trained import TRAINED_NAME

    trained = resolve_accuracy(AccuracySettings(), "/models/trained", TRAINED_NAME)
    assert trained.task == "gsm8k_offline" and trained.min_baseline_score == 0.8 and trained.expected_score is None
    assert trained.include_path is not None and (Path(trained.include_path) / "gsm8k_offline.yaml").exists()
    hub = resolve_accuracy(AccuracySettings(), "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", hub_reachable=lambda: True)
    assert (hub.task, hub.include_path, hub.expected_score, hub.min_baseline_score) == ("gsm8k", None, 0.41, None)
    # a published score holds for the full task only
    assert (
        resolve_accuracy(AccuracySettings(limit=100), "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", lambda: True).expected_score
        is None
    )
    # no way to load the real dataset: the offline task, and no published score to compare with
    off = resolve_accuracy(AccuracySettings(), "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", hub_reachable=lambda: False)
    assert (off.task, off.expected_score) == ("gsm8k_offline", None) and off.include_path


def test_is_the_real_gsm8k_reachable(tmp_path):
    from harness.accuracy.lm_eval import hub_dataset_reachable

    assert not hub_dataset_reachable({"HF_HUB_OFFLINE": "1"}, tmp_path, probe=lambda: True)
    assert hub_dataset_reachable({}, tmp_path, probe=lambda: True) and not hub_dataset_reachable(
        {}, tmp_path, probe=lambda: False
    )
    (tmp_path / "datasets--openai--gsm8k").mkdir()
    assert hub_dataset_reachable({"HF_HUB_OFFLINE": "1"}, tmp_path, probe=lambda: False)  # cached locally


def test_a_hub_task_keeps_lm_evals_generation_settings_and_only_the_offline_task_sets_its_own():
    """Issue 35 item 2: real GSM8K answers were cut at 64 tokens (max_gen_toks=64 for every task), so chain-of-thought
    answers lost their final `#### N` and the published-score check could not pass."""
    from harness.accuracy.resolve import resolve_accuracy

    hub = resolve_accuracy(AccuracySettings(), "Qwen/Qwen3-0.6B", "Qwen/Qwen3-0.6B", hub_reachable=lambda: True)
    argv = lm_eval_argv("/py", "http://x", "m", hub, Path("/out"))
    assert hub.max_gen_toks is None and "--gen_kwargs" not in argv and not any("max_gen_toks" in a for a in argv)
    off = resolve_accuracy(AccuracySettings(), "/models/trained", "trained", hub_reachable=lambda: False)
    argv = lm_eval_argv("/py", "http://x", "m", off, Path("/out"))
    assert off.task == "gsm8k_offline" and argv[argv.index("--gen_kwargs") + 1] == (
        "max_gen_toks=64,temperature=0,do_sample=False"
    )
    # a length given by hand applies to any task
    given = lm_eval_argv("/py", "http://x", "m", AccuracySettings(task="gsm8k", max_gen_toks=512), Path("/out"))
    assert given[given.index("--gen_kwargs") + 1].startswith("max_gen_toks=512,")
