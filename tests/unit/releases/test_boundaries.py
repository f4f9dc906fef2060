"""The measured family boundary: the matrix config carries it with its evidence, and the predictor uses it."""

import pytest

from harness.core.errors import ConfigError
from harness.matrix.config import MATRIX_YAML, load_matrix
from harness.models.topology import ModelShape, measured_fixed_in, parse_version, predict, version_family

TINY = ModelShape(4, 1, 64, "float32")


def test_the_config_carries_the_bisected_first_fixed_release_with_its_evidence():
    matrix, _ = load_matrix()
    fixed = matrix.families["fixed"]
    ev = fixed.evidence
    assert fixed.fixed_in is not None
    assert ev.command.startswith(f"python -m harness bisect {ev.entry} ") and matrix.get(ev.entry) is not None
    assert ev.date and ev.answer.startswith(f"{ev.entry}: ")
    # the evidence shows the first fixed release passing and every release tested before it failing or unjudged
    assert ev.tested[fixed.fixed_in] in ("ok", "kv-lease-expired")
    older = [v for v in ev.tested if parse_version(v) < parse_version(fixed.fixed_in)]
    assert older and all(ev.tested[v] != "ok" for v in older)
    assert f"ok from {fixed.fixed_in}" in ev.answer


def test_the_predictor_uses_the_measured_boundary():
    matrix, _ = load_matrix()
    first = matrix.families["fixed"].fixed_in
    assert first is not None
    assert measured_fixed_in() == parse_version(first)
    tested = sorted(matrix.families["fixed"].evidence.tested, key=parse_version)
    before = tested[tested.index(first) - 1]
    assert predict(TINY, 1, 2, vllm_version=before).expected == "assert-45330"
    assert predict(TINY, 1, 2, vllm_version=first).expected == "ok"
    assert version_family(before) == "pre-fix" and version_family(first) == "fixed"
    assert version_family("0.21.0", fixed_in=(0, 21, 0)) == "fixed"  # an explicit boundary wins


def test_a_families_block_is_validated(tmp_path):
    base = MATRIX_YAML.read_text()
    p = tmp_path / "m.yaml"
    p.write_text(base.replace("    fixed_in:", "    fixd_in:", 1))
    with pytest.raises(ConfigError, match="families"):
        load_matrix(p)
    p.write_text(base.replace("families:\n  fixed:\n", "families:\n  later:\n", 1))
    with pytest.raises(ConfigError, match="families"):
        load_matrix(p)
