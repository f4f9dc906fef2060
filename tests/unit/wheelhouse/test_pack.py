"""Packing a wheelhouse into xz parts (pack.py): the parts reassemble into a folder that checks complete."""

from __future__ import annotations

import os
import sys
import zipfile

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
    ws = [make_wheel(folder, "app", "1.0", ["lib>=2"], files={"app/__init__.py": b"", "app/blob.bin": noise}),
          make_wheel(folder, "lib", "2.1", files={"lib/__init__.py": b"", "lib/data.bin": os.urandom(300_000)})]
    write_manifest(folder, ws, ["app==1.0"], [])
    got = pack(folder, tmp_path / "parts", part_mib=1)
    assert len(got.parts) >= 1 and all(p.stat().st_size <= 1 << 20 for p in got.parts)
    assert "filter='data'" in got.unpack and (tmp_path / "parts" / "UNPACK.txt").exists()
    data = b"".join(p.read_bytes() for p in sorted(got.parts))
    dest = tmp_path / "node"
    tarfile.open(fileobj=io.BytesIO(data), mode="r|xz").extractall(dest, filter="data")
    back = dest / "wh"
    with zipfile.ZipFile(back / ws[0].name) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.read("app/blob.bin") == noise
    result = verify(back, sys.executable)
    assert result["ok"], result  # sha256 of the stored wheels in the packed manifest, closure, pip
