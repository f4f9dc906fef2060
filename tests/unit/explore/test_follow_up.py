"""explore's follow-ups of a new signature (the control without P/D, shrink, the repro bundle and its ISSUE.md) with
fakes instead of vLLM: once per signature, recorded step by step, a failing step recorded without stopping explore,
resume running only what is not recorded, --no-follow-up skipping with the reason, and a failure the control shows
without P/D not counted as a P/D finding. Then the real control's plan and judgement, pure."""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.explore import cli
from harness.explore.cli import explore
from harness.explore.follow_up import NO_FOLLOW_UP, STEPS, FollowUp, Smallest
from harness.explore.no_pd_control import ControlResult, control_plan, judge, run_prompts
from harness.explore.results import findings, render
from harness.explore.sample import Sampler
from harness.serve.ports import ServerPorts
from harness.serve.vllm_cmd import ServerSpec, build_server_command
from harness.workload.client import CompletionRun, GenerationSettings
from harness.workload.completion import Completion
from tests.unit.explore.test_explore import PlantedFault, new_explore

SIGNATURE = "kv-digest-mismatch (kv_digest_match)"  # PlantedFault's


class FakeFollowUp:
    """Records each call; ``control_outcome`` is what the plain server shows; ``fail`` makes a step raise."""

    def __init__(self, tmp: Path, control_outcome: str = "ok", fail: dict[str, BaseException] | None = None):
        self.tmp, self.control_outcome, self.fail = tmp, control_outcome, fail or {}
        self.calls: list[tuple[str, str]] = []

    def _call(self, step: str, run_dir: Path) -> None:
        self.calls.append((step, str(run_dir)))
        if step in self.fail:
            raise self.fail[step]

    def control(self, run_dir: Path) -> ControlResult:
        self._call("control", run_dir)
        return ControlResult(self.control_outcome, str(self.tmp / "ctl"), "" if self.control_outcome == "ok" else "d")

    def shrink(self, run_dir: Path) -> Smallest:
        self._call("shrink", run_dir)
        return Smallest("P TP1 -> D TP1, block 16/16", str(self.tmp / "shrink"), str(self.tmp / "probe-02"))

    def bundle(self, run_dir: Path) -> Path:
        self._call("bundle", run_dir)
        out = self.tmp / "repro"
        out.mkdir(exist_ok=True)
        (out / "ISSUE.md").write_text("# the issue\n")
        return out

    def follow_up(self) -> FollowUp:
        return FollowUp(self.control, self.shrink, self.bundle)


def run(tmp_path, fu: FakeFollowUp | None, runs: int = 24, resume: bool = False, oracle=None):
    ex = new_explore(tmp_path, oracle or PlantedFault(), resume=resume)
    ex.follow_up = fu.follow_up() if fu else None
    explore(ex, Sampler(ex.space, 5, covered=ex.results.covered()), runs=runs, hours=None)
    return ex


def test_a_new_signature_is_followed_up_once_and_a_second_sample_of_it_is_only_counted(tmp_path):
    fu = FakeFollowUp(tmp_path)
    ex = run(tmp_path, fu)
    [row] = findings(ex.results)
    assert row["count"] >= 2  # more samples showed it than were followed up
    first = f"/runs/{row['first']}"
    assert fu.calls == [("control", first), ("shrink", first), ("bundle", first)]
    rec = ex.results.follow_ups[SIGNATURE]
    assert {k: s.status for k, s in rec.steps.items()} == dict.fromkeys(STEPS, "done")
    assert rec.pd_words() == "needs P/D"
    assert rec.steps["shrink"].outcome == "P TP1 -> D TP1, block 16/16"
    assert rec.steps["shrink"].run_dir == str(tmp_path / "probe-02")
    issue = tmp_path / "repro" / "ISSUE.md"
    assert rec.steps["issue"].path == str(issue)
    assert "## Control without P/D" in issue.read_text() and "needs P/D" in issue.read_text()
    saved = json.loads((tmp_path / "explore.json").read_text())["follow_ups"]
    assert saved[0]["signature"] == SIGNATURE and saved[0]["steps"]["bundle"]["path"] == str(tmp_path / "repro")
    page = render(ex.results, ex.space)
    assert "1 new P/D finding(s), 0 new that need no P/D" in page
    assert f"control without P/D: ok ({tmp_path / 'ctl'})" in page and f"bundle: {tmp_path / 'repro'}" in page


