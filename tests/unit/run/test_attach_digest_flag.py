"""--attached-kv-digest: the folder attached servers write digest records to is refused in one line where it cannot
work (outside attach mode, a file) and travels with the attach spec (the report shows it); the hook makes the folder
with its first record, so one not there yet is taken."""

import argparse

import pytest

from harness.cli import attach_from_args
from harness.core.errors import ConfigError


def args(**kw):
    base = {"prefill_url": None, "decode_url": None, "baseline_url": None, "attached_kv_digest": None}
    return argparse.Namespace(**{**base, **kw})


def test_the_digest_folder_is_for_attach_mode_and_must_exist(tmp_path):
    with pytest.raises(ConfigError, match="is for attach mode"):
        attach_from_args(args(attached_kv_digest=str(tmp_path)))
    urls = {"prefill_url": "http://p:1", "decode_url": "http://d:2"}
    (tmp_path / "a-file").write_text("")
    with pytest.raises(ConfigError, match="not a folder"):
        attach_from_args(args(attached_kv_digest=str(tmp_path / "a-file"), **urls))
    later = tmp_path / "made-by-the-first-record"
    assert attach_from_args(args(attached_kv_digest=str(later), **urls)).digest_dir == str(later.resolve())
    spec = attach_from_args(args(attached_kv_digest=str(tmp_path), **urls))
    assert spec.digest_dir == str(tmp_path.resolve()) and spec.to_dict()["digest_dir"] == str(tmp_path.resolve())
    assert attach_from_args(args(**urls)).digest_dir is None
