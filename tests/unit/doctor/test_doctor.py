"""`python -m harness doctor` (issue 35): its pure checks against simulated boxes, each with its verdict, the driver
table, gathering a box's inventory, the command's exit codes, and the night's step 0."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import cast

import pytest

from harness.doctor.checks import OK, PROBLEM, UNCHECKED, diagnose, problems
from harness.doctor.driver import driver_problem, min_driver
from harness.doctor.inventory import DiskState, EnvState, Inventory, ModelState, gather
from harness.doctor.needs import ACCURACY_RUNS, NightNeeds, night_models
from harness.gpu.nvml import Discovery, discover
from harness.gpu.plan import GpuPlan, uniform_gpus
from harness.simbox.box import SIMULATED_ENV, parse_box

TINY, QWEN, GEMMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "Qwen/Qwen3-0.6B", "google/gemma-3-4b-it"
VENV = EnvState(".venv", None, True, "2.13.0", "13.0", True, "0.32.0")


def box(spec: str = "8x80", visible: str | None = None) -> Discovery:
    return discover(parse_box(spec).module(), {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible})


def inventory(
    spec: str = "8x80", visible: str | None = None, envs=(VENV,), models=None, token=False, dataset=True, **needs
) -> Inventory:
    models = models if models is not None else (ModelState(TINY, None), ModelState(QWEN, None))
    need = NightNeeds(tuple(m.repo for m in models), **needs)
    return Inventory(
        need,
        box(spec, visible),
        True,
        tuple(envs),
        tuple(models),
        dataset,
        token,
        (DiskState("/hf", 500.0, 0.0, "the models (all cached)"),),
    )


def verdict(inv: Inventory) -> dict[str, tuple[str, str]]:
    return {line.what: (line.status, line.render()) for line in diagnose(inv)}


def test_8x80_with_everything_in_place_has_no_problem():
    lines = diagnose(inventory("8x80"))
    assert problems(lines) == [] and {line.status for line in lines} == {OK}
    v = verdict(inventory("8x80"))
    assert "8 GPUs x 80 GiB (NVIDIA H100 80GB HBM3)" in v["GPUs"][1]
    assert v[f"placement {TINY} P2->D8"][0] == OK and v["driver for .venv"][1].endswith("torch 2.13.0 (CUDA 13.0)")


def test_8x40_is_read_as_40_gib_gpus_and_the_accuracy_pairs_still_plan():
    v = verdict(inventory("8x40"))
    assert v["GPUs"] == (OK, "ok        GPUs: 8 GPUs x 40 GiB (NVIDIA A100-SXM4-40GB)")
    assert all(v[f"placement {m} P{p}->D{d}"][0] == OK for m, p, d in ACCURACY_RUNS)


def test_a_model_too_large_for_the_gpus_is_a_placement_problem():
    v = verdict(inventory("8x16", pairs=(("big", 2, 8),)))
    # no params_b for an unknown model: the planner says what to add
    assert v["placement big P2->D8"][0] == PROBLEM


def test_4_of_8_visible_is_a_problem_unless_the_night_is_given_4():
    v = verdict(inventory("8x80", visible="4,5,6,7"))
    status, line = v["GPUs"]
    assert status == PROBLEM and "4 of 8 visible (CUDA_VISIBLE_DEVICES=4,5,6,7); the night wants 8" in line
    assert "do: unset CUDA_VISIBLE_DEVICES" in line
    ok = verdict(inventory("8x80", visible="4,5,6,7", gpus=4))
    assert (
        ok["GPUs"][0] == OK
        and "(ids 4,5,6,7)" in ok["GPUs"][1]
        and not problems(diagnose(inventory("8x80", visible="4,5,6,7", gpus=4, pairs=((QWEN, 2, 2),))))
    )


def test_gpus_held_by_someone_else_are_a_problem():
    status, line = verdict(inventory("8x80:free=30"))["GPU memory"]
    assert status == PROBLEM and "8 GPU(s) held by others, e.g. GPU 0: 30.0 of 80.0 GiB free" in line


def test_an_old_driver_for_the_torch_of_an_environment_is_a_problem():
    old = inventory(
        "8x80:driver=570.86.15",
        envs=(VENV, EnvState(".venvs/vllm-0.26.0", "0.26.0", True, "2.11.0", "12.8", True, "0.26.0")),
    )
    v = verdict(old)
    status, line = v["driver for .venv"]
    assert status == PROBLEM and "driver 570.86.15 is older than CUDA 13.0 needs (>= 580.65.06)" in line
    assert "do: update the NVIDIA driver" in line
    assert v["driver for .venvs/vllm-0.26.0"][0] == OK  # CUDA 12.8 runs on 570
    cpu = verdict(inventory(envs=(EnvState(".venv", None, True, "2.13.0", None, True, "0.32.0"),)))
    assert cpu["driver for .venv"][0] == PROBLEM and "is a CPU build" in cpu["driver for .venv"][1]


def test_the_driver_table():
    assert min_driver("12.8") == "525.60.13" and min_driver("13.0") == "580.65.06" and min_driver("11.8") == "450.80.02"
    assert driver_problem("580.65.06", "13.0") is None and driver_problem("580.95.05", "13.0") is None
    assert driver_problem("575.51.03", "13.0") == "driver 575.51.03 is older than CUDA 13.0 needs (>= 580.65.06)"
    assert driver_problem("525.60.13", "12.9") is None and "older" in (driver_problem("520.61.05", "12.1") or "")
    assert "not in the driver table" in (driver_problem("600.1", "14.0") or "")


def test_a_missing_model_is_a_problem_and_a_gated_one_says_so():
    models = (
        ModelState(TINY, None),
        ModelState(QWEN, "model Qwen/Qwen3-0.6B is not in the local Hugging Face cache"),
        ModelState(GEMMA, "not in the cache", gated=True),
    )
    v = verdict(inventory(models=models))
    assert v[f"model {TINY}"][0] == OK
    assert v[f"model {QWEN}"][0] == PROBLEM and v[f"model {QWEN}"][1].endswith(f"do: `hf download {QWEN}`")
    status, line = v[f"model {GEMMA} (gated)"]
    assert status == PROBLEM and "401 without a token" in line and "set HF_TOKEN" in line
    # the night's step 0: its prefetch fetches what is missing, but a gated model without a token stays a problem
    night = verdict(inventory(models=models, before_prefetch=True, dataset=False))
    assert night[f"model {QWEN}"] == (OK, f"ok        model {QWEN}: not cached yet: prefetch/{QWEN} fetches it")
    assert night["dataset openai/gsm8k"][0] == OK and night[f"model {GEMMA} (gated)"][0] == PROBLEM
    # with a token the hub decides (prefetch/<model> fails on its own if the license is not accepted)
    assert verdict(inventory(models=models, token=True, before_prefetch=True))[f"model {GEMMA} (gated)"][0] == OK


def test_gsm8k_not_cached_is_a_problem_outside_the_night():
    status, line = verdict(inventory(dataset=False))["dataset openai/gsm8k"]
    assert status == PROBLEM and "hf download openai/gsm8k --repo-type dataset" in line


def test_no_lm_eval_in_an_environment_that_serves_accuracy_steps_is_a_problem():
    no_lm = EnvState(".venvs/vllm-0.21.0", "0.21.0", True, "2.9.0", "12.8", False, "0.21.0")
    v = verdict(inventory(envs=(VENV, no_lm), versions=(None, "0.21.0")))
    status, line = v["env .venvs/vllm-0.21.0"]
    assert status == PROBLEM and "lm-eval does not import there" in line
    assert ".venvs/vllm-0.21.0/bin/python -m pip install" in line and v["env .venv"][0] == OK
    assert verdict(inventory(envs=(VENV, no_lm), accuracy=False))["env .venvs/vllm-0.21.0"][0] == OK
    fresh = verdict(inventory(envs=(VENV, EnvState(".venvs/vllm-0.21.0", "0.21.0", False))))
    assert fresh["env .venvs/vllm-0.21.0"][0] == UNCHECKED  # its first step installs it: nothing to say yet


def test_a_gpu_less_box_says_so_in_one_line_and_checks_the_rest():
    inv = Inventory(
        NightNeeds((TINY,)),
        Discovery(False, reason="no NVIDIA GPU"),
        False,
        (VENV,),
        (ModelState(TINY, None),),
        True,
        False,
        (DiskState("/hf", 3.0, 2.0, "1 model(s) to fetch"),),
    )
    lines = diagnose(inv)
    assert [line.status for line in lines if line.status == UNCHECKED] == [UNCHECKED]
    assert lines[0].render() == "unchecked GPUs: no NVIDIA GPU on this machine: NVML, GPUs and driver not checked"
    whats = [line.what for line in lines]
    assert not any(w.startswith(("NVML", "driver", "placement")) for w in whats)
    assert "env .venv" in whats and f"model {TINY}" in whats and "dataset openai/gsm8k" in whats
    disk = next(line for line in lines if line.what == "disk")
    assert disk.status == PROBLEM and "3 GiB free in /hf" in disk.detail


def test_unreadable_nvml_on_a_gpu_box_is_a_problem():
    inv = Inventory(NightNeeds(()), box("unreadable"), True, (VENV,), (), True)
    assert diagnose(inv)[0].status == PROBLEM and diagnose(inv)[0].what == "NVML"


def fake_repo(tmp_path: Path, hf: Path, cached: str) -> Path:
    """A repository root with the GPU pins and a .venv (this interpreter), and ``cached`` in a hub cache."""
    root = tmp_path / "repo"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "gpu.txt").write_text("vllm==0.32.0\nnixl==1.5.1\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    repo = hf / "hub" / f"models--{cached.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc")
    snap = repo / "snapshots" / "abc"
    snap.mkdir(parents=True)
    (snap / "config.json").write_text(json.dumps({"num_attention_heads": 16, "num_key_value_heads": 8}))
    (snap / "model.safetensors").write_bytes(b"x")
    return root


def test_gather_reads_a_simulated_box_its_environments_and_the_hub_cache(tmp_path):
    hf = tmp_path / "hf"
    root = fake_repo(tmp_path, hf, QWEN)
    env = {SIMULATED_ENV: "8x40:driver=570.86.15", "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1"}
    inv = gather(NightNeeds((QWEN, TINY), versions=(None, "0.21.0")), env, root=root)
    assert inv.gpu_present and inv.nvml.count == 8 and inv.nvml.driver == "570.86.15"
    assert [m.problem is None for m in inv.models] == [True, False] and not inv.dataset_cached and not inv.token
    venv, other = inv.envs
    assert venv.name == ".venv" and venv.installed and venv.problem is None
    assert other.name == ".venvs/vllm-0.21.0" and not other.installed
    assert [d.what for d in inv.disks] == ["1 model(s) to fetch", "1 env(s)"]
    assert gather(NightNeeds(()), {**env, "HF_TOKEN": "hf_x"}, root=root).token


def test_the_night_models_are_what_the_nightly_prefetches():
    from harness.nightly import build_steps

    for gpus in (uniform_gpus(8, 80.0), uniform_gpus(8, 40.0), uniform_gpus(4, 80.0)):
        steps = build_steps(gpus, "py", Path("/runs/n"))
        fetched = [s.id.removeprefix("prefetch/") for s in steps if s.kind == "prefetch"]
        assert fetched[:-1] == night_models(gpus) and fetched[-1] == "openai/gsm8k"
        doctor = steps[0]
        assert doctor.id == "doctor" and doctor.argv[doctor.argv.index("--models") + 1] == ",".join(fetched[:-1])
        assert "--before-prefetch" in doctor.argv and doctor.argv[doctor.argv.index("--gpus") + 1] == str(len(gpus))


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    from harness.cli import main

    rc = main(["doctor", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def simulated(monkeypatch, tmp_path):
    hf = tmp_path / "hf"
    root = fake_repo(tmp_path, hf, QWEN)
    (hf / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)
    for name in ("CUDA_VISIBLE_DEVICES", "VLLM_VERSION", "HF_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(SIMULATED_ENV, "8x80")
    monkeypatch.setenv("HF_HOME", str(hf))
    monkeypatch.setattr("harness.doctor.inventory.REPO_ROOT", root)
    monkeypatch.setattr("harness.doctor.cli.gather", lambda needs, env: gather(needs, env, root=root))
    return root


def test_the_command_exits_0_without_problem_1_with_one_2_for_bad_input(capsys, simulated, monkeypatch):
    monkeypatch.setattr("harness.doctor.inventory.probe_env", lambda name, version, python: VENV)
    rc, out, _ = run_cli(capsys, "--models", QWEN)
    assert rc == 0, out
    assert out.splitlines()[0].startswith("doctor: NVML: 8 GPUs") and out.splitlines()[-1] == "doctor: no problem"
    rc, out, _ = run_cli(capsys, "--models", f"{QWEN},{TINY}")
    assert rc == 1 and f"problem   model {TINY}: " in out and out.splitlines()[-1] == "doctor: 1 problem(s)"
    rc, out, err = run_cli(capsys, "--vllm-version", "latest")
    assert rc == 2 and out == "" and err.count("\n") == 1 and "'latest' is not a version number" in err


def test_the_night_stops_at_a_failed_doctor_with_its_lines_on_screen(tmp_path):
    import io

    from harness.nightly import Step, StepResult, run_steps

    log = tmp_path / "doctor.log"
    log.write_text("doctor: NVML: 8 GPUs\nproblem   driver for .venv: driver 570 is older; do: update it\n")
    steps = [
        Step("doctor", "doctor", ("x",), 10, ("c",)),
        Step("prefetch/a/b", "prefetch", ("x",), 10, ("c",)),
        Step("matrix/a", "matrix", ("x",), 10, ("c",), 8, cast(GpuPlan, object()), skip_reason="needs 24 GPUs"),
    ]
    ran, out = [], io.StringIO()

    def runner(step, path):
        ran.append(step.id)
        return StepResult(step, "failed", 1.0, "exit code 1", str(log), 1)

    results = run_steps(steps, tmp_path, runner=runner, out=out)
    assert ran == ["doctor"] and [r.status for r in results] == ["failed", "skipped", "skipped"]
    assert results[1].message == "the night stopped: step doctor failed (its lines say what to do)"
    assert results[2].message == "needs 24 GPUs"
    assert "problem   driver for .venv: driver 570 is older; do: update it" in out.getvalue()