def test_a_failure_the_control_shows_without_pd_is_not_a_pd_finding(tmp_path):
    fu = FakeFollowUp(tmp_path, control_outcome="kv-digest-mismatch")
    ex = run(tmp_path, fu)
    assert [c[0] for c in fu.calls] == ["control"]  # neither shrunk nor bundled
    rec = ex.results.follow_ups[SIGNATURE]
    assert rec.needs_pd is False and rec.pd_words() == "needs no P/D"
    later = [rec.steps[s] for s in ("shrink", "bundle", "issue")]
    assert all(s.status == "skipped" and "not a P/D finding" in s.why for s in later)
    page = render(ex.results, ex.space)
    assert "0 new P/D finding(s), 1 new that need no P/D" in page
    assert f"**new, needs no P/D** `{SIGNATURE}`" in page


def test_a_control_that_fails_otherwise_leaves_the_finding_a_pd_one_and_undecided(tmp_path):
    fu = FakeFollowUp(tmp_path, control_outcome="output-mismatch")
    ex = run(tmp_path, fu)
    rec = ex.results.follow_ups[SIGNATURE]
    assert rec.needs_pd is None and "failed otherwise (output-mismatch)" in rec.pd_words()
    assert [c[0] for c in fu.calls] == ["control", "shrink", "bundle"]
    assert "1 new P/D finding(s)" in render(ex.results, ex.space)


def test_a_failing_step_is_recorded_with_its_error_and_explore_goes_on(tmp_path):
    fu = FakeFollowUp(
        tmp_path,
        fail={"control": RuntimeError("the baseline did not serve:\nbaseline: exited"), "bundle": ConfigError("no")},
    )
    ex = run(tmp_path, fu, runs=24)
    assert sum(r.status == "ran" for r in ex.results.samples) == 24  # every sample still ran
    steps = ex.results.follow_ups[SIGNATURE].steps
    assert steps["control"].status == "failed"
    assert steps["control"].why == "RuntimeError: the baseline did not serve: baseline: exited"  # one line
    assert steps["shrink"].status == "done"  # an undecided control: the finding is still shrunk
    assert (steps["bundle"].status, steps["bundle"].why) == ("failed", "no")
    assert steps["issue"].status == "skipped" and "no bundle (no)" in steps["issue"].why
    page = render(ex.results, ex.space)
    assert "control: failed: RuntimeError" in page and "issue: skipped: no bundle (no)" in page


def test_resume_runs_no_follow_up_already_recorded_and_ends_one_an_interrupt_cut(tmp_path):
    first = FakeFollowUp(tmp_path, fail={"shrink": KeyboardInterrupt()})
    with pytest.raises(KeyboardInterrupt):
        run(tmp_path, first)
    assert [c[0] for c in first.calls] == ["control", "shrink"]
    again = FakeFollowUp(tmp_path)
    ex = run(tmp_path, again, runs=8, resume=True)
    assert [c[0] for c in again.calls] == ["shrink", "bundle"]  # the control was recorded before the interrupt
    assert all(s.status == "done" for s in ex.results.follow_ups[SIGNATURE].steps.values())
    third = FakeFollowUp(tmp_path)
    run(tmp_path, third, runs=8, resume=True)
    assert third.calls == []


def test_no_follow_up_skips_every_step_with_the_reason_and_a_later_resume_runs_them(tmp_path):
    ex = run(tmp_path, None, runs=12)
    steps = ex.results.follow_ups[SIGNATURE].steps
    assert all((s.status, s.why) == ("skipped", NO_FOLLOW_UP) for s in steps.values()) and len(steps) == 4
    assert f"control: skipped: {NO_FOLLOW_UP}" in render(ex.results, ex.space)
    fu = FakeFollowUp(tmp_path)
    run(tmp_path, fu, runs=4, resume=True)
    assert [c[0] for c in fu.calls] == ["control", "shrink", "bundle"]


