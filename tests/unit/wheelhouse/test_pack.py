"""Packing a wheelhouse into xz parts (pack.py): the parts reassemble into a folder that checks complete."""

from __future__ import annotations

import os
import sys
import zipfile
from pathlib import Path

import pytest

from harness.wheelhouse.build import verify
from tests.unit.wheelhouse.wheels import make_wheel, write_manifest


def test_pack_splits_into_parts_that_reassemble_into_a_complete_folder(tmp_path, monkeypatch):
    import io
    import tarfile

    from harness.wheelhouse.pack import pack

    monkeypatch.setattr("harness.wheelhouse.build.WORK_DIR", tmp_path / "work")
    folder = tmp_path / "wh"
    folder.mkdir()
    noise = bytes(range(256)) * 4000  # ~1 MB that deflate and xz both squeeze
    ws = [
        make_wheel(folder, "app", "1.0", ["lib>=2"], files={"app/__init__.py": b"", "app/blob.bin": noise}),
        make_wheel(folder, "lib", "2.1", files={"lib/__init__.py": b"", "lib/data.bin": os.urandom(300_000)}),
    ]
    write_manifest(folder, ws, ["app==1.0"], [])
    got = pack(folder, tmp_path / "parts", part_mib=1)
    assert len(got.parts) >= 1 and all(p.stat().st_size <= 1 << 20 for p in got.parts)
    assert "filter='data'" in got.unpack and (tmp_path / "parts" / "UNPACK.txt").exists()
    data = b"".join(p.read_bytes() for p in sorted(got.parts))
    dest = tmp_path / "node"
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|xz") as tar:
        tar.extractall(dest, filter="data")
    back = dest / "wh"
    with zipfile.ZipFile(back / ws[0].name) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.read("app/blob.bin") == noise
    result = verify(back, sys.executable)
    assert result["ok"], result  # sha256 of the stored wheels in the packed manifest, closure, pip


def fake_xz(tmp_path, monkeypatch, body: str) -> Path:
    """An ``xz`` first on PATH running ``body`` (sh), its pid in the returned file; a 0.3 s stall bound."""
    from harness.wheelhouse import pack

    bin_dir, pid_file = tmp_path / "bin", tmp_path / "xz.pid"
    bin_dir.mkdir()
    (bin_dir / "xz").write_text(f"#!/bin/sh\necho $$ > {pid_file}\n{body}\n")
    (bin_dir / "xz").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(pack, "XZ_STALL_S", 0.3)
    return pid_file


def small_wheelhouse(tmp_path, monkeypatch, size: int) -> Path:
    monkeypatch.setattr("harness.wheelhouse.build.WORK_DIR", tmp_path / "work")
    folder = tmp_path / "wh"
    folder.mkdir()
    w = make_wheel(folder, "lib", "2.1", files={"lib/__init__.py": b"", "lib/data.bin": os.urandom(size)})
    write_manifest(folder, [w], ["lib==2.1"], [])
    return folder


def gone(pid_file: Path) -> bool:
    try:
        os.kill(int(pid_file.read_text()), 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("size", [1_000, 1_000_000])  # all in the pipe, then the wait hangs; the writes block
def test_a_hung_xz_is_killed_and_named_in_one_line(tmp_path, monkeypatch, capsys, size):
    from harness.cli import main

    pid_file = fake_xz(tmp_path, monkeypatch, "exec sleep 60")  # reads nothing, writes nothing
    folder = small_wheelhouse(tmp_path, monkeypatch, size)
    assert main(["wheelhouse", "--pack", str(folder), "--pack-out", str(tmp_path / "parts")]) == 1
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0] == f"error: {tmp_path}/bin/xz -6 -T2 -c: wrote nothing for 0.3 s (killed)"
    assert gone(pid_file) and not list((tmp_path / "parts").glob("wh.tar.xz.*"))


def test_a_failing_xz_is_named_with_its_exit_code(tmp_path, monkeypatch):
    from harness.wheelhouse.pack import XzFailed, pack

    fake_xz(tmp_path, monkeypatch, "cat > /dev/null\nexit 3")
    with pytest.raises(XzFailed, match=r"/bin/xz -6 -T2 -c failed with exit code 3$"):
        pack(small_wheelhouse(tmp_path, monkeypatch, 1_000), tmp_path / "parts")
