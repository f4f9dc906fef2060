import io
import sys
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any, cast

import pytest
import yaml

from harness import nightly
from harness.cli import main
from harness.core.errors import ConfigError
from harness.core.paths import REPO_ROOT
from harness.envs.vllm_env import pinned
from harness.gpu.plan import GpuPlan, render_plan, uniform_gpus
from harness.matrix.config import load_matrix
from harness.nightly import (
    ACCURACY_CHECKS,
    ACCURACY_RUNS,
    E2E_CHECKS,
    Hardware,
    Step,
    StepResult,
    build_steps,
    junit_xml,
    render_dry_run,
    run_step,
    run_steps,
)
from harness.simbox.box import SIMULATED_ENV
from tests.unit.nightly.ci_bounds import worst_case_night_s

PY = "/opt/py/bin/python"


@pytest.fixture(scope="module")
def steps():
    return build_steps(uniform_gpus(8, 80.0), PY, Path("/runs/n"))


@pytest.fixture(autouse=True)
def no_caller_settings(monkeypatch):
    """The nightly reads these from its environment; a test sets what it needs."""
    for name in (SIMULATED_ENV, "CUDA_VISIBLE_DEVICES", "CUDA_DEVICE_ORDER", "VLLM_VERSION", "GPU_MEMORY_UTILIZATION"):
        monkeypatch.delenv(name, raising=False)


def child(element: ET.Element, path: str) -> ET.Element:
    """The element at ``path`` under ``element``; the test fails when there is none."""
    found = element.find(path)
    assert found is not None, path
    return found


def gpu_entries():
    return [e for e in load_matrix()[0].entries if e.device == "gpu"]


def test_steps_cover_prefetch_every_gpu_matrix_entry_and_both_accuracy_models(steps):
    ids = [s.id for s in steps]
    n = len(prefetched(steps)) + 1  # the models, then the dataset
    assert ids[0] == "doctor" and all(i.startswith("prefetch/") for i in ids[1 : n + 1])
    assert ids[n] == "prefetch/openai/gsm8k"
    assert [i for i in ids if i.startswith("matrix/")] == [f"matrix/{e.id}" for e in gpu_entries()]
    acc = [s for s in steps if s.kind == "accuracy"]
    assert [s.argv[s.argv.index("--model") + 1] for s in acc] == [m for m, _, _ in ACCURACY_RUNS]
    assert {"TinyLlama/TinyLlama-1.1B-Chat-v1.0", "Qwen/Qwen3-0.6B"} == {m for m, _, _ in ACCURACY_RUNS}
    for s in acc:
        assert s.argv[3:5] == ("e2e", "--device") and "--accuracy" in s.argv
        assert s.argv[s.argv.index("--accuracy-task") + 1] == "gsm8k"
        assert "/runs/n/" in s.argv[s.argv.index("--run-dir") + 1]


def test_matrix_steps_call_the_matrix_entry_point_and_skip_what_needs_more_gpus(steps):
    by_id = {s.id: s for s in steps}
    entries = gpu_entries()
    assert {e.gpus > 8 for e in entries} == {True, False}  # entries that fit on 8 GPUs and one that does not
    for e in entries:
        s = by_id[f"matrix/{e.id}"]
        assert s.argv[:4] == (PY, "-m", "harness", "matrix") and s.argv[s.argv.index("--only") + 1] == e.id
        if e.gpus > 8:
            assert s.skip_reason and f"needs {e.gpus} GPUs" in s.skip_reason and s.gpu_plan is None
        else:
            assert s.skip_reason is None and s.gpu_plan is not None and s.timeout_s > 0


def test_the_reported_case_is_colocated_with_d_on_all_8(steps):
    s = next(s for s in steps if s.id == "matrix/tinyllama-p2-d8")
    plan = s.gpu_plan
    assert plan.colocated and sorted(plan.server("decode").gpus) == list(range(8))
    servers = dict(s.servers)
    assert "CUDA_VISIBLE_DEVICES=0,1 " in servers["prefill0"] and "--gpu-memory-utilization 0.45" in servers["prefill0"]
    assert "--tensor-parallel-size 8" in servers["decode0"] and '"kv_role":"kv_consumer"' in servers["decode0"]
    assert "--kv-transfer-config" not in servers["baseline0"]
    assert servers["proxy"].split("--prefill ")[1].startswith("http://127.0.0.1:")


def test_accuracy_steps_leave_placement_to_the_plan(steps):
    acc = [s for s in steps if s.kind == "accuracy"]
    assert len(acc) == len(ACCURACY_RUNS)
    for s in acc:
        assert "--gpu-memory-utilization" not in s.argv  # the run applies its GPU plan per server
        servers = dict(s.servers)
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in servers["decode0"] and "CUDA_VISIBLE_DEVICES=" in servers["decode0"]


def test_accuracy_checks_include_the_published_score_only_where_there_is_one(steps):
    acc = {s.id: s for s in steps if s.kind == "accuracy"}
    assert "accuracy_matches_expected" in acc["accuracy/qwen3-0.6b-p2-d4"].checks
    assert "accuracy_matches_expected" not in acc["accuracy/tinyllama-1.1b-chat-p2-d8"].checks


def prefetched(steps) -> dict[str, str]:
    """Each model prefetch step's repo and its code (the dataset's apart)."""
    return {
        s.id.removeprefix("prefetch/"): s.argv[2]
        for s in steps
        if s.kind == "prefetch" and s.id != "prefetch/openai/gsm8k"
    }


def test_prefetch_downloads_every_model_that_runs_and_gsm8k(steps):
    models = prefetched(steps)
    serving = [s for s in steps if s.skip_reason is None and s.servers]
    assert serving
    for s in serving:
        name = dict(s.servers)["prefill0"].split("--model ")[1].split()[0]
        assert f'd("{name}", ignore_patterns=' in models[name]
    data = next(s for s in steps if s.id == "prefetch/openai/gsm8k")
    assert '"openai/gsm8k", repo_type="dataset"' in data.argv[2]
    assert not any("meta-llama" in m for m in models)  # its only entry needs 24 GPUs


def test_each_model_and_the_dataset_is_a_prefetch_step_of_its_own(steps):
    """Issue 35 item 3: the prefetch was one script over every model then gsm8k, so the first 401 (a gated model)
    stopped it and every later model and the dataset went unfetched. Each repo is now a step, a JUnit case of its
    own."""
    pre = [s for s in steps if s.kind == "prefetch"]
    assert len(pre) == len(prefetched(steps)) + 1 >= 3
    for s in pre:
        assert s.argv[2].count("d(") == 1 and s.timeout_s > 0
    by_id = {s.id: s for s in steps}
    assert all(by_id[need].kind == "prefetch" for s in steps for need in s.needs)
    accuracy = [s for s in steps if s.kind == "accuracy" and s.skip_reason is None]
    matrix = [s for s in steps if s.kind == "matrix" and s.skip_reason is None]
    assert accuracy and matrix  # each needs its prefetch steps, checked below
    for s in accuracy:
        model = s.argv[s.argv.index("--model") + 1]
        assert s.needs == (f"prefetch/{model}", "prefetch/openai/gsm8k")
    for s in matrix:
        assert len(s.needs) == 1 and s.needs[0].removeprefix("prefetch/") in dict(s.servers)["prefill0"]


