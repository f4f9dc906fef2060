"""The GPU paths end to end on this CPU machine, on simulated GPU boxes (issue 23, docs/gpu.md "Simulated GPU boxes").

`python -m harness e2e --device gpu` and `python -m harness nightly` run in subprocesses under
PD_HARNESS_SIMULATED_GPUS: the plan, NVML's checks before and after each phase (the stand-ins take and give back the
memory their plan gives them), every server's CUDA_VISIBLE_DEVICES, staggered colocated starts, step timeouts,
JUnit. Stand-in servers (harness/simbox/standin.py) serve in vLLM's place, so no vLLM is needed (no `vllm` marker);
the data-path checks must come out skipped with "simulated GPUs", never passed.

The models need no weights, but the harness serves offline and refuses a model that is not on this machine
(harness/run/preflight.py require_model), so each test gets a Hugging Face cache holding only each hub model's
config.json, written from configs/models.yaml.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import psutil
import pytest

from harness.simbox.box import SIMULATED_ENV
from harness.simbox.claims import STATE_ENV, live_claims
from tests.helpers import config_only_hf_cache

# a hang fails this module's test, not all of CI: about 3x its stand-in runs and nights
pytestmark = pytest.mark.timeout(900)

REPO = Path(__file__).resolve().parents[2]
TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"
CALLER = (
    "CUDA_VISIBLE_DEVICES",
    "CUDA_DEVICE_ORDER",
    "VLLM_VERSION",
    "GPU_MEMORY_UTILIZATION",
    "PD_HARNESS_DEVICE",
    SIMULATED_ENV,
    STATE_ENV,
)
DATA_PATH = (
    "outputs_match_baseline",
    "prefill_returned_kv_transfer_params",
    "nixl_transfers_counted",
    "transfer_plan_logged",
    "logprobs_match_baseline",
    "no_kv_leak",
    "smoke_capital_of_france",
)
GPU_CHECKS = ("gpu_free_before_baseline", "gpu_released_after_baseline", "gpu_free_before_pd", "gpu_released_after_pd")


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory) -> Path:
    """A Hugging Face cache with each hub model of configs/models.yaml as a config-only snapshot."""
    return config_only_hf_cache(tmp_path_factory.mktemp("hf"))


def harness(
    box: str, argv: list[str], hf: Path, state: Path, timeout: float = 300, visible: str | None = None
) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in CALLER}
    env.update({SIMULATED_ENV: box, STATE_ENV: str(state), "HF_HOME": str(hf), "PD_HARNESS_NO_BASELINE_CACHE": "1"})
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    return subprocess.run(
        [sys.executable, "-m", "harness", *argv], env=env, cwd=REPO, capture_output=True, text=True, timeout=timeout
    )


def e2e(box: str, tp_d: int, run_dir: Path, hf: Path, state: Path) -> subprocess.CompletedProcess:
    return harness(
        box,
        [
            "e2e",
            "--device",
            "gpu",
            "--tp-p",
            "2",
            "--tp-d",
            str(tp_d),
            "--model",
            TINYLLAMA,
            "--load-requests",
            "8",
            "--run-dir",
            str(run_dir),
        ],
        hf,
        state,
    )


def nothing_left(state: Path, report: dict) -> None:
    """No stand-in holds a simulated GPU, and no process the run's GPU checks saw is alive."""
    assert live_claims(state) == []
    seen = [p for c in report["checks"] if c["name"].startswith("gpu_released") for p in c["data"]["pids"]]
    assert seen and not [p for p in seen if psutil.pid_exists(p) and psutil.Process(p).status() != "zombie"]


def holding(log: str) -> str:
    return next(line for line in log.splitlines() if "[stand-in] holding" in line)


