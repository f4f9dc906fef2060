"""Dropping kernels from the vllm wheel (repack.py, and the --drop-kernels names of build.py): the files and
RECORD stay consistent."""

from __future__ import annotations

import zipfile

import pytest

from harness.core.errors import ConfigError
from harness.wheelhouse.build import kernel_patterns
from harness.wheelhouse.repack import drop_files, record_without
from tests.unit.wheelhouse.wheels import make_wheel


def test_drop_kernels_repacks_the_wheel_and_its_record(tmp_path):
    files = {
        "vllm/__init__.py": b"x = 1\n",
        "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\0" * 5000,
        "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"\1" * 3000,
    }
    w = make_wheel(tmp_path, "vllm", "0.26.0", files=files)
    dropped = drop_files(w, kernel_patterns(("fa2",)))
    assert [(d.path, d.size) for d in dropped] == [("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", 5000)]
    with zipfile.ZipFile(w) as z:
        names = z.namelist()
        record = z.read("vllm-0.26.0.dist-info/RECORD").decode()
        assert z.read("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so") == b"\1" * 3000
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" not in names and "_vllm_fa2_C" not in record
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in record
    assert drop_files(w, kernel_patterns(("fa2",))) == []  # nothing left to drop
    with pytest.raises(ConfigError, match="--drop-kernels 'fa9'"):
        kernel_patterns(("fa9",))


def test_record_without_handles_quoted_paths():
    rec = 'a/b.py,sha256=1,2\n"a/c,d.so",sha256=3,4\na/e.so,sha256=5,6\n'
    assert record_without(rec, {"a/c,d.so", "a/e.so"}) == "a/b.py,sha256=1,2\n"


def test_fa2_drop_is_the_fa2_library_only():
    assert kernel_patterns(("fa2",)) == ["vllm/vllm_flash_attn/_vllm_fa2_C*.so"]
    assert kernel_patterns(("vllm/foo/*.so",)) == ["vllm/foo/*.so"]
