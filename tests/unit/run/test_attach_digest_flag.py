"""--attached-kv-digest: the folder attached servers write digest records to is refused in one line where it cannot
work (outside attach mode, a folder that is not there) and travels with the attach spec (the report shows it)."""

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
    with pytest.raises(ConfigError, match="no such folder"):
        attach_from_args(args(attached_kv_digest=str(tmp_path / "nope"), **urls))
    spec = attach_from_args(args(attached_kv_digest=str(tmp_path), **urls))
    assert spec.digest_dir == str(tmp_path.resolve()) and spec.to_dict()["digest_dir"] == str(tmp_path.resolve())
    assert attach_from_args(args(**urls)).digest_dir is None
