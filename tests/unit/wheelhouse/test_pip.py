"""The pip side (pip.py): pip runs without this machine's configuration, file names are read by packaging, wheels
built from sdists are found again."""

from __future__ import annotations

import os
from pathlib import Path

from harness.wheelhouse.pip import Sources, isolated_env


def test_pip_runs_without_this_machines_config():
    env = isolated_env(
        {"PIP_FIND_LINKS": "/opt/wheels", "PIP_INDEX_URL": "file:///x", "PIP_CERT": "/ca.pem", "HOME": "/root"}
    )
    assert env["PIP_CONFIG_FILE"] == os.devnull
    assert "PIP_FIND_LINKS" not in env and "PIP_INDEX_URL" not in env
    assert env["PIP_CERT"] == "/ca.pem" and env["HOME"] == "/root"
    assert Sources(None, find_links=("/w",)).args() == ["--no-index", "--find-links", "/w"]


def test_file_names_are_read_by_packaging():
    from packaging.version import Version

    from harness.wheelhouse.index import file_version
    from harness.wheelhouse.pip import _already_built

    assert file_version("flashinfer_python-0.7.3.tar.gz") == Version("0.7.3")
    assert file_version("Foo.Bar-1.0rc1.zip") == Version("1.0rc1")
    assert file_version("torch-2.11.0+cu130-cp312-cp312-manylinux_2_28_x86_64.whl") == Version("2.11.0+cu130")
    assert file_version("not-a-dist.txt") is None and file_version("x-1.0-bad.whl") is None
    # built wheels are found by canonical name and exact version, never by a prefix
    assert not _already_built(Path("/nonexistent"), "x", "1.0")


def test_a_built_wheel_is_matched_by_name_and_version(tmp_path):
    from harness.wheelhouse.pip import _already_built

    (tmp_path / "flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl").write_bytes(b"")
    assert _already_built(tmp_path, "Flash.Attn", "2.8.3") and not _already_built(tmp_path, "flash-attn", "2.8")
