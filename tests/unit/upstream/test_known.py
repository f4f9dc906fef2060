"""configs/known_issues.yaml: validated, and the line each finding gets."""

import pytest

from harness.matrix.config import EDGE_YAML, load_matrix
from harness.matrix.plan import plan
from harness.upstream.known import load_known
from tests.helpers import config_error

KNOWN = load_known()


def test_each_finding_already_reported_upstream_says_so_and_the_others_say_none_is_known():
    edge, models = load_matrix(EDGE_YAML)
    lines = {p.id: p.upstream for p in plan(edge, models, "0.32.0", "cpu", 0)}
    bs96, hybrid = lines["edge-granitemoehybrid-bs96-k1-p1-d2"], lines["edge-granitemoehybrid-k1-p1-d2"]
    assert bs96 is not None and hybrid is not None
    assert bs96.startswith("known upstream: #55208 (open")
    assert "PR #55306 (open" in bs96
    assert "#41037 (closed)" in hybrid and "PR #49612 (merged" in hybrid
    for new in ("edge-bs64-k1-p1-d1", "edge-mistral-k1-p1-d1", "edge-deepseek-v2-p1-d1"):
        assert lines[new] == "no known upstream report as of 2026-12-05 (configs/known_issues.yaml)", new
    assert lines["edge-granitemoehybrid-k1-p1-d1"] is None  # no known failure: nothing to say


def test_a_failure_is_matched_by_class_signature_and_release():
    line = "All kv cache tensors must have the same number of blocks ... backend=CPU_ATTN"
    assert [r.id for r in KNOWN.for_failure("server-exited", line, "0.24.0")] == ["cpu-register-kv-caches"]
    assert KNOWN.for_failure("server-exited", line, "0.26.0") == []  # not a release it applies to
    assert KNOWN.for_failure("server-exited", "another start-up failure", "0.24.0") == []
    assert [r.id for r in KNOWN.for_failure("assert-45330")] == ["gqa-replication-handshake-assert"]


GOOD = (
    "checked: 2026-12-05\nreports:\n  - id: x\n    summary: s\n    matches: {class: output-mismatch}\n"
    "    threads: [{ref: '#1', kind: issue, state: open}]\n"
)


@pytest.mark.parametrize(
    "text, field",
    [
        (GOOD.replace("'#1'", "'1'"), "threads.0.ref"),
        (GOOD.replace("kind: issue, state: open", "kind: issue, state: merged"), "threads.0"),
        (GOOD.replace("{class: output-mismatch}", "{releases: [0.1.0]}"), "matches"),
        (GOOD.replace("{class: output-mismatch}", "{class: x, signature: '('}"), "matches.signature"),
        (GOOD.replace("checked: 2026-12-05", "checked: yesterday"), "checked"),
        (GOOD + GOOD.split("reports:\n")[1], "duplicate"),
    ],
)
def test_a_bad_known_issues_file_is_one_line_naming_the_field(tmp_path, text, field):
    p = tmp_path / "known.yaml"
    msg = config_error(load_known, p, text)
    assert field in msg and str(p) in msg and "\n" not in msg.strip()