def test_the_cli_takes_no_follow_up():
    parser = argparse.ArgumentParser()
    cli.add_parser(parser.add_subparsers())
    assert parser.parse_args(["explore", "--runs", "1", "--no-follow-up"]).no_follow_up is True
    assert parser.parse_args(["explore", "--runs", "1"]).no_follow_up is False


# -- the real control, pure parts --------------------------------------------------------------------------------


def pair_report(prefix_cache: bool = True, chunk: int | None = 64, baseline: bool = True) -> dict:
    ports = ServerPorts(8100, 5600, 20000, 8)
    tiny = ServerSpec(role="baseline", model="/models/tiny", served_model_name="tiny", block_size=32, cpu_bind="1")
    d_spec = replace(tiny, role="decode", prefix_caching=prefix_cache, kv_digest_dir="/run/kv_digest/decode")
    decode = build_server_command(d_spec, ports, "/venv/bin/python")
    base = build_server_command(tiny, ports, "/venv/bin/python")
    axes = {"prefix_caching_d": prefix_cache, "max_num_batched_tokens_p": chunk}
    cfg = {"axes": axes, "served_model_name": "tiny", **({"baseline_command": base.shell()} if baseline else {})}
    return {"config": cfg, "commands": {"decode": decode.shell(), "prefill": "..."}}


def test_the_control_server_is_d_without_its_connector_and_hooks_with_p_chunked_prefill():
    plan = control_plan(pair_report())
    argv, env = plan.control.argv, plan.control.env
    assert "--kv-transfer-config" not in argv and "--enable-prefix-caching" in argv
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "64" and argv[argv.index("--block-size") + 1] == "32"
    assert not [k for k in env if k.startswith(("VLLM_NIXL_", "PD_HARNESS_")) or k == "PYTHONPATH"]
    assert env["VLLM_CPU_OMP_THREADS_BIND"] == "1"
    assert plan.carried == ("D's prefix cache", "P's chunked prefill (--max-num-batched-tokens 64)")
    assert plan.baseline is not None and "--no-enable-prefix-caching" in plan.baseline.argv
    assert control_plan(pair_report(baseline=False)).baseline is None
    with pytest.raises(ConfigError, match="no decode command"):
        control_plan({"config": {}, "commands": {}})


def completion(pid: str, tokens: tuple[int, ...]) -> Completion:
    return Completion(pid, tokens, tuple({t: -0.1} for t in tokens), "x")


def test_the_control_is_judged_against_the_baseline_as_a_run_is(tmp_path):
    gen = GenerationSettings(logprobs=1)
    base = CompletionRun([completion(f"p{i}", (1, 2, 3)) for i in range(4)])
    same = CompletionRun([completion(f"p{i}", (1, 2, 3)) for i in range(4)])
    assert judge(base, same, 4, 0.1, gen, tmp_path)[0] is None
    other = CompletionRun([completion("p0", (1, 9, 9))] + same.completions[1:])
    failure, checks = judge(base, other, 4, 0.1, gen, tmp_path)
    assert failure is not None and failure["class"] == "output-mismatch"
    assert [c.name for c in checks if not c.passed] == ["outputs_match_baseline"]
    short = CompletionRun(same.completions[:3])
    assert judge(None, short, 4, 0.1, gen, tmp_path)[0] is not None  # no baseline: it must answer every prompt


def test_the_control_sends_the_runs_sequential_prompts_and_prefix_scenarios(tmp_path):
    (tmp_path / "prompts.json").write_text(
        json.dumps({"sequential": {"s0": "a b c"}, "load": {"l0": [1]}, "prefix": {"x0": [5, 6]}})
    )
    prompts = run_prompts(tmp_path)
    assert [(p.id, p.text) for p in prompts] == [("s0", "a b c"), ("x0", [5, 6])]
    # a model the harness did not make: its sequential prompts were sent as token ids, and are sent so again
    (tmp_path / "prompts.json").write_text(json.dumps({"sequential": {"s0": [1, 7, 9]}}))
    assert [(p.id, p.text) for p in run_prompts(tmp_path)] == [("s0", [1, 7, 9])]
    with pytest.raises(ConfigError, match="cannot be read"):
        run_prompts(tmp_path / "nowhere")
