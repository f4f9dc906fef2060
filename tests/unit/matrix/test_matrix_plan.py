"""`python -m harness matrix --list`: which pairs run here, predictions, skip reasons, filters."""

import json

from harness.cli import main


def listed(capsys, *args):
    rc = main(["matrix", "--list", "--json", *args])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else out.err)


def test_cpu_machine_runs_cpu_entries_and_skips_gpu_ones_with_a_reason(capsys):
    rc, pairs = listed(capsys, "--device", "cpu", "--gpus", "0", "--vllm-version", "0.21.0")
    assert rc == 0
    by_id = {p["id"]: p for p in pairs}
    assert by_id["tiny-k1-p1-d2"]["run"] and by_id["tiny-k1-p1-d2"]["predicted"] == "assert-45330"
    assert not by_id["tinyllama-p2-d8"]["run"] and "gpu entry" in by_id["tinyllama-p2-d8"]["skip_reason"]
    assert by_id["tiny-k1-p2-d1"]["expected"] == "rejected"


def test_gpu_entries_need_their_gpu_count(capsys):
    rc, pairs = listed(capsys, "--device", "gpu", "--gpus", "8", "--model", "llama-3.2-1b-instruct")
    assert rc == 0 and [p["id"] for p in pairs] == ["llama32-1b-p8-d16"]
    assert not pairs[0]["run"] and pairs[0]["skip_reason"] == "needs 24 GPUs, 8 present"


def test_filters_by_id_and_tp(capsys):
    rc, pairs = listed(capsys, "--only", "tiny-k1-p1-d2,tiny-k1-p2-d1", "--device", "cpu", "--gpus", "0")
    assert rc == 0 and {p["id"] for p in pairs} == {"tiny-k1-p1-d2", "tiny-k1-p2-d1"}
    rc, pairs = listed(capsys, "--tp-p", "2", "--tp-d", "1", "--device", "cpu", "--gpus", "0")
    assert {p["id"] for p in pairs} == {"tiny-k1-p2-d1", "tiny-k2-p2-d1"}
    assert {p["regime"] for p in pairs} == {"D", "E"}


def test_bad_filters_are_errors(capsys):
    rc, err = listed(capsys, "--only", "no-such-id")
    assert rc == 2 and "no-such-id" in err
    rc, err = listed(capsys, "--tp-p", "7")
    assert rc == 2 and "no matrix entry" in err


def test_text_plan(capsys):
    assert main(["matrix", "--list", "--device", "cpu", "--gpus", "0", "--only", "tiny-k1-p1-d2"]) == 0
    out = capsys.readouterr().out
    assert "tiny-k1-p1-d2" in out and "regime B" in out and "[to run]" in out