@pytest.mark.parametrize(
    "box, mem", [pytest.param("8x40", 40.0, marks=pytest.mark.full("P2->D8 on 8 x 40 GiB")), ("8x80", 80.0)]
)
def test_p2_d8_on_eight_gpus(tmp_path, hf_home, box, mem):
    run, state = tmp_path / "run", tmp_path / "box"
    p = e2e(box, 8, run, hf_home, state)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    d = json.loads((run / "report.json").read_text())
    assert d["verdict"] == "pass" and d["simulated"].startswith(f"SIMULATED GPUs ({SIMULATED_ENV}={box})")
    assert f"[SIMULATED GPUs ({SIMULATED_ENV}={box})" in p.stdout
    plan = d["config"]["gpu_plan"]
    assert plan["simulated"] == box and plan["colocated"] and plan["stagger_start"]
    assert [g["total_gib"] for g in plan["gpus"]] == [mem] * 8
    vis = {s["role"]: s["cuda_visible_devices"] for s in plan["servers"]}
    assert vis == {"baseline": "2,3,4,5,6,7,0,1", "prefill": "0,1", "decode": "2,3,4,5,6,7,0,1"}
    for role, util in (("baseline", 0.9), ("prefill", 0.45), ("decode", 0.45)):
        assert f"CUDA_VISIBLE_DEVICES={vis[role]} " in d["commands"][role]
        cmd = d["commands"][role]
        assert "vllm.entrypoints.openai.api_server" in cmd and "served by a stand-in" in cmd
        line = holding((run / "logs" / f"{role}.log").read_text())
        assert f"holding {util * mem:.1f} GiB on each of GPUs {vis[role]} (CUDA_VISIBLE_DEVICES={vis[role]}," in line
    checks = {c["name"]: c for c in d["checks"]}
    assert all(checks[n]["passed"] for n in GPU_CHECKS) and all(c["passed"] for c in d["checks"])
    skipped = {s["name"]: s["reason"] for s in d["skipped_checks"]}
    for name in DATA_PATH:
        assert name not in checks and skipped[name].startswith(f"simulated GPUs ({SIMULATED_ENV}={box})")
    assert d["comparison"] is None
    spans = {e["name"]: e for e in d["events"]}  # colocated: D starts once P is up
    assert spans["prefill start-up"]["end_s"] <= spans["decode start-up"]["start_s"]
    nothing_left(state, d)


def test_only_the_callers_gpus_are_used(tmp_path, hf_home):
    box, state = "8x80:visible=4,5,6,7", tmp_path / "box"
    refused = e2e(box, 8, tmp_path / "refused", hf_home, state)
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1 and "Traceback" not in refused.stderr
    assert "decode TP 8 needs 8 GPUs" in refused.stderr and "largest TP here is 4" in refused.stderr
    assert not (tmp_path / "refused").exists()
    run = tmp_path / "run"
    p = e2e(box, 4, run, hf_home, state)
    assert p.returncode == 0, (p.stdout + p.stderr)[-3000:]
    d = json.loads((run / "report.json").read_text())
    vis = {s["role"]: s["cuda_visible_devices"] for s in d["config"]["gpu_plan"]["servers"]}
    assert vis == {"baseline": "6,7,4,5", "prefill": "4,5", "decode": "6,7,4,5"}  # physical ids, never 0-3
    for role in vis:
        line = holding((run / "logs" / f"{role}.log").read_text())
        assert f"GPUs {vis[role]} (CUDA_VISIBLE_DEVICES={vis[role]}," in line
    assert all(c["passed"] for c in d["checks"]) and {c["name"] for c in d["checks"]} >= set(GPU_CHECKS)
    nothing_left(state, d)


def test_unreadable_nvml_is_one_line_and_exit_2(tmp_path, hf_home):
    p = e2e("unreadable", 8, tmp_path / "run", hf_home, tmp_path / "box")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "Traceback" not in p.stderr
    assert p.stderr.startswith("error: --device gpu, but the GPUs cannot be read: no NVIDIA driver")
    assert not (tmp_path / "run").exists()


def test_a_gpu_someone_else_holds_fails_the_check_before_launch(tmp_path, hf_home):
    from harness.simbox.claims import Claim, proc_start, register

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        register(tmp_path / "box", Claim(other.pid, proc_start(other.pid) or "", (3,), 60.0, "someone else"))
        run = tmp_path / "run"
        p = e2e("8x80", 8, run, hf_home, tmp_path / "box")
        d = json.loads((run / "report.json").read_text())
    finally:
        other.kill()
        other.wait()
    assert p.returncode == 1 and d["verdict"] == "fail" and d["failure"]["class"] == "gpu-check-failed"
    assert "GPU 3" in d["failure"]["reason"] and f"held by PIDs {other.pid}" in d["failure"]["reason"]
    assert not (run / "logs" / "baseline.log").exists()  # refused before any server started


