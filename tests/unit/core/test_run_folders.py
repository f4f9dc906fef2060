"""Run folders are never reused silently (an old run's logs would feed the new run's failure classification), and
write_atomic is safe for two writers of one path."""

from __future__ import annotations

import json
import threading

import pytest

from harness.cli import main
from harness.core.errors import ConfigError
from harness.core.files import claim_run_dir, new_folder, run_dir_problem, write_atomic


def finished_run(path):
    (path / "logs").mkdir(parents=True)
    (path / "logs" / "decode.log").write_text("ERROR old run's fatal line\n")
    (path / "report.json").write_text("{}")
    return path


def test_a_new_or_empty_folder_is_taken_and_a_used_one_refused_in_one_line(tmp_path):
    assert run_dir_problem(tmp_path / "new") is None
    (tmp_path / "empty").mkdir()
    assert run_dir_problem(tmp_path / "empty") is None
    problem = run_dir_problem(finished_run(tmp_path / "old"))
    assert problem and "holds an earlier run" in problem and "--overwrite-run-dir" in problem and "\n" not in problem
    ray = tmp_path / "ray-entry"  # a Ray task writes its task.log into the entry's folder before the matrix starts
    ray.mkdir()
    (ray / "task.log").write_text("started\n")
    assert run_dir_problem(ray) is None
    (tmp_path / "file").write_text("x")
    assert "not a folder" in (run_dir_problem(tmp_path / "file") or "")


def test_overwrite_empties_only_an_earlier_runs_folder(tmp_path):
    old = finished_run(tmp_path / "old")
    claim_run_dir(old, overwrite=True)
    assert old.is_dir() and list(old.iterdir()) == []
    home = tmp_path / "home"
    home.mkdir()
    (home / "thesis.tex").write_text("years of work")
    with pytest.raises(ConfigError, match="does not look like a run folder"):
        claim_run_dir(home, overwrite=True)
    assert (home / "thesis.tex").exists()


def test_e2e_refuses_a_finished_runs_folder_before_anything_starts(tmp_path, capsys):
    old = finished_run(tmp_path / "old")
    assert main(["e2e", "--device", "cpu", "--run-dir", str(old)]) == 2
    err = capsys.readouterr().err
    assert "holds an earlier run" in err and "Traceback" not in err
    assert (old / "logs" / "decode.log").read_text() == "ERROR old run's fatal line\n"


def test_matrix_refuses_a_used_folder_before_installing(tmp_path, capsys):
    old = finished_run(tmp_path / "old")
    assert main(["matrix", "--device", "cpu", "--only", "tiny-k1-p1-d2", "--run-dir", str(old)]) == 2
    assert "holds an earlier run" in capsys.readouterr().err


def test_new_folder_never_hands_out_one_folder_twice(tmp_path):
    got = [new_folder(tmp_path / "shrink" / "probe-01") for _ in range(3)]
    assert [p.name for p in got] == ["probe-01", "probe-01-2", "probe-01-3"] and all(p.is_dir() for p in got)


def test_two_threads_writing_one_path_each_leave_a_whole_file(tmp_path):
    path = tmp_path / "report.json"
    texts = [json.dumps({"writer": i, "pad": "x" * 200_000}) for i in range(8)]

    def write_five_times(text: str) -> None:
        for _ in range(5):
            write_atomic(path, text)

    threads = [threading.Thread(target=write_five_times, args=(t,)) for t in texts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert path.read_text() in texts
    assert [p.name for p in tmp_path.iterdir()] == ["report.json"]  # no temp file left behind
