"""pyproject.toml: the package, its console script and its dependencies come from the files the install path uses."""

from importlib import import_module
from pathlib import Path

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is Python 3.11's; on 3.10 pyproject.toml is not read here")

REPO = Path(__file__).resolve().parents[2]


def test_the_console_script_and_the_dependencies_point_at_what_exists():
    meta = tomllib.loads((REPO / "pyproject.toml").read_text())
    module, func = meta["project"]["scripts"]["pd-harness"].split(":")
    assert callable(getattr(import_module(module), func))
    (deps,) = meta["tool"]["setuptools"]["dynamic"]["dependencies"]["file"]
    assert deps == "requirements/harness.txt" and (REPO / deps).is_file()  # one source: what make setup installs
    assert "requirements/harness.txt" in (REPO / "scripts" / "setup.sh").read_text()


def test_pytest_markers_live_in_pyproject():
    markers = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["markers"]
    assert {m.split(":")[0].split("(")[0] for m in markers} == {"vllm", "gpu", "slow", "full"}
