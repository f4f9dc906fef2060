"""The steps of build.py: checking a folder (sha256, the closure of requirements, pip from the folder alone; stub
wheels for what the image has), and, when the chosen vLLM release cannot be installed, the older one that can (a
fake index and a fake pip: no network)."""

from __future__ import annotations

import io
import sys
import urllib.error
from email.message import Message
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from harness.wheelhouse import build
from harness.wheelhouse.build import Plan, ReleaseUnavailable, verify, wheel_metadata
from harness.wheelhouse.index import Index, IndexFile, expand_platform, releases
from harness.wheelhouse.pip import PipTarget, Sources, Unservable, stub_wheel
from tests.unit.wheelhouse.wheels import PLATFORM, make_wheel, write_manifest
from tests.unit.wheelhouse.wheels import gpu_request as _request


def test_verify_passes_a_complete_folder_and_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.wheelhouse.build.WORK_DIR", tmp_path / "work")
    folder = tmp_path / "wh"
    folder.mkdir()
    ws = [make_wheel(folder, "app", "1.0", ["lib>=2", "torch==2.11.0"]), make_wheel(folder, "lib", "2.1")]
    left = [{"name": "torch", "version": "2.11.0+cu130", "why": "the image's torch", "provided": True}]
    write_manifest(folder, ws, ["app==1.0"], left)
    got = verify(folder, sys.executable)
    assert got["ok"] and got["closure_problems"] == [] and got["pip"] == "ok", got
    (folder / ws[1].name).unlink()
    got = verify(folder, sys.executable)
    assert not got["ok"]
    assert any("lib-2.1-py3-none-any.whl is missing" in p for p in got["closure_problems"])
    assert got["pip"] != "ok"  # pip, from the folder alone, cannot find lib either


def test_stub_wheels_stand_for_the_image(tmp_path):
    p = stub_wheel(tmp_path, "torch", "2.11.0+cu130")
    assert p.name == "torch-2.11.0+cu130-py3-none-any.whl"
    assert wheel_metadata(p) == ("torch", "2.11.0+cu130", [])


# --- the chosen vLLM release cannot be installed -------------------------------------------------------------------

VLLM_REQUIRES = {
    "0.34.0": ["torch==2.14.0", "flashinfer-python==0.7.3", "numpy"],
    "0.33.1": ["torch==2.14.0", "flashinfer-python==0.7.3", "numpy"],
    "0.33.0": ["torch==2.14.0", "flashinfer-python==0.7.2.post1", "numpy"],
    "0.32.0": ["torch==2.13.0", "flashinfer-python==0.7.0.post1", "numpy"],
}


def _file(name: str, version: str, tag: str = f"cp312-cp312-{PLATFORM}") -> IndexFile:
    return IndexFile(
        f"{name.replace('-', '_')}-{version}-{tag}.whl",
        f"https://files.example/{name}-{version}.whl",
        1,
        None,
        None,
        False,
    )


class FakeIndex:
    """Project pages and release metadata as a package index serves them, from memory."""

    def __init__(self, requires: dict[str, list[str]] = VLLM_REQUIRES) -> None:
        self.requires = requires
        self.pages = {
            "vllm": [_file("vllm", v, f"cp38-abi3-{PLATFORM}") for v in requires],
            "torch": [_file("torch", v) for v in ("2.14.0", "2.13.0")],
            "flashinfer-python": [_file("flashinfer-python", v, "py3-none-any") for v in ("0.7.2.post1", "0.7.4")]
            + [_file("flashinfer-python", "0.7.3", "cp312-cp312-win_amd64")],  # not for this target
            "numpy": [_file("numpy", "2.3.5")],
        }
        self.metadata_read: list[str] = []

    def project(self, name: str) -> list[IndexFile]:
        if name not in self.pages:
            raise urllib.error.HTTPError(f"https://index/{name}/", 404, "Not Found", Message(), None)
        return self.pages[name]

    def metadata(self, f: IndexFile) -> str:
        version = f.filename.split("-")[1]
        self.metadata_read.append(version)
        return f"Name: vllm\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in self.requires[version])


def _gpu_plan(chosen: str, index: FakeIndex) -> Plan:
    rel = releases(index.pages["vllm"], "3.12", expand_platform(PLATFORM))
    return Plan(
        roots=[f"vllm=={chosen}", "nixl-cu13==1.5.1", "pytest==9.2.0"],
        resolve_only=["torch==2.14.0"],
        harness_pins=["pytest==9.2.0"],
        info={"vllm": {"version": chosen}, "nixl": {"version": "1.5.1", "backend": "nixl-cu13"}},
        vllm_releases=rel,
        vllm_requires=index.requires[chosen],
    )


@pytest.fixture
def pip_asked(monkeypatch, tmp_path):
    """pip's dry runs, recorded; each answers from ``pip_asked.answers`` (vllm version -> why not; absent: resolves)."""
    monkeypatch.setattr(build, "WORK_DIR", tmp_path / "work")
    (tmp_path / "work").mkdir()
    asked: list[list[str]] = []
    answers: dict[str, str] = {}

    def fake(target, sources, lines, work, log, find_links=()):
        asked.append(lines)
        return answers.get(lines[0].split("==")[1])

    monkeypatch.setattr(build, "pip_resolves", fake)
    return SimpleNamespace(asked=asked, answers=answers)