def test_a_failed_prefetch_stops_nothing_and_skips_only_what_needs_its_repo(tmp_path):
    plan = cast(GpuPlan, object())  # a stand-in: these steps never use their plan
    steps = [
        Step("prefetch/org/gated", "prefetch", ("x",), 10, ("c",)),
        Step("prefetch/org/open", "prefetch", ("x",), 10, ("c",)),
        Step("prefetch/openai/gsm8k", "prefetch", ("x",), 10, ("c",)),
        Step("matrix/gated", "matrix", ("x",), 10, ("c",), 8, plan, needs=("prefetch/org/gated",)),
        Step("matrix/open", "matrix", ("x",), 10, ("c",), 8, plan, needs=("prefetch/org/open",)),
        Step(
            "accuracy/gated",
            "accuracy",
            ("x",),
            10,
            ("c",),
            8,
            plan,
            needs=("prefetch/org/gated", "prefetch/openai/gsm8k"),
        ),
    ]
    ran = []

    def runner(step, log):
        ran.append(step.id)
        if step.id == "prefetch/org/gated":
            return StepResult(step, "failed", 1.0, "exit code 1; 401 Client Error: gated repo")
        return StepResult(step, "passed", 1.0)

    with open("/dev/null", "w") as out:
        results = {r.step.id: r for r in run_steps(steps, tmp_path, runner=runner, out=out)}
    assert ran == ["prefetch/org/gated", "prefetch/org/open", "prefetch/openai/gsm8k", "matrix/open"]
    assert results["prefetch/openai/gsm8k"].status == "passed" and results["matrix/open"].status == "passed"
    for sid in ("matrix/gated", "accuracy/gated"):
        assert results[sid].status == "skipped"
        assert results[sid].message == (
            "org/gated missing from the local Hugging Face cache: prefetch/org/gated failed"
        )
    cases = {c.get("name"): c for c in ET.parse(tmp_path / "junit.xml").getroot().iter("testcase")}
    assert cases["prefetch/org/gated"].find("failure") is not None
    assert "missing" in (child(cases["accuracy/gated"], "skipped").get("message") or "")


def harness_check_names() -> set[str]:
    """The names the harness's own check functions give the checks a run reports, each function called once on empty
    inputs (a check's name does not depend on its verdict)."""
    from types import SimpleNamespace

    from harness.accuracy.checks import accuracy_checks, check_through_pd
    from harness.accuracy.lm_eval import EvalRun
    from harness.accuracy.settings import AccuracySettings
    from harness.checks import transfer
    from harness.checks.compare import compare_completions
    from harness.run.context import RunContext
    from harness.run.evaluate import answered_check, closing_checks, match_check
    from harness.run.pd import PDResult
    from harness.workload.client import CompletionRun

    answers, scored = CompletionRun(), EvalRun("gsm8k", 0.0, {})
    # closing_checks reads only these: no fault configured, nothing left running, no smoke check
    ctx = SimpleNamespace(cfg=SimpleNamespace(proxy_fault="none", decode_kv_fault=None), leftovers=[])
    checks = [
        answered_check(answers, answers, 0),
        match_check(compare_completions([], [])),
        transfer.check_prefill_params(0, {}),
        *transfer.check_nixl_metrics([], [], 0, 0),
        *transfer.check_decode_log(""),
        transfer.check_lease({}),
        *closing_checks(cast(RunContext, ctx), cast(PDResult, SimpleNamespace(smoke=None))),
        check_through_pd(0, {}, {}, 0.0),
        *accuracy_checks(scored, scored, AccuracySettings(expected_score=0.5))[0],
    ]
    return {c.name for c in checks}


def test_check_names_are_the_harness_check_names():
    produced = harness_check_names()
    assert set(E2E_CHECKS + ACCURACY_CHECKS) <= produced, sorted(set(E2E_CHECKS + ACCURACY_CHECKS) - produced)


def test_dry_run_mentions_every_step_server_command_and_gpu_plan(steps):
    text = render_dry_run(steps, Hardware(uniform_gpus(8, 80.0), "assumed"))
    # the loops below see steps with checks, with server commands and with a GPU plan
    assert any(s.checks for s in steps) and any(s.servers for s in steps) and any(s.gpu_plan for s in steps)
    for s in steps:
        assert s.id in text
        for c in s.checks:
            assert c in text
        for _, cmd in s.servers:
            assert cmd in text
        assert f"timeout {s.timeout_s / 60:g} min" in text
    assert text.count("GPU plan:") == sum(s.gpu_plan is not None for s in steps)
    for s in steps:
        if s.gpu_plan is not None:
            assert "\n".join(f"  {line}" for line in render_plan(s.gpu_plan).splitlines()) in text
    assert "placeholders" in text and "SKIPPED: needs 24 GPUs" in text
    assert "vllm.entrypoints.openai.api_server" in text


