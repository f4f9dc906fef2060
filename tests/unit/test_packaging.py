"""pyproject.toml: the package, its console script, its dependencies and extras (the same pins as the file the install
path uses), and the pre-commit hooks that run what `make lint` runs."""

import re
from importlib import import_module
from importlib.metadata import distribution
from pathlib import Path

import pytest
import yaml
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's; on 3.10 pyproject.toml is not read here")

REPO = Path(__file__).resolve().parents[2]
# The tools around the harness: what the hard dependencies must not pull in, each with the extra that has it.
TOOLS = {
    "pytest": "test",
    "pytest-timeout": "test",
    "hypothesis": "test",
    "ray": "cluster",
    "matplotlib": "history",
    "nvidia-ml-py": "gpu",
}


def project() -> dict:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["project"]


def names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def requirement_lines(path: Path) -> list[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def test_the_console_script_is_declared_and_installed():
    module, func = project()["scripts"]["pd-harness"].split(":")
    assert callable(getattr(import_module(module), func))
    # make setup installs the package editable: the installed metadata names the same entry point
    installed = {e.name: e.value for e in distribution("pd-harness").entry_points if e.group == "console_scripts"}
    assert installed == {"pd-harness": f"{module}:{func}"}, "run make setup: the package is not installed as declared"


def test_the_extras_exist_and_hold_the_tools_the_hard_dependencies_leave_out():
    meta = project()
    extras = meta["optional-dependencies"]
    assert set(extras) == {"test", "cluster", "history", "gpu"}
    for tool, extra in TOOLS.items():
        assert tool in names(extras[extra]), (tool, extra)
    hard = names(meta["dependencies"])
    assert not hard & set(TOOLS), f"hard dependencies hold tools: {sorted(hard & set(TOOLS))}"
    assert {"requests", "fastapi", "lm-eval", "pyyaml"} <= hard  # what the commands import stays


def test_dependencies_and_extras_are_requirements_harness_txt_pin_for_pin():
    """make setup installs requirements/harness.txt (scripts/setup.sh); the package declares the same pins, split into
    its dependencies and extras."""
    meta = project()
    declared = meta["dependencies"] + [r for extra in meta["optional-dependencies"].values() for r in extra]
    pinned = requirement_lines(REPO / "requirements" / "harness.txt")
    assert sorted(map(str, map(Requirement, declared))) == sorted(map(str, map(Requirement, pinned)))
    assert len(declared) == len(set(declared))  # each in one place
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert "requirements/harness.txt" in setup and re.search(r"pip.* install .*--no-deps .*-e \.", setup)


def test_pytest_markers_live_in_pyproject():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0].split("(")[0] for m in markers} == {"vllm", "gpu", "slow", "full"}


def test_the_pre_commit_hooks_run_make_lints_commands_with_the_venvs_tools():
    lint = (REPO / "Makefile").read_text().split("\nlint:")[1].split("\n\n")[0]
    commands = [line.strip().removeprefix("$(PY) -m ") for line in lint.splitlines() if "$(PY) -m ruff" in line]
    commands += [line.strip().removeprefix("$(PY) -m ") for line in lint.splitlines() if "$(PY) -m mypy" in line]
    assert len(commands) == 3  # ruff check, ruff format --check, mypy
    (repo,) = yaml.safe_load((REPO / ".pre-commit-config.yaml").read_text())["repos"]
    assert repo["repo"] == "local"  # no hook repository: the tools are .venv's pinned ones
    hooks = repo["hooks"]
    assert all(h["language"] == "system" and h["entry"].startswith(".venv/bin/") for h in hooks)
    assert sorted(h["entry"].removeprefix(".venv/bin/") for h in hooks) == sorted(commands)
