import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
import yaml

from harness import nightly
from harness.cli import main
from harness.core.paths import REPO_ROOT
from harness.envs.vllm_env import pinned
from harness.gpu.plan import render_plan
from harness.matrix.config import load_matrix
from harness.nightly import (ACCURACY_CHECKS, ACCURACY_RUNS, E2E_CHECKS, Step, StepResult, build_steps, junit_xml, render_dry_run,
                             run_step, run_steps)

PY = "/opt/py/bin/python"


@pytest.fixture(scope="module")
def steps():
    return build_steps(8, 80.0, PY, Path("/runs/n"))


def gpu_entries():
    return [e for e in load_matrix()[0].entries if e.device == "gpu"]


def test_steps_cover_prefetch_every_gpu_matrix_entry_and_both_accuracy_models(steps):
    ids = [s.id for s in steps]
    assert ids[0] == "prefetch"
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
    for e in gpu_entries():
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
    for s in (s for s in steps if s.kind == "accuracy"):
        assert "--gpu-memory-utilization" not in s.argv  # the run applies its GPU plan per server
        servers = dict(s.servers)
        assert "CUDA_DEVICE_ORDER=PCI_BUS_ID" in servers["decode0"] and "CUDA_VISIBLE_DEVICES=" in servers["decode0"]


def test_accuracy_checks_include_the_published_score_only_where_there_is_one(steps):
    acc = {s.id: s for s in steps if s.kind == "accuracy"}
    assert "accuracy_matches_expected" in acc["accuracy/qwen3-0.6b-p2-d4"].checks
    assert "accuracy_matches_expected" not in acc["accuracy/tinyllama-1.1b-chat-p2-d8"].checks


def test_prefetch_downloads_every_model_that_runs_and_gsm8k(steps):
    code = steps[0].argv[2]
    for s in steps[1:]:
        model = dict(s.servers).get("prefill0", "")
        if s.skip_reason is None and s.servers:
            name = model.split("--model ")[1].split()[0]
            assert f'"{name}"' in code
    assert '"openai/gsm8k", repo_type="dataset"' in code
    assert "meta-llama" not in code  # its only entry needs 24 GPUs


def test_check_names_are_the_harness_check_names():
    src = "".join((REPO_ROOT / "harness" / f).read_text() for f in ("run/evaluate.py", "checks/transfer.py", "accuracy/checks.py"))
    for name in E2E_CHECKS + ACCURACY_CHECKS:
        assert f'"{name}"' in src, name


def test_dry_run_mentions_every_step_server_command_and_gpu_plan(steps):
    text = render_dry_run(steps, 8, 80.0)
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


def test_dry_run_through_the_cli_works_without_gpus(capsys, tmp_path):
    rc = main(["nightly", "--dry-run", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "matrix/tinyllama-p2-d8" in out and "accuracy/qwen3-0.6b-p2-d4" in out
    assert not any(tmp_path.iterdir())  # a dry run writes nothing


def test_dry_run_for_fewer_gpus_skips_more(capsys, tmp_path):
    rc = main(["nightly", "--dry-run", "--gpus", "4", "--run-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0 and "SKIPPED: needs 8 GPUs, 4 present" in out
    assert "[to run]" in out  # the accuracy runs still plan on 4 GPUs, colocated


def test_a_real_run_refuses_with_too_few_gpus(capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(nightly, "gpus_present", lambda: (2, "NVML sees 2"))
    rc = main(["nightly", "--run-dir", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2 and "needs 8 GPUs, 2 present (NVML sees 2)" in err and err.count("\n") == 1
    assert not any(tmp_path.iterdir())


def fake_steps():
    plan = object()
    return [Step("prefetch", "prefetch", ("x",), 10, ("c",)),
            Step("matrix/a", "matrix", ("x",), 10, ("c",), 8, plan),
            Step("matrix/big", "matrix", ("x",), 10, ("c",), 24, None, skip_reason="needs 24 GPUs, 8 present"),
            Step("accuracy/m", "accuracy", ("x",), 10, ("c",), 6, plan)]


def test_run_steps_writes_one_junit_testcase_per_step(tmp_path):
    outcome = {"prefetch": "passed", "matrix/a": "timeout", "accuracy/m": "failed"}
    ran = []

    def runner(step, log):
        ran.append((step.id, log))
        return StepResult(step, outcome[step.id], 1.5, "" if outcome[step.id] == "passed" else f"{step.id} went wrong", str(log))

    results = run_steps(fake_steps(), tmp_path, runner=runner, out=open("/dev/null", "w"))
    assert [r.status for r in results] == ["passed", "timeout", "skipped", "failed"]
    assert [i for i, _ in ran] == ["prefetch", "matrix/a", "accuracy/m"]
    assert ran[1][1] == tmp_path / "steps" / "matrix-a.log"
    suite = ET.parse(tmp_path / "junit.xml").getroot()
    cases = {c.get("name"): c for c in suite.iter("testcase")}
    assert list(cases) == ["prefetch", "matrix/a", "matrix/big", "accuracy/m"]
    assert suite.get("tests") == "4" and suite.get("failures") == "2" and suite.get("skipped") == "1"
    assert cases["matrix/a"].find("failure").get("type") == "timeout"
    assert cases["matrix/big"].find("skipped").get("message") == "needs 24 GPUs, 8 present"
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

    results = run_steps(fake_steps(), tmp_path, runner=runner, gpu_guard=guard, out=open("/dev/null", "w"))
    by_id = {r.step.id: r for r in results}
    assert "matrix/a" not in ran and by_id["matrix/a"].status == "failed" and "GPU 0 has 3.0 GiB free" in by_id["matrix/a"].message
    assert by_id["accuracy/m"].status == "failed" and "not released" in by_id["accuracy/m"].message
    assert by_id["prefetch"].status == "passed"  # no GPU plan: no guard


def test_junit_xml_escapes_log_text():
    s = Step("matrix/a", "matrix", ("x",), 1, ())
    root = ET.fromstring(junit_xml([StepResult(s, "failed", 0.1, "assert a < b & <tag>")]))
    assert root.find("testcase/failure").get("message") == "assert a < b & <tag>"


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
    uploads = [s for s in wf["jobs"]["nightly"]["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact")]
    assert any("history/history.png" in s["with"]["path"] for s in uploads)


def test_every_gpu_edge_entry_is_a_step_whose_servers_carry_its_axes(steps):
    from harness.matrix.config import EDGE_YAML

    edge = [e for e in load_matrix(EDGE_YAML)[0].entries if e.device == "gpu"]
    by_id = {s.id: s for s in steps}
    assert edge and all(f"edge/{e.id}" in by_id for e in edge)
    fp8 = by_id["edge/gpu-fp8-kv-tinyllama-p2-d8"]
    assert fp8.argv[3:5] == ("matrix", str(EDGE_YAML)) and "kv_cache_dtype=fp8" in fp8.note
    assert all("--kv-cache-dtype fp8" in cmd for name, cmd in fp8.servers if name != "proxy")
    host = by_id["edge/gpu-host-buffer-tinyllama-p2-d8"]
    assert all('"kv_buffer_device":"cpu"' in cmd for name, cmd in host.servers if name.startswith(("prefill", "decode")))
    prefix = by_id["edge/gpu-prefix-tinyllama-p2-d8"]
    flags = {name: "--enable-prefix-caching" in cmd for name, cmd in prefix.servers if name != "proxy"}
    assert flags == {"prefill0": False, "decode0": True, "baseline0": False}
