"""prompts.json: every prompt a run sent, by id, for the repro bundles."""

from types import SimpleNamespace
from typing import cast

from harness.run.context import RunContext
from harness.run.prompts_file import read_prompts, write_prompts
from harness.workload.prompts import prompt_set


def test_every_prompt_of_a_run_comes_back_by_its_id(tmp_path):
    ctx = SimpleNamespace(
        prompts=prompt_set(0)[:2], load_prompts={"load000-t31": [1, 2, 3]}, prefix_prompts={"prefix-hit": [4, 5]}
    )
    write_prompts(cast(RunContext, ctx), tmp_path)
    got = read_prompts(tmp_path)
    assert got == {
        prompt_set(0)[0].id: prompt_set(0)[0].text,
        prompt_set(0)[1].id: prompt_set(0)[1].text,
        "load000-t31": [1, 2, 3],
        "prefix-hit": [4, 5],
    }
    assert read_prompts(tmp_path / "no-such-run") == {}


def test_a_run_can_send_only_some_of_the_sequential_prompts():
    import pytest

    from harness.core.errors import ConfigError
    from harness.run.config import E2EConfig
    from harness.run.pipeline import selected_prompts

    cfg = E2EConfig(prompt_ids=("p03-w5", "p01-w2"))
    cfg.validate()
    assert [p.id for p in selected_prompts(cfg)] == ["p01-w2", "p03-w5"]  # in the set's order
    assert len(selected_prompts(E2EConfig())) == 18
    with pytest.raises(ConfigError, match="unknown prompt id"):
        E2EConfig(prompt_ids=("p99-w1",)).validate()


def test_a_narrowed_run_passes_on_the_prompts_it_selected_and_a_full_one_needs_sixteen():
    from harness.checks.compare import compare_completions
    from harness.run.evaluate import MIN_PROMPTS, match_check
    from harness.workload.completion import Completion

    one = [Completion("p01-w2", (5, 6), ({5: -0.1}, {6: -0.1}), "")]
    result = compare_completions(one, one)
    assert match_check(result, 1).passed  # e2e --prompts p01-w2: the one prompt it sent matched
    c = match_check(result)
    assert not c.passed and f"fewer than {MIN_PROMPTS} prompts compared" in c.detail
