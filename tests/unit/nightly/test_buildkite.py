"""ci/buildkite/pd-heterogeneous-tp.yaml: the doctor first, one nightly step per vLLM version whose timeout holds that
version's worst-case night (the arithmetic of ci/nightly-gpu.yml), JUnit and run folders kept, JUnit annotated."""

from __future__ import annotations

import shlex
from typing import Any

import pytest
import yaml

from harness.core.paths import REPO_ROOT
from harness.nightly import TIMEOUTS_S
from tests.unit.nightly.ci_bounds import BOXES, SETUP_S, box, worst_case_night_s

PIPELINE = REPO_ROOT / "ci" / "buildkite" / "pd-heterogeneous-tp.yaml"


def load() -> dict[str, Any]:
    return yaml.safe_load(PIPELINE.read_text())


def steps() -> list[dict[str, Any]]:
    (group,) = load()["steps"]
    return group["steps"]


def harness_command(step: dict[str, Any]) -> list[str]:
    """The step's commands past setting up its environment."""
    cmds = step["commands"]
    assert cmds[0] == "make setup DEVICE=gpu", f"{step['key']}: its environment first"
    return cmds[1:]


def nightly_steps() -> list[dict[str, Any]]:
    return [s for s in steps() if any(c.startswith("make nightly") for c in s.get("commands", []))]


def test_the_doctor_runs_first_and_every_night_waits_for_it():
    first = steps()[0]
    doctor = harness_command(first)
    assert shlex.split(doctor[0])[:4] == [".venv/bin/python", "-m", "harness", "doctor"] and len(doctor) == 1
    assert "--before-prefetch" in doctor[0]  # the night's prefetch fetches what is not cached yet
    assert first["timeout_in_minutes"] * 60 >= SETUP_S + TIMEOUTS_S["doctor"]
    nights = nightly_steps()
    assert nights and all(s["depends_on"] == first["key"] and not s.get("allow_dependency_failure") for s in nights)


def test_every_gpu_step_names_the_one_queue_to_set():
    gpu = [s for s in steps() if "commands" in s]
    assert {s["agents"]["queue"] for s in gpu} == {"gpu_8_queue"}
    assert "The one thing to set: the agent queue" in PIPELINE.read_text()
    assert {(s["concurrency_group"], s["concurrency"]) for s in gpu} == {("pd-heterogeneous-tp/gpu", 1)}


@pytest.mark.parametrize("step", nightly_steps(), ids=lambda s: s["key"])
def test_each_nightly_step_runs_one_version_within_its_worst_case_on_8x40_and_8x80(step):
    assert [b for b in BOXES if box(b).count == 8] == ["8x40", "8x80"]
    version = step["env"]["VLLM_VERSION"] or None
    assert version is None or "," not in version  # one version a step: a step holds one version's night
    (night,) = harness_command(step)
    assert "VLLM_VERSION" not in night and "NIGHTLY_ARGS" not in night  # the plan the test checks is what runs
    assert step["timeout_in_minutes"] * 60 >= SETUP_S + worst_case_night_s(version) > 600 * 60


@pytest.mark.parametrize("step", nightly_steps(), ids=lambda s: s["key"])
def test_each_night_keeps_its_junit_and_run_folder(step):
    run_dir = shlex.split(harness_command(step)[0])[-1].removeprefix("RUN_DIR=")
    assert run_dir.startswith("runs/buildkite/")
    assert f"{run_dir}/junit.xml" in step["artifact_paths"] and f"{run_dir}/**/*" in step["artifact_paths"]


def test_the_junit_annotation_waits_for_every_night_even_a_failed_one():
    (note,) = [s for s in steps() if "plugins" in s]
    (plugin,) = note["plugins"]
    ((name, opts),) = plugin.items()
    assert name.startswith("junit-annotate#v") and opts["artifacts"] == "runs/buildkite/*/junit.xml"
    assert sorted(note["depends_on"]) == sorted(s["key"] for s in nightly_steps())
    assert note["allow_dependency_failure"] is True and note["timeout_in_minutes"] > 0
    keys = [s["key"] for s in steps()]
    assert len(keys) == len(set(keys))