def night(
    box: str, tmp_path: Path, hf_home: Path, visible: str | None = None
) -> tuple[subprocess.CompletedProcess, Path, dict]:
    run, state = tmp_path / "night", tmp_path / "box"
    p = harness(
        box, ["nightly", "--run-dir", str(run), "--load-requests", "4"], hf_home, state, timeout=900, visible=visible
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "steps passed or skipped [simulated GPUs" in p.stdout
    suite = ET.parse(run / "junit.xml").getroot()
    assert suite.get("failures") == "0" and suite.get("errors", "0") == "0"
    prop = suite.find("properties/property")
    assert prop is not None and prop.get("value") == f"{SIMULATED_ENV}={box}"
    assert live_claims(state) == []
    return p, run, {c.get("name"): c for c in suite.iter("testcase")}


@pytest.mark.slow
def test_the_night_runs_every_step_on_a_simulated_8x80(tmp_path, hf_home):
    p, run, cases = night("8x80", tmp_path, hf_home)
    assert len(cases) >= 20
    pre = [c for n, c in cases.items() if n.startswith("prefetch/")]
    assert "prefetch/openai/gsm8k" in cases and len(pre) >= 3
    assert all(c.find("skipped").get("message").startswith("simulated GPUs") for c in pre)
    ran = [n for n, c in cases.items() if c.find("skipped") is None]
    assert "accuracy/tinyllama-1.1b-chat-p2-d8" in ran and "matrix/tinyllama-p2-d8" in ran and "history" in ran
    for n in ran:
        if n != "history":
            assert cases[n].find("system-out").text.startswith("simulated GPUs (PD_HARNESS_SIMULATED_GPUS=8x80)"), n
    acc = json.loads((run / "accuracy" / "tinyllama-1.1b-chat-p2-d8" / "report.json").read_text())
    skipped = {s["name"] for s in acc["skipped_checks"]}
    assert acc["verdict"] == "pass" and "accuracy_pd_within_tolerance" in skipped and acc["config"]["simulated_gpus"]
    assert not (run / "accuracy" / "tinyllama-1.1b-chat-p2-d8" / "lm_eval").exists()
    assert "decode" in acc["commands"] and "CUDA_VISIBLE_DEVICES=2,3,4,5,6,7,0,1 " in acc["commands"]["decode"]
    assert (run / "history" / "results-simulated").is_dir()  # the stand-ins' outcomes stay out of the store


@pytest.mark.slow
@pytest.mark.parametrize(
    "box, visible",
    [pytest.param("8x40", None, marks=pytest.mark.full("the night on 8 x 40 GiB")), ("8x80", "4,5,6,7")],
    ids=["8x40", "4-of-8"],
)
def test_the_night_on_a_smaller_box_plans_for_what_it_has(tmp_path, hf_home, box, visible):
    """A100-40GB: the same steps on half the memory; 4 of 8 GPUs given by CUDA_VISIBLE_DEVICES: only those."""
    p, run, cases = night(box, tmp_path, hf_home, visible)
    ran = [n for n, c in cases.items() if c.find("skipped") is None and n != "history"]
    assert "accuracy/qwen3-0.6b-p2-d4" in ran, p.stdout[-3000:]
    acc = json.loads((run / "accuracy" / "qwen3-0.6b-p2-d4" / "report.json").read_text())
    plan = acc["config"]["gpu_plan"]
    used = {g for s in plan["servers"] for g in s["gpus"]}
    assert acc["verdict"] == "pass" and {g["id"] for g in plan["gpus"]} >= used, plan
    if visible is not None:  # only the caller's GPUs; an 8-GPU step cannot run on 4: skipped, saying so
        assert used == {int(g) for g in visible.split(",")}, plan
        tp8 = cases["accuracy/tinyllama-1.1b-chat-p2-d8"].find("skipped")
        assert tp8 is not None and "4 present" in tp8.get("message")
    else:  # 40 GiB each: every step still runs, planned and checked against the 40 GiB a GPU has
        assert "accuracy/tinyllama-1.1b-chat-p2-d8" in ran and {g["total_gib"] for g in plan["gpus"]} == {40.0}
        assert max(plan["required_free_gib"].values()) <= 40.0, plan


def test_a_step_past_its_timeout_is_stopped_and_its_gpus_come_back(tmp_path, hf_home):
    night, state = tmp_path / "night", tmp_path / "box"
    p = harness(
        "8x80",
        [
            "nightly",
            "--run-dir",
            str(night),
            "--load-requests",
            "4",
            "--only",
            "accuracy/tinyllama*",
            "--timeout-scale",
            "0.0004",
        ],
        hf_home,
        state,
    )  # 90 min -> 2.2 s
    assert p.returncode == 1, (p.stdout + p.stderr)[-3000:]
    cases = {c.get("name"): c for c in ET.parse(night / "junit.xml").getroot().iter("testcase")}
    fail = cases["accuracy/tinyllama-1.1b-chat-p2-d8"].find("failure")
    assert fail is not None and fail.get("type") == "timeout"
    message = fail.get("message")
    assert message is not None and "stopped" in message and "GPUs not released" not in message
    assert all(c.find("skipped") is not None for n, c in cases.items() if n != "accuracy/tinyllama-1.1b-chat-p2-d8")
    assert live_claims(state) == []
