"""The results store: keyed by entry, release and harness revision; unjudgeable results are not kept."""

import pytest

from harness.core.errors import ConfigError
from harness.releases.store import ResultStore, harness_revision


def test_a_result_is_found_again_only_for_the_same_entry_release_and_revision(tmp_path):
    s = ResultStore(tmp_path, revision="aaaa")
    s.put(
        "tiny-k1-p1-d2",
        "0.26.0",
        "assert-45330",
        seconds=93.4,
        run_dir="/r",
        detail="d",
        expected="ok",
        regime="B",
        by="cmd",
    )
    got = s.get("tiny-k1-p1-d2", "0.26.0")
    assert got is not None
    assert (got.outcome, got.revision, got.seconds, got.expected, got.by) == ("assert-45330", "aaaa", 93.4, "ok", "cmd")
    assert s.get("tiny-k1-p1-d2", "0.27.0") is None and s.get("tiny-k1-p2-d2", "0.26.0") is None
    other = ResultStore(tmp_path, revision="bbbb")
    assert other.get("tiny-k1-p1-d2", "0.26.0") is None
    assert other.other_revisions("tiny-k1-p1-d2", "0.26.0") == ["aaaa"]


def test_unjudgeable_results_are_not_stored(tmp_path):
    s = ResultStore(tmp_path, revision="aaaa")
    for outcome in ("install-failed", "harness-error", "interrupted", "not-run"):
        assert s.put("e", "0.24.0", outcome, seconds=1, run_dir=None) is None
        assert s.get("e", "0.24.0") is None
    assert s.put("e", "0.24.0", "server-exited", seconds=1, run_dir=None) is not None  # a finding about the release


def test_the_revision_follows_the_code_that_runs_a_pair(tmp_path):
    (tmp_path / "harness" / "run").mkdir(parents=True)
    (tmp_path / "harness" / "run" / "pd.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("docs\n")
    r1 = harness_revision(tmp_path)
    (tmp_path / "README.md").write_text("other docs\n")
    assert harness_revision(tmp_path) == r1
    (tmp_path / "harness" / "run" / "pd.py").write_text("x = 2\n")
    assert harness_revision(tmp_path) != r1


def test_a_name_that_would_leave_the_store_is_refused(tmp_path):
    """An imported pair's id or vllm_version becomes a folder and a file name: ../ or / never writes outside."""
    root = tmp_path / "store"
    s = ResultStore(root, revision="aaaa")
    for entry, version in (("../../x", "0.21.0"), ("e", "../../../y"), ("/abs", "0.21.0"), ("e", "a/b"), ("..", "1")):
        with pytest.raises(ConfigError):
            s.put(entry, version, "ok", seconds=1, run_dir=None)
        assert s.get(entry, version) is None and s.other_revisions(entry, version) == []
    assert not root.exists() and sorted(p.name for p in tmp_path.iterdir()) == []
    with pytest.raises(ConfigError):
        ResultStore(root, revision="../r").put("e", "0.21.0", "ok", seconds=1, run_dir=None)