def test_dry_run_through_the_cli_works_without_gpus(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(SIMULATED_ENV, "unreadable")
    rc = main(["nightly", "--dry-run", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "matrix/tinyllama-p2-d8" in out and "accuracy/qwen3-0.6b-p2-d4" in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_dry_run_for_fewer_gpus_skips_more(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(SIMULATED_ENV, "unreadable")
    rc = main(["nightly", "--dry-run", "--gpus", "4", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "SKIPPED: needs 8 GPUs, 4 present" in out
    assert "[to run]" in out  # the accuracy runs still plan on 4 GPUs, colocated


def test_a_real_run_refuses_with_too_few_gpus(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(SIMULATED_ENV, "2x80")
    rc = main(["nightly", "--gpus", "8", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "needs 8 GPUs, 2 present (NVML: 2 GPUs: ids 0,1" in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def fake_steps():
    plan = cast(GpuPlan, object())  # a stand-in: these steps never use their plan
    return [
        Step("prefetch", "prefetch", ("x",), 10, ("c",)),
        Step("matrix/a", "matrix", ("x",), 10, ("c",), 8, plan),
        Step("matrix/big", "matrix", ("x",), 10, ("c",), 24, None, skip_reason="needs 24 GPUs, 8 present"),
        Step("accuracy/m", "accuracy", ("x",), 10, ("c",), 6, plan),
    ]


def test_run_steps_writes_one_junit_testcase_per_step(tmp_path):
    outcome = {"prefetch": "passed", "matrix/a": "timeout", "accuracy/m": "failed"}
    ran = []

    def runner(step, log):
        ran.append((step.id, log))
        return StepResult(
            step, outcome[step.id], 1.5, "" if outcome[step.id] == "passed" else f"{step.id} went wrong", str(log)
        )

    results = run_steps(fake_steps(), tmp_path, runner=runner, out=io.StringIO())
    assert [r.status for r in results] == ["passed", "timeout", "skipped", "failed"]
    assert [i for i, _ in ran] == ["prefetch", "matrix/a", "accuracy/m"]
    assert ran[1][1] == tmp_path / "steps" / "matrix-a.log"
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert list(cases) == ["prefetch", "matrix/a", "matrix/big", "accuracy/m"]
    assert suite.get("tests") == "4" and suite.get("failures") == "2" and suite.get("skipped") == "1"
    assert child(cases["matrix/a"], "failure").get("type") == "timeout"
    assert child(cases["matrix/big"], "skipped").get("message") == "needs 24 GPUs, 8 present"
    assert cases["prefetch"].find("failure") is None


def test_gpu_guard_refuses_a_step_before_it_runs_and_flags_a_leak_after(tmp_path):
    ran = []

    def runner(step, log):
        ran.append(step.id)
        return StepResult(step, "passed", 1.0)

    def guard(step):
        if step.id == "matrix/a":
            return "GPU 0 has 3.0 GiB free"
        return lambda: "GPU 1: PIDs 7 still running"

    results = run_steps(fake_steps(), tmp_path, runner=runner, gpu_guard=guard, out=io.StringIO())
    by_id = {r.step.id: r for r in results}
    assert (
        "matrix/a" not in ran
        and by_id["matrix/a"].status == "failed"
        and "GPU 0 has 3.0 GiB free" in by_id["matrix/a"].message
    )
    assert by_id["accuracy/m"].status == "failed" and "not released" in by_id["accuracy/m"].message
    assert by_id["prefetch"].status == "passed"  # no GPU plan: no guard


def test_junit_xml_escapes_log_text():
    s = Step("matrix/a", "matrix", ("x",), 1, ())
    root = ET.fromstring(junit_xml([StepResult(s, "failed", 0.1, "assert a < b & <tag>")]))
    assert child(root, "testcase/failure").get("message") == "assert a < b & <tag>"


def test_run_step_reports_exit_code_and_timeout(tmp_path):
    fail = Step("x/fail", "matrix", (sys.executable, "-c", "import sys; print('boom'); sys.exit(3)"), 60, ())
    r = run_step(fail, tmp_path / "fail.log")
    assert r.status == "failed" and "exit code 3" in r.message and "boom" in r.message
    hang = Step("x/hang", "matrix", (sys.executable, "-c", "import time; time.sleep(600)"), 0.5, ())
    r = run_step(hang, tmp_path / "hang.log")
    assert r.status == "timeout" and "stopped" in r.message
    ok = Step("x/ok", "matrix", (sys.executable, "-c", "pass"), 60, ())
    assert run_step(ok, tmp_path / "ok.log").status == "passed"


def test_ci_workflow_parses_and_runs_make_nightly():
    wf = yaml.safe_load((REPO_ROOT / "ci" / "nightly-gpu.yml").read_text())
    on = wf.get("on", wf.get(True))  # YAML 1.1 reads a bare `on` key as true
    assert "schedule" in on and "workflow_dispatch" in on
    job = wf["jobs"]["nightly"]
    assert "self-hosted" in job["runs-on"] and job["timeout-minutes"] > 0
    assert job["env"]["HF_HOME"].startswith("/")
    runs = [s.get("run", "") for s in job["steps"]]
    assert any(r.strip().startswith("make nightly") and "DRY_RUN" not in r for r in runs)
    assert all("timeout-minutes" in s for s in job["steps"] if "run" in s)
    uploads = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert any("junit.xml" in s["with"]["path"] for s in uploads) and all(s.get("if") == "always()" for s in uploads)


def test_the_ci_job_holds_a_worst_case_night_and_publishes_its_junit_as_a_test_report():
    """Issue 35 item 7: the run had 600 min while one version's step timeouts added up to 980 (now 1200 with a first
    night's calibration; 1326 with each step's stop grace and GPU release wait), and the JUnit file was uploaded but
    never published as a report."""
    wf = yaml.safe_load((REPO_ROOT / "ci" / "nightly-gpu.yml").read_text())
    job = wf["jobs"]["nightly"]
    steps = job["steps"]
    run = next(s for s in steps if s.get("run", "").strip().startswith("make nightly") and "DRY_RUN" not in s["run"])
    assert "NIGHTLY_ARGS" not in run["run"] and "VLLM_VERSION" not in run["run"]  # the default plan, one version
    worst = worst_case_night_s()  # on the simulated 8 x 40 and 8 x 80 boxes, as ci/buildkite/'s test
    assert (
        worst
        >= sum(s.timeout_s for s in build_steps(uniform_gpus(8, 80.0), PY, Path("/runs/n")) if s.skip_reason is None)
        > 600 * 60
    )
    assert run["timeout-minutes"] * 60 >= worst
    assert all("timeout-minutes" in s for s in steps)
    assert job["timeout-minutes"] >= sum(s["timeout-minutes"] for s in steps)
    # several versions: one job each, so a job holds one version's night
    assert job["env"]["VLLM_VERSION"] == "${{ matrix.vllm_version }}" and "vllm_version" in job["strategy"]["matrix"]
    assert job["strategy"]["fail-fast"] is False
    published = [
        s for s in steps if str(s.get("uses", "")).startswith(("mikepenz/action-junit-report@", "dorny/test-reporter@"))
    ]
    assert len(published) == 1 and published[0]["if"] == "always()"
    assert published[0]["with"]["report_paths"] == "${{ env.RUN_DIR }}/junit.xml"
    assert wf["permissions"]["checks"] == "write"


@pytest.mark.parametrize(
    "given, versions", [("", [""]), ("0.21.0, 0.32.0", ["0.21.0", "0.32.0"]), ("0.32.0,", ["0.32.0"])]
)
def test_the_ci_versions_job_gives_one_nightly_job_per_version(tmp_path, given, versions):
    import json
    import subprocess

    wf = yaml.safe_load((REPO_ROOT / "ci" / "nightly-gpu.yml").read_text())
    split = wf["jobs"]["versions"]["steps"][0]
    out = tmp_path / "github_output"
    env = {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "VERSIONS": given, "GITHUB_OUTPUT": str(out)}
    subprocess.run(["bash", "-ec", split["run"]], env=env, check=True, timeout=60)
    key, value = out.read_text().strip().split("=", 1)
    assert key == "list" and json.loads(value) == versions
    assert wf["jobs"]["nightly"]["strategy"]["matrix"]["vllm_version"] == "${{ fromJSON(needs.versions.outputs.list) }}"


def test_the_dry_run_says_the_worst_case(steps):
    text = render_dry_run(steps, Hardware(uniform_gpus(8, 80.0), "assumed"))
    assert f"worst case: {nightly.worst_case_s(steps) / 60:.0f} min (" in text.splitlines()[2]
    gpu = next(s for s in steps if s.gpu_plan is not None and s.skip_reason is None)
    assert nightly.worst_case_s([gpu]) == gpu.timeout_s + nightly.STOP_GRACE_S + nightly.RELEASE_TIMEOUT_S
    skipped = next(s for s in steps if s.skip_reason is not None)
    assert nightly.worst_case_s([skipped]) == 0


def test_only_that_matches_no_step_is_refused(capsys, monkeypatch, tmp_path):
    """Issue 36 item 9: `nightly --dry-run --only nope` exited 0 with nothing selected (a night that runs nothing
    passes)."""
    rc, out, err = dry_run(capsys, monkeypatch, tmp_path, "8x80", "--only", "accuracy/*,nope")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("error: --only nope matches no step of this night")
    rc, out, _ = dry_run(capsys, monkeypatch, tmp_path, "8x80", "--only", "accuracy/*")
    assert rc == 0 and "[to run]" in step_block(out, "accuracy/qwen3-0.6b-p2-d4")


def test_makefile_has_a_nightly_target_with_dry_run():
    text = (REPO_ROOT / "Makefile").read_text()
    assert "\nnightly:" in text and "--dry-run" in text and "DRY_RUN" in text


def test_the_night_ends_with_its_release_history(steps):
    h = steps[-1]
    assert (h.id, h.kind, h.skip_reason) == ("history", "history", None)
    a = h.argv
    assert a[3] == "history" and "--no-run" in a and a[a.index("--import-runs") + 1] == "/runs/n/matrix"
    assert a[a.index("--out") + 1] == "/runs/n/history" and a[a.index("--versions") + 1] == pinned("gpu")["vllm"]
    assert a[a.index("--only") + 1].split(",") == [e.id for e in gpu_entries()]
    wf = yaml.safe_load((REPO_ROOT / "ci" / "nightly-gpu.yml").read_text())
    uploads = [
        s for s in wf["jobs"]["nightly"]["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")
    ]
    assert any("history/history.png" in s["with"]["path"] for s in uploads)


def test_every_gpu_edge_entry_is_a_step_whose_servers_carry_its_axes(steps):
    from harness.matrix.config import EDGE_YAML

    edge = [e for e in load_matrix(EDGE_YAML)[0].entries if e.device == "gpu"]
    by_id = {s.id: s for s in steps}
    assert edge and all(f"edge/{e.id}" in by_id for e in edge)
    fp8 = by_id["edge/gpu-fp8-kv-tinyllama-p2-d8"]
    assert fp8.argv[3:5] == ("matrix", str(EDGE_YAML)) and "kv_cache_dtype=fp8" in fp8.note
    fp8_servers = [cmd for name, cmd in fp8.servers if name != "proxy"]
    assert fp8_servers and all("--kv-cache-dtype fp8" in cmd for cmd in fp8_servers)
    host = by_id["edge/gpu-host-buffer-tinyllama-p2-d8"]
    pd_servers = [cmd for name, cmd in host.servers if name.startswith(("prefill", "decode"))]
    assert pd_servers and all('"kv_buffer_device":"cpu"' in cmd for cmd in pd_servers)
    prefix = by_id["edge/gpu-prefix-tinyllama-p2-d8"]
    flags = {name: "--enable-prefix-caching" in cmd for name, cmd in prefix.servers if name != "proxy"}
    assert flags == {"prefill0": False, "decode0": True, "baseline0": False}


# The GPU inventory (issue 23): NVML's GPUs, the caller's CUDA_VISIBLE_DEVICES, simulated boxes
# (PD_HARNESS_SIMULATED_GPUS), one step per vLLM version, GPU_MEMORY_UTILIZATION within the plan.

TINY_P2_D8 = "matrix/tinyllama-p2-d8"


def dry_run(capsys, monkeypatch, tmp_path, box: str, *argv: str) -> tuple[int, str, str]:
    monkeypatch.setenv(SIMULATED_ENV, box)
    rc = main(["nightly", "--dry-run", "--run-dir", str(tmp_path), *argv])
    out = capsys.readouterr()
    return rc, out.out, out.err


def step_block(text: str, sid: str) -> str:
    """The dry run's lines of one step."""
    return text.split(f"] {sid} (")[1].split("\n\n")[0]


@pytest.mark.parametrize(
    "box, head, p2d8",
    [
        ("8x40", "on 8 GPUs x 40 GiB (NVIDIA A100-SXM4-40GB)", "CUDA_VISIBLE_DEVICES=0,1 "),
        ("8x80", "on 8 GPUs x 80 GiB (NVIDIA H100 80GB HBM3)", "CUDA_VISIBLE_DEVICES=0,1 "),
        ("8x80:visible=4,5,6,7", "on 4 GPUs (ids 4,5,6,7) x 80 GiB", None),
        ("unreadable", "on 8 GPUs x 80 GiB:", "CUDA_VISIBLE_DEVICES=0,1 "),
    ],
)
def test_dry_run_under_each_simulated_box(capsys, monkeypatch, tmp_path, box, head, p2d8):
    rc, out, err = dry_run(capsys, monkeypatch, tmp_path, box)
    assert rc == 0 and err == "" and head in out.splitlines()[0]
    block = step_block(out, TINY_P2_D8)
    if p2d8 is None:  # 4 GPUs: the 8-GPU entry is skipped, the 4-GPU ones run on the caller's GPUs 4-7
        assert "SKIPPED: needs 8 GPUs, 4 present" in block
        assert "--gpus 4" in step_block(out, "matrix/tinyllama-p2-d4")
        p2d4 = step_block(out, "accuracy/qwen3-0.6b-p2-d4")
        assert "env: CUDA_VISIBLE_DEVICES=4,5,6,7 CUDA_DEVICE_ORDER=PCI_BUS_ID" in p2d4 and "[to run]" in p2d4
        assert "server prefill0: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=4,5 " in p2d4
        assert "server decode0: CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=6,7,4,5 " in p2d4
        assert not any(f"CUDA_VISIBLE_DEVICES={g}" in out for g in "0123")
    else:
        assert "[to run]" in out.split(TINY_P2_D8)[1].splitlines()[0] and p2d8 in block
    if box == "unreadable":
        assert "assumed" in out.splitlines()[1] and "NVML cannot be read" in out.splitlines()[1]


def test_8x40_is_planned_and_checked_as_40_gib_gpus(capsys, monkeypatch, tmp_path):
    """The issue: planned as 80 GiB, each step wanted 72 GiB free per GPU and failed as 'GPUs not ready'."""
    monkeypatch.setenv(SIMULATED_ENV, "8x40")
    from harness.gpu.nvml import discover

    hw = nightly.choose_hardware(discover(), None, None, dry_run=False)
    assert [g.total_gib for g in hw.gpus] == [40.0] * 8 and {g.name for g in hw.gpus} == {"NVIDIA A100-SXM4-40GB"}
    steps = {s.id: s for s in build_steps(hw.gpus, PY, tmp_path)}
    plan = steps[TINY_P2_D8].gpu_plan
    assert plan is not None
    assert max(plan.required_free_gib().values()) == pytest.approx(0.9 * 40)
    assert callable(nightly.nvml_guard(steps[TINY_P2_D8]))  # 39.5 GiB free of 40 is enough: not "GPUs not ready"


def test_4_of_8_runs_and_checks_only_the_callers_gpus(monkeypatch, tmp_path):
    from harness.gpu.nvml import discover
    from tests.unit.gpu.fake_nvml import FakeGpu, FakeNvml

    # GPUs 0-3 belong to someone else (full); the caller was given 4-7.
    box = [FakeGpu(80, 2.0, [777]) for _ in range(4)] + [FakeGpu(80, 79.5) for _ in range(4)]
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: FakeNvml([box]))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    hw = nightly.choose_hardware(discover(), None, None, dry_run=False)
    assert [g.id for g in hw.gpus] == [4, 5, 6, 7]
    steps = [s for s in build_steps(hw.gpus, PY, tmp_path) if s.gpu_plan is not None]
    plans = [s.gpu_plan for s in steps if s.gpu_plan is not None]
    assert steps and all({g for sv in plan.servers for g in sv.gpus} <= {4, 5, 6, 7} for plan in plans)
    assert all(dict(s.env)["CUDA_VISIBLE_DEVICES"] == "4,5,6,7" for s in steps)
    assert all(callable(nightly.nvml_guard(s)) for s in steps)  # GPUs 0-3 being full does not matter
    box[5].free_gib, box[5].pids = 3.0, [4242]
    refused = nightly.nvml_guard(steps[0])
    assert isinstance(refused, str) and "GPU 5 " in refused and "4242" in refused


def test_unreadable_nvml_real_run_is_one_line_and_exit_2(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv(SIMULATED_ENV, "unreadable")
    rc = main(["nightly", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1
    assert err.startswith("error: the nightly run cannot use the GPUs: NVML cannot be read: no NVIDIA driver")
    assert not any(tmp_path.iterdir())


def test_the_cli_in_a_subprocess_under_the_switch(tmp_path):
    import os
    import subprocess

    def run(box: str, *argv: str):
        caller = ("CUDA_VISIBLE_DEVICES", "VLLM_VERSION", "GPU_MEMORY_UTILIZATION")
        env = {k: v for k, v in os.environ.items() if k not in caller}
        return subprocess.run(
            [sys.executable, "-m", "harness", "nightly", "--run-dir", str(tmp_path), *argv],
            env={**env, SIMULATED_ENV: box},
            cwd=REPO_ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )

    bad = run("unreadable")
    assert bad.returncode == 2 and "Traceback" not in bad.stderr and bad.stderr.count("\n") == 1
    assert "NVML cannot be read" in bad.stderr
    ok = run("8x80:visible=4,5,6,7", "--dry-run")
    assert ok.returncode == 0 and "4 of 8 GPUs visible (CUDA_VISIBLE_DEVICES=4,5,6,7)" in ok.stdout


def test_gpu_mem_and_count_flags_override_only_a_dry_run_or_by_choice(capsys, monkeypatch, tmp_path):
    rc, out, _ = dry_run(capsys, monkeypatch, tmp_path, "8x80", "--gpu-mem-gib", "40")
    assert rc == 0 and "on 8 GPUs x 40 GiB" in out and "planned as 40 GiB each" in out
    monkeypatch.setenv(SIMULATED_ENV, "8x80")
    assert main(["nightly", "--gpu-mem-gib", "40", "--run-dir", str(tmp_path)]) == 2
    assert "--gpu-mem-gib only plans a dry run" in capsys.readouterr().err
    rc, out, _ = dry_run(capsys, monkeypatch, tmp_path, "8x80", "--gpus", "4")
    assert rc == 0 and "the first 4 by --gpus" in out and "SKIPPED: needs 8 GPUs, 4 present" in out


def test_each_step_runs_one_version_with_that_versions_prediction(tmp_path):
    steps = build_steps(uniform_gpus(8, 80.0), PY, tmp_path, ["0.21.0", "0.26.0"])  # 0.26.0: the measured fix
    by_id = {s.id: s for s in steps}
    runs = [s for s in steps if s.kind in ("matrix", "accuracy")]
    assert {s.version for s in runs} == {"0.21.0", "0.26.0"}
    for s in runs:
        assert s.argv.count("--vllm-version") == 1 and s.argv[s.argv.index("--vllm-version") + 1] == s.version
        assert s.id.endswith(f"@{s.version}") and s.argv[s.argv.index("--run-dir") + 1] == str(tmp_path / s.id)
    assert "expects of vLLM 0.21.0: assert-45330" in by_id[f"{TINY_P2_D8}@0.21.0"].checks[0]
    assert "expects of vLLM 0.26.0: ok" in by_id[f"{TINY_P2_D8}@0.26.0"].checks[0]
    h = steps[-1].argv
    assert h[h.index("--versions") + 1] == "0.21.0,0.26.0"
    assert len(h[h.index("--only") + 1].split(",")) == len(gpu_entries())
    assert [s.id for s in steps].count("prefetch/TinyLlama/TinyLlama-1.1B-Chat-v1.0") == 1  # prefetched once


def test_vllm_version_from_the_environment_is_split_too(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("VLLM_VERSION", "0.21.0, 0.26.0")
    rc, out, _ = dry_run(capsys, monkeypatch, tmp_path, "8x80")
    assert rc == 0 and f"] {TINY_P2_D8}@0.21.0 (" in out and f"] {TINY_P2_D8}@0.26.0 (" in out
    runs = "\n".join(line for line in out.splitlines() if " -m harness doctor " not in line)  # the doctor checks both
    assert "--vllm-version 0.21.0," not in runs and "--vllm-version '0.21.0, 0.26.0'" not in out
    assert "-m harness doctor --before-prefetch --gpus 8 --models " in out and "--vllm-version 0.21.0,0.26.0" in out
    monkeypatch.setenv("VLLM_VERSION", "0.21.0,latest")
    rc, _, err = dry_run(capsys, monkeypatch, tmp_path, "8x80")
    assert rc == 2 and "'latest' is not a version number" in err


def test_gpu_memory_utilization_applies_per_server_or_stops_the_night(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.8")
    rc, out, err = dry_run(capsys, monkeypatch, tmp_path, "8x80")
    assert rc == 2 and out == "" and err.count("\n") == 1
    assert err.startswith(
        f"error: GPU_MEMORY_UTILIZATION=0.8 does not fit {TINY_P2_D8}: GPUs 0,1 are shared by "
        "prefill0 and decode0: 2 x 0.8 = 1.60 > 0.9 per GPU; give at most 0.45"
    )
    steps = {s.id: s for s in build_steps(uniform_gpus(8, 80.0), PY, tmp_path, util=0.4)}
    s = steps[TINY_P2_D8]
    assert s.gpu_plan is not None
    assert {sv.gpu_memory_utilization for sv in s.gpu_plan.servers} == {0.4}
    vllm_servers = [cmd for name, cmd in s.servers if name != "proxy"]
    assert vllm_servers and all("--gpu-memory-utilization 0.4 " in f"{cmd} " for cmd in vllm_servers)
    assert s.gpu_plan.required_free_gib()[0] == pytest.approx(0.8 * 80)  # what the guard checks: the servers' shares


# A real night on a simulated GPU box (issue 23): stand-in servers, no prefetch, each step judged by its runs' reports.


def test_a_simulated_night_prefetches_nothing_and_keeps_its_history_apart(tmp_path):
    steps = {
        s.id: s
        for s in build_steps(
            uniform_gpus(8, 80.0), PY, tmp_path, simulated="8x80:visible=0,1,2,3,4,5,6,7", load_requests=4
        )
    }
    prefetch = [s.skip_reason or "" for s in steps.values() if s.kind == "prefetch"]
    assert prefetch and all(why.startswith("simulated GPUs") for why in prefetch)
    env = dict(steps[TINY_P2_D8].env)
    # the step's own CUDA_VISIBLE_DEVICES applies, not the night's visible=
    assert env[SIMULATED_ENV] == "8x80" and env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    assert dict(steps["history"].env)["PD_HARNESS_RESULTS_DIR"].startswith(str(tmp_path))
    for sid in (TINY_P2_D8, "accuracy/qwen3-0.6b-p2-d4"):
        argv = steps[sid].argv
        assert argv[argv.index("--load-requests") + 1] == "4"
        assert steps[sid].run_dir == tmp_path / sid
    real = {s.id: s for s in build_steps(uniform_gpus(8, 80.0), PY, tmp_path)}
    assert real["prefetch/openai/gsm8k"].skip_reason is None and "--load-requests" not in real[TINY_P2_D8].argv
    assert SIMULATED_ENV not in dict(real[TINY_P2_D8].env) and real["history"].env == ()


def test_only_and_timeout_scale_pick_and_shorten_steps(steps):
    picked = nightly.scale_timeouts(nightly.select_steps(steps, ["accuracy/*", "history"]), 0.5)
    run = [s.id for s in picked if s.skip_reason is None]
    assert run == [s.id for s in steps if s.id.startswith("accuracy/")] + ["history"]
    tinyllama = [s.skip_reason or "" for s in picked if s.id.startswith("matrix/tinyllama")]
    assert tinyllama and all("not selected by --only accuracy/*,history" in why for why in tinyllama)
    assert "needs 24 GPUs" in (next(s for s in picked if s.id == "matrix/llama32-1b-p8-d16").skip_reason or "")
    assert [s.timeout_s for s in picked] == [s.timeout_s / 2 for s in steps]
    assert nightly.select_steps(steps, []) == list(steps)


def write_report(path: Path, verdict: str = "pass", simulated: bool = True) -> None:
    import json

    path.mkdir(parents=True, exist_ok=True)
    d = {"verdict": verdict, **({"simulated": "SIMULATED GPUs (...)"} if simulated else {})}
    (path / "report.json").write_text(json.dumps(d if verdict == "pass" else {**d, "reason": "x: went wrong"}))


def sim_step(tmp_path: Path, kind: str) -> Step:
    return Step(f"{kind}/a", kind, ("py", "-m", "harness", "--run-dir", str(tmp_path / kind)), 60, ())


def matrix_report(tmp_path: Path, pairs: dict[str, str | None]) -> None:
    import json

    rows = []
    for pid, verdict in pairs.items():
        run = tmp_path / "matrix" / "vllm-x" / pid
        if verdict:
            write_report(run, verdict)
        rows.append({"id": pid, "run_dir": str(run) if verdict else None})
    (tmp_path / "matrix" / "report.json").write_text(json.dumps({"pairs": rows}))


def test_a_simulated_step_passes_when_its_runs_got_through(tmp_path):
    acc = sim_step(tmp_path, "accuracy")
    write_report(tmp_path / "accuracy")
    ok = nightly.judge_simulated(StepResult(acc, "passed", 1.0, returncode=0), "8x80")
    assert ok.status == "passed" and "simulated GPUs (PD_HARNESS_SIMULATED_GPUS=8x80): 1 run(s)" in ok.message
    write_report(tmp_path / "accuracy", simulated=False)
    assert nightly.judge_simulated(StepResult(acc, "passed", 1.0, returncode=0), "8x80").status == "failed"
    mx = sim_step(tmp_path, "matrix")
    matrix_report(tmp_path, {"p1": "pass", "skipped": None})
    # exit 1: an entry expected vLLM to refuse the pair; stand-ins cannot show that, so it is not judged
    r = nightly.judge_simulated(StepResult(mx, "failed", 1.0, "exit code 1", returncode=1), "8x80")
    assert r.status == "passed" and "not judged" in r.message
    assert nightly.judge_simulated(StepResult(mx, "failed", 1.0, returncode=2), "8x80").status == "failed"
    matrix_report(tmp_path, {"p1": "pass", "p2": "fail"})
    bad = nightly.judge_simulated(StepResult(mx, "failed", 1.0, returncode=1), "8x80")
    assert bad.status == "failed" and "p2: verdict fail: x: went wrong" in bad.message
    late = StepResult(mx, "timeout", 60.0, "no result within 60 s")
    assert nightly.judge_simulated(late, "8x80") is late
    hist = Step("history", "history", ("x",), 60, ())
    assert nightly.judge_simulated(StepResult(hist, "passed", returncode=0), "8x80").message == ""


def test_a_simulated_night_says_so_in_its_junit(tmp_path):
    acc = sim_step(tmp_path, "accuracy")
    write_report(tmp_path / "accuracy")
    results = run_steps(
        [acc],
        tmp_path,
        runner=lambda s, log: StepResult(s, "passed", 1.0, log=str(log), returncode=0),
        out=io.StringIO(),
        simulated="8x40",
    )
    assert results[0].status == "passed"
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    assert child(suite, "properties/property").get("value") == "PD_HARNESS_SIMULATED_GPUS=8x40"
    out = child(suite, "testcase/system-out").text or ""
    assert out.startswith("simulated GPUs (PD_HARNESS_SIMULATED_GPUS=8x40)") and "log: " in out


def test_a_real_night_rejects_a_bad_timeout_scale(capsys, tmp_path):
    assert main(["nightly", "--dry-run", "--timeout-scale", "0", "--run-dir", str(tmp_path)]) == 2
    assert "--timeout-scale must be > 0" in capsys.readouterr().err


def test_the_history_step_is_skipped_when_no_gqa_matrix_step_ran(tmp_path):
    # 4 of 8 GPUs: every GQA-matrix pair is skipped, an edge entry runs; there is no matrix folder to import
    plan = cast(GpuPlan, object())  # a stand-in: these steps never use their plan
    steps = [
        Step("matrix/p2-d8", "matrix", ("x",), 10, ("c",), 8, plan, skip_reason="needs 8 GPUs, 4 present"),
        Step("edge/p1-d2", "matrix", ("x",), 10, ("c",), 2, plan),
        Step("history", "history", ("x",), 10, ("c",)),
    ]
    ran = []

    def runner(step, log):
        ran.append(step.id)
        return StepResult(step, "passed", 1.0)

    with open("/dev/null", "w") as out:
        results = {r.step.id: r for r in run_steps(steps, tmp_path, runner=runner, out=out)}
    assert ran == ["edge/p1-d2"] and results["history"].status == "skipped"
    assert "no GQA-matrix step ran" in results["history"].message
    steps[0] = Step("matrix/p2-d8", "matrix", ("x",), 10, ("c",), 8, plan)
    ran.clear()
    with open("/dev/null", "w") as out:
        run_steps(steps, tmp_path / "b", runner=runner, out=out)
    assert ran == ["matrix/p2-d8", "edge/p1-d2", "history"]


# Issue 35 item 6: the dry run's server lines are the lines that run. They were built apart from the run and left out
# the KV pool (--num-gpu-blocks-override) and request logging, and showed another version's servers with the
# night's interpreter instead of that version's environment.


def run_as_the_cli(monkeypatch, argv) -> tuple[object, bool]:
    """The config and baseline order a step's own `python -m harness ...` hands PDRun (nothing installed: ensure_env
    answers with the environment's interpreter; nothing run)."""
    from harness.envs.vllm_env import env_dir

    got: dict[str, Any] = {}

    class NoRun:
        def __init__(self, cfg, attach=None, baseline_last=False, baseline_cache=None):
            got.update(cfg=cfg, baseline_last=baseline_last)
            self.run_dir = cfg.run_dir

        def run(self):
            return {"verdict": "pass", "checks": []}

    monkeypatch.setattr(
        "harness.envs.vllm_env.ensure_env", lambda device, version, *a, **k: env_dir(device, version) / "bin" / "python"
    )
    monkeypatch.setattr("harness.run.pipeline.PDRun", NoRun)
    monkeypatch.setattr("harness.cli.catch_interrupts", lambda: None)
    monkeypatch.setattr("harness.matrix.cli.catch_interrupts", lambda: None)
    monkeypatch.setattr("harness.run.report.print_summary", lambda *a, **k: None)
    monkeypatch.setattr("harness.e2e.args._preflight", lambda *a: None)  # refusals only: no model files or NVML here
    main(list(argv[3:]))
    return got["cfg"], got["baseline_last"]


def real_run_servers(cfg, baseline_last: bool) -> dict[str, str]:
    """What that run launches, built as run/pipeline.py builds it: the model and its heads, the GPU plan from NVML (8 x
    80 GiB), the phases' servers in the run's order (run/pd.py local_servers and the proxy, the baseline as
    run/baseline.py makes it), ports from the dry run's placeholder allocator."""
    from harness.gpu.run import GpuRun
    from harness.models.heads import model_heads
    from harness.run.context import RunContext
    from harness.run.launch import resolve_model
    from harness.run.pd import local_servers
    from harness.run.report import Report
    from harness.serve.ports import PortAllocator
    from harness.workload.client import GenerationSettings
    from tests.unit.gpu.fake_nvml import FakeNvml, gpus

    model, served = resolve_model(cfg)
    ctx = RunContext(cfg, cfg.run_dir, Report(config={}), [], GenerationSettings(), model, served)
    ctx.report.config["model_heads"] = model_heads(model)
    ctx.gpu = GpuRun(
        cfg.tp_p, cfg.tp_d, model, nvml=FakeNvml([gpus(8)]), gpu_memory_utilization=cfg.gpu_memory_utilization, env={}
    )
    # the dry run's placeholder ports stand in for the allocator
    alloc, (bs_p, bs_d) = cast(PortAllocator, nightly.FakePorts()), cfg.block_sizes()
    for phase in ("pd", "baseline") if baseline_last else ("baseline", "pd"):
        if phase == "baseline":
            ctx.server(alloc, "baseline", cfg.tp_d, bs_d, None)
            continue
        servers = local_servers(ctx, alloc, (bs_p, bs_d), [None, None])
        ctx.proxy(alloc, [ep.url for ep in servers.prefill], [ep.url for ep in servers.decode])
    return {(k if k == "proxy" else f"{k}0"): v for k, v in ctx.report.commands.items()}


@pytest.mark.parametrize(
    "sid",
    [
        f"{TINY_P2_D8}@0.21.0",
        f"{TINY_P2_D8}@0.32.0",
        "edge/gpu-bs32-qwen25-3b-p1-d4@0.21.0",
        "edge/gpu-nhd-permute-qwen25-3b-p2-d4@0.32.0",
        "accuracy/qwen3-0.6b-p2-d4@0.21.0",
        "accuracy/tinyllama-1.1b-chat-p2-d8@0.32.0",
    ],
)
def test_dry_run_server_lines_are_the_lines_the_steps_run_builds(monkeypatch, tmp_path, sid):
    from harness.envs.vllm_env import env_dir

    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.4")  # read by the night and by each step's run
    steps = {s.id: s for s in build_steps(uniform_gpus(8, 80.0), PY, tmp_path, ["0.21.0", "0.32.0"], util=0.4)}
    step = steps[sid]
    cfg, baseline_last = run_as_the_cli(monkeypatch, step.argv)
    assert dict(step.servers) == real_run_servers(cfg, baseline_last)
    assert [name for name, _ in step.servers] == list(real_run_servers(cfg, baseline_last))  # and in its order
    assert step.version is not None
    python = str(env_dir("gpu", step.version) / "bin" / "python")
    for name, line in step.servers:
        assert line.split(" -m vllm.")[0].endswith(python) or line.startswith(f"{python} "), (name, python)
        if name != "proxy":
            assert "--gpu-memory-utilization 0.4 " in line and "--num-gpu-blocks-override " in line
    assert "--enable-log-requests" in dict(step.servers)["decode0"]  # the load phase's aborts are logged


def test_a_matrix_run_takes_the_gpu_memory_utilization_the_night_plans_with(monkeypatch):
    from harness.matrix.cli import base_config

    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "0.4")
    assert base_config("gpu").gpu_memory_utilization == 0.4
    assert base_config("cpu").gpu_memory_utilization is None  # a CPU matrix is left as it was
    monkeypatch.setenv("GPU_MEMORY_UTILIZATION", "2")
    with pytest.raises(ConfigError, match="GPU_MEMORY_UTILIZATION='2' must be in"):
        base_config("gpu")


# Issue 35, calibration on the night: the first night on a box (or a new GPU model, driver or vLLM) runs `calibrate`
# and keeps its threshold (harness/run/thresholds.py); later nights skip it, naming the one they use.

A100 = "NVIDIA A100-SXM4-80GB"
CAL = "calibrate/tinyllama-1.1b-chat-p1-d2"


def a100s(n: int = 8):
    from dataclasses import replace

    return tuple(replace(g, name=A100) for g in uniform_gpus(n, 80.0))


def calibrated(store, version: str, driver: str = "550.54.15"):
    from harness.run.thresholds import StoredThreshold, ThresholdKey

    key = ThresholdKey(A100, driver, version, "TinyLlama/TinyLlama-1.1B-Chat-v1.0")
    store.put(StoredThreshold(key, 0.21, 0.03, 120, 1.02, 1.4, 118, "/runs/cal", "2026-12-08"))


def test_each_version_without_a_calibration_plans_one_before_its_runs_and_one_with_is_skipped(tmp_path):
    from harness.run.thresholds import ThresholdStore

    store = ThresholdStore(tmp_path / "thresholds.json")
    calibrated(store, "0.21.0")
    steps = build_steps(a100s(), PY, tmp_path / "n", ["0.21.0", "0.32.0"], driver="550.54.15", thresholds=store)
    ids = [s.id for s in steps]
    by_id = {s.id: s for s in steps}
    done, todo = by_id[f"{CAL}@0.21.0"], by_id[f"{CAL}@0.32.0"]
    assert done.skip_reason == (
        f"threshold 0.21 already calibrated for {A100}, driver 550.54.15, vLLM 0.21.0, "
        "TinyLlama/TinyLlama-1.1B-Chat-v1.0: calibrated 2026-12-08 (/runs/cal)"
    )
    assert todo.skip_reason is None and todo.needs == ("prefetch/TinyLlama/TinyLlama-1.1B-Chat-v1.0",)
    for version, cal in (("0.21.0", done), ("0.32.0", todo)):  # before the version's matrix and accuracy steps
        own = [i for i in ids if i.endswith(f"@{version}") and i != cal.id]
        assert ids.index(cal.id) < min(ids.index(i) for i in own)
    argv = todo.argv
    assert argv[:4] == (PY, "-m", "harness", "calibrate") and "--store" in argv[: argv.index("--")]
    assert argv[argv.index("--out") + 1] == str(tmp_path / "n" / f"{CAL}@0.32.0")
    e2e = argv[argv.index("--") + 1 :]
    assert e2e[e2e.index("--vllm-version") + 1] == "0.32.0" and e2e[e2e.index("--device") + 1] == "gpu"
    assert todo.gpu_plan is not None and dict(todo.env)["CUDA_VISIBLE_DEVICES"] == "0,1,2,3,4,5,6,7"
    text = render_dry_run(steps, Hardware(a100s(), "NVML"))
    assert "[SKIPPED: threshold 0.21 already calibrated for " in step_block(text, f"{CAL}@0.21.0")
    assert "[to run]" in step_block(text, f"{CAL}@0.32.0").splitlines()[0]
    assert f"none for {A100}, driver 550.54.15, vLLM 0.32.0" in step_block(text, f"{CAL}@0.32.0")
    # a new driver is a new box: measured again
    redo = {s.id: s for s in build_steps(a100s(), PY, tmp_path / "n", ["0.21.0"], driver="560.28.03", thresholds=store)}
    assert redo[CAL].skip_reason is None


def test_the_night_reads_its_box_and_the_store_beside_the_results(capsys, monkeypatch, tmp_path):
    from harness.envs.vllm_env import main_version
    from harness.gpu import nvml
    from harness.run.thresholds import ThresholdStore
    from tests.unit.gpu.fake_nvml import FakeGpu, FakeNvml

    real = nvml.discover
    box = FakeNvml([[FakeGpu(name=A100) for _ in range(8)]], driver="550.54.15")
    monkeypatch.setattr(nvml, "discover", lambda *a, **k: real(box, env={}))
    monkeypatch.setenv("PD_HARNESS_RESULTS_DIR", str(tmp_path / "results"))
    assert main(["nightly", "--dry-run", "--run-dir", str(tmp_path / "a")]) == 0
    assert "[to run]" in step_block(capsys.readouterr().out, CAL).splitlines()[0]  # the first night on the box
    calibrated(ThresholdStore(), main_version("gpu"))
    assert main(["nightly", "--dry-run", "--run-dir", str(tmp_path / "b")]) == 0
    assert "[SKIPPED: threshold 0.21 already calibrated for" in step_block(capsys.readouterr().out, CAL)
    (tmp_path / "results" / "calibrated_thresholds.json").write_text("{broken")
    assert main(["nightly", "--dry-run", "--run-dir", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err
    assert "calibrated_thresholds.json: not a calibrated-thresholds file" in err and err.count("\n") == 1


def test_a_simulated_night_calibrates_nothing(tmp_path):
    from harness.run.thresholds import ThresholdStore

    steps = {
        s.id: s
        for s in build_steps(
            a100s(),
            PY,
            tmp_path,
            simulated="8x80",
            driver="550.54.15",
            thresholds=ThresholdStore(tmp_path / "none.json"),
        )
    }
    assert (steps[CAL].skip_reason or "").startswith("simulated GPUs")


def test_a_failed_calibration_stops_nothing_and_says_the_runs_use_the_default(tmp_path):
    plan = cast(GpuPlan, object())  # a stand-in: these steps never use their plan
    steps = [
        Step(CAL, "calibrate", ("x",), 10, ("c",), 3, plan),
        Step("matrix/p1-d2", "matrix", ("x",), 10, ("c",), 3, plan),
        Step("history", "history", ("x",), 10, ("c",)),
    ]
    ran = []

    def runner(step, log):
        ran.append(step.id)
        return StepResult(step, "failed" if step.kind == "calibrate" else "passed", 1.0, "exit code 1")

    with open("/dev/null", "w") as out:
        results = {r.step.id: r for r in run_steps(steps, tmp_path, runner=runner, out=out)}
    assert ran == [CAL, "matrix/p1-d2", "history"]
    assert results[CAL].status == "failed" and results[CAL].message == f"{nightly.CALIBRATE_FALLBACK}; exit code 1"
    assert "later runs use the default logprob threshold" in nightly.CALIBRATE_FALLBACK