def _error(plan: Plan, index: FakeIndex, requirement: str = "flashinfer-python==0.7.3", **kw):
    req = _request(**kw)
    target = PipTarget(sys.executable, "3.12", PLATFORM)
    said: list[str] = []
    e = Unservable(f"no distribution of {requirement} on the index for python 3.12 {PLATFORM}", requirement)
    return e, build.older_release_error(e, plan, req, target, cast(Index, index), io.StringIO(), said.append), said


def test_an_unservable_pin_names_why_and_the_older_release_pip_confirms(pip_asked):
    index = FakeIndex()
    e, got, said = _error(_gpu_plan("0.34.0", index), index)
    assert isinstance(got, ReleaseUnavailable) and got.suggestion == "0.33.0"
    assert str(got) == (
        f"vllm 0.34.0 cannot be installed for torch 2.14.0+cu130 on python 3.12 {PLATFORM}: it needs "
        "flashinfer-python==0.7.3, which the index does not serve for that target (nearest there: 0.7.2.post1, "
        "0.7.4); vllm 0.33.0 can (0.33.1: it needs flashinfer-python==0.7.3, which the index does not serve for that "
        "target (nearest there: 0.7.2.post1, 0.7.4)): python -m harness wheelhouse --dry-run --torch 2.14.0+cu130 "
        f"--python 3.12 --platform {PLATFORM} --vllm 0.33.0"
    )
    # pip was asked once, about the suggestion, with what the build resolves with; no older metadata was read.
    assert pip_asked.asked == [["vllm==0.33.0", "nixl-cu13==1.5.1", "torch==2.14.0"]]
    assert index.metadata_read == ["0.33.1", "0.33.0"]
    assert any("looking at older releases" in s for s in said)


def test_when_pip_disagrees_the_next_release_is_tried_and_the_asks_are_bounded(pip_asked):
    index = FakeIndex({**VLLM_REQUIRES, "0.32.0": ["torch==2.14.0", "numpy"]})  # as if 0.32.0 pinned torch 2.14 too
    pip_asked.answers.update(
        {
            "0.33.0": "pip finds no distribution of x==1 for that target",
            "0.32.0": "pip finds no distribution of y==2 for that target",
        }
    )
    _, got, _ = _error(_gpu_plan("0.34.0", index), index)
    assert isinstance(got, ReleaseUnavailable) and got.suggestion is None
    assert len(pip_asked.asked) == build.MAX_PIP_CONFIRMS
    assert "no older release can (looked at 3, at most 8: 0.33.1: it needs flashinfer-python==0.7.3" in str(got)
    assert "0.33.0: pip finds no distribution of x==1" in str(got)
    assert "0.32.0: pip finds no distribution of y==2" in str(got)


def test_a_failure_that_is_not_the_releases_doing_is_left_as_it_was(pip_asked):
    index = FakeIndex()
    # The harness's own requirement: no vLLM release changes it.
    e, got, _ = _error(_gpu_plan("0.34.0", index), index, requirement="pytest==9.2.0")
    assert got is e and pip_asked.asked == []
    # Not among the release's own requirements, and pip resolves the release alone: it comes from elsewhere.
    e, got, _ = _error(_gpu_plan("0.33.0", index), index, requirement="sqlitedict==2.1.0")
    assert got is e and pip_asked.asked == [["vllm==0.33.0", "nixl-cu13==1.5.1", "torch==2.14.0"]]


def test_the_suggested_command_keeps_the_request(pip_asked):
    req = _request(
        out=Path("/data/wh"),
        dry_run=False,
        freeze_file="/tmp/freeze.txt",
        drop_kernels=("fa2",),
        stubs=("tilelang",),
        sources=Sources("https://mirror/simple", ("https://extra/simple",), ("/w",)),
    )
    assert build.command_line(req, "0.33.0") == (
        "python -m harness wheelhouse --out /data/wh --image-freeze /tmp/freeze.txt --python 3.12 --platform "
        f"{PLATFORM} --vllm 0.33.0 --drop-kernels fa2 --stub tilelang --index-url https://mirror/simple "
        "--extra-index-url https://extra/simple --find-links /w"
    )


def test_the_command_says_it_on_one_line_and_exits_1(monkeypatch, capsys):
    from harness.cli import main

    def refuse(req):
        raise ReleaseUnavailable(
            "vllm 0.34.0 cannot be installed ...; vllm 0.33.0 can: python -m harness ...", "0.33.0"
        )

    monkeypatch.setattr(build, "build", refuse)
    assert (
        main(
            [
                "wheelhouse",
                "--dry-run",
                "--torch",
                "2.14.0+cu130",
                "--python",
                "{}.{}".format(*sys.version_info[:2]),
                "--platform",
                PLATFORM,
                "--resolver-python",
                sys.executable,
            ]
        )
        == 1
    )
    err = capsys.readouterr().err
    assert err == "error: vllm 0.34.0 cannot be installed ...; vllm 0.33.0 can: python -m harness ...\n"
