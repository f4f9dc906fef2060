"""Matrix entries as Ray tasks, without Ray: the address, each task's resources and command, results and report."""

import dataclasses
from pathlib import Path

import pytest

from harness.cluster.tasks import (
    NOT_LAUNCHED,
    Node,
    RayAddress,
    RayPairResult,
    entry_folder,
    fit_problem,
    merge,
    nodes_from,
    parse_address,
    render_markdown,
    resources,
    result_of,
    task_specs,
)
from harness.matrix.config import MATRIX_YAML
from harness.matrix.plan import PlannedPair


def pair(id_="tiny-k1-p1-d2", device="cpu", tp=(1, 2), run=True, predicted="ok", expected="ok", tolerated=None):
    return PlannedPair(
        id_,
        "tiny-llama",
        device,
        tp[0],
        tp[1],
        1,
        "B",
        predicted,
        expected,
        "fixed",
        run,
        None if run else "a gpu entry; this run is on cpu",
        tolerated,
    )


@pytest.mark.parametrize(
    "text, want",
    [
        ("ray://10.0.0.1:10001", RayAddress("10.0.0.1", 10001, True)),
        ("ray://head", RayAddress("head", 10001, True)),
        ("10.0.0.1:6380", RayAddress("10.0.0.1", 6380, False)),
        ("head", RayAddress("head", 6379, False)),
        ("ray://[fd00::1]:1234", RayAddress("fd00::1", 1234, True)),
        ("[fd00::1]:6379", RayAddress("fd00::1", 6379, False)),
        (" ray://h:1 ", RayAddress("h", 1, True)),
    ],
)
def test_addresses(text, want):
    assert parse_address(text) == want


def test_an_address_url_reads_back():
    assert parse_address("ray://[fd00::1]:1234").url == "ray://[fd00::1]:1234"
    assert parse_address("10.0.0.1").url == "10.0.0.1:6379"


@pytest.mark.parametrize("text", ["", "ray://", "http://h:1", "h:port", "h:0", "h:70000", "ray://h:1/x", ":80"])
def test_bad_addresses_say_what_to_give(text):
    with pytest.raises(ValueError, match="--ray"):
        parse_address(text)


def test_resources_gpu_entry_asks_its_gpus_and_one_cpu_cpu_entry_its_larger_tp():
    assert resources(pair(device="gpu", tp=(2, 8)), 8) == (1, 8)
    assert resources(pair(tp=(1, 2)), None) == (2, 0)
    assert resources(pair(tp=(2, 1)), None) == (2, 0)
    with pytest.raises(ValueError, match="GPU count"):
        resources(pair(device="gpu"), None)


def test_one_task_per_pair_that_runs_with_the_local_matrix_command(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    plans = {
        "0.32.0": [pair("a", "gpu", (2, 8)), pair("skipped", run=False), pair("refused", predicted="invalid")],
        "0.21.0": [pair("a", "gpu", (2, 8))],
    }
    specs = task_specs(
        plans,
        {"a": 8},
        python="/venv/bin/python",
        cwd=Path("repo"),
        matrix_file=Path("m.yaml"),
        run_dir=Path("runs/x"),
        load_requests=4,
        fresh_baseline=True,
    )
    assert [(s.version, s.pair_id, s.num_cpus, s.num_gpus) for s in specs] == [
        ("0.32.0", "a", 1, 8),
        ("0.21.0", "a", 1, 8),
    ]
    s = specs[0]
    folder = tmp_path / "runs" / "x" / "ray" / "vllm-0.32.0" / "a"
    assert s.folder == str(folder) == str(entry_folder(tmp_path / "runs" / "x", "0.32.0", "a"))
    assert s.cwd == str(tmp_path / "repo") and s.log == str(folder / "task.log") and s.report == folder / "report.json"
    assert s.argv == (
        "/venv/bin/python",
        "-m",
        "harness",
        "matrix",
        str(tmp_path / "m.yaml"),
        "--only",
        "a",
        "--vllm-version",
        "0.32.0",
        "--device",
        "gpu",
        "--run-dir",
        str(folder),
        "--gpus",
        "8",
        "--load-requests",
        "4",
        "--fresh-baseline",
    )
    assert s.payload() == {
        "name": "matrix a vllm-0.32.0",
        "argv": list(s.argv),
        "cwd": s.cwd,
        "log": s.log,
        "stop_grace_s": 60.0,
    }
    assert s.to_dict()["num_gpus"] == 8


def test_a_cpu_task_takes_no_gpu_flag():
    s = task_specs(
        {"0.32.0": [pair()]}, {}, python="py", cwd=Path("/r"), matrix_file=MATRIX_YAML, run_dir=Path("/runs")
    )[0]
    assert "--gpus" not in s.argv and s.num_cpus == 2 and s.num_gpus == 0 and "--load-requests" not in s.argv


def test_the_real_matrix_file_plans_gpu_tasks_with_their_entry_gpus():
    from harness.matrix.config import load_matrix
    from harness.matrix.plan import plan

    matrix, models = load_matrix(MATRIX_YAML)
    plans = {
        "0.32.0": plan(matrix, models, "0.32.0", "gpu", 8, {"tinyllama-p2-d8", "tinyllama-p2-d4", "llama32-1b-p8-d16"})
    }
    specs = task_specs(
        plans,
        {e.id: e.gpus for e in matrix.entries},
        python="py",
        cwd=Path("/r"),
        matrix_file=MATRIX_YAML,
        run_dir=Path("/runs"),
    )
    assert {s.pair_id: s.num_gpus for s in specs} == {"tinyllama-p2-d8": 8, "tinyllama-p2-d4": 6}  # 24 GPUs: skipped


def test_nodes_are_the_live_ones_with_their_resources():
    raw = [
        {"NodeID": "n1", "NodeManagerAddress": "10.0.0.1", "Alive": True, "Resources": {"CPU": 4.0, "GPU": 8.0}},
        {"NodeID": "n2", "NodeManagerAddress": "10.0.0.2", "Alive": False, "Resources": {"CPU": 4.0}},
        {"NodeID": "n3", "NodeManagerAddress": "10.0.0.3", "Alive": True, "Resources": {"CPU": 2.0}},
    ]
    assert nodes_from(raw) == [Node("n1", "10.0.0.1", 4.0, 8.0), Node("n3", "10.0.0.3", 2.0, 0.0)]


def test_a_task_no_node_can_hold_is_named_before_ray_waits_for_ever():
    s = task_specs(
        {"v": [pair("a", "gpu", (2, 8))]},
        {"a": 8},
        python="py",
        cwd=Path("/r"),
        matrix_file=MATRIX_YAML,
        run_dir=Path("/runs"),
    )[0]
    assert fit_problem(s, [Node("n", "10.0.0.1", 16, 8)]) is None
    why = fit_problem(s, [Node("n", "10.0.0.1", 16, 4), Node("m", "10.0.0.2", 0, 8)])
    assert why == (
        "no node of the Ray cluster has 1 CPUs and 8 GPUs (10.0.0.1: 16 CPUs, 4 GPUs, 10.0.0.2: 0 CPUs, 8 GPUs)"
    )
    assert "no live node" in (fit_problem(s, []) or "")


def spec_of(p, version="0.32.0"):
    return task_specs(
        {version: [p]}, {p.id: 8}, python="py", cwd=Path("/r"), matrix_file=MATRIX_YAML, run_dir=Path("/runs")
    )[0]


RAN = {"node_id": "n1", "node_ip": "10.0.0.2", "returncode": 0, "seconds": 4.2, "cuda_visible_devices": "0,1"}


def entry_report(p, observed="ok", **row):
    return {
        "pairs": [
            {
                "id": p.id,
                "vllm_version": "0.32.0",
                "observed": observed,
                "run_dir": "/runs/ray/x",
                "detail": "",
                "simulated": False,
                **row,
            }
        ]
    }


def test_a_finished_task_is_judged_by_the_driver_from_the_entry_report():
    p = pair(expected="assert-45330")
    r = result_of(spec_of(p), p, RAN, entry_report(p, "assert-45330", detail="assert in D's log", simulated=True))
    assert isinstance(r, RayPairResult) and r.observed == "assert-45330" and r.as_expected is True
    assert r.run_dir == "/runs/ray/x" and r.detail == "assert in D's log" and r.simulated
    assert r.ray["node_ip"] == "10.0.0.2" and r.ray["num_cpus"] == 2 and r.ray["log"].endswith("task.log")
    d = r.to_dict()
    assert d["ray"]["node_id"] == "n1" and d["observed"] == "assert-45330" and d["verdict"] == "as expected"
    wrong = result_of(spec_of(p), p, RAN, entry_report(p, "ok"))
    assert wrong.as_expected is False and wrong.verdict == "UNEXPECTED"


def test_an_entry_the_node_skipped_is_a_skipped_pair_saying_where():
    p = pair()
    r = result_of(spec_of(p), p, RAN, entry_report(p, None, skip_reason="needs 8 GPUs, 4 present"))
    assert r.observed is None and r.as_expected is None and not r.pair.run
    assert r.pair.skip_reason == "on Ray node 10.0.0.2: needs 8 GPUs, 4 present"


def test_a_task_without_a_report_is_a_harness_error_never_stored():
    p = pair()
    r = result_of(spec_of(p), p, {**RAN, "returncode": 1}, None)
    assert r.observed == "harness-error" and r.as_expected is False
    assert "exit code 1 and wrote no matrix report" in r.detail and "task.log" in r.detail
    failed = result_of(spec_of(p), p, None, None, "WorkerCrashedError: the worker died")
    assert "the Ray task failed: WorkerCrashedError" in failed.detail and failed.ray["error"].startswith("Worker")
    other = result_of(spec_of(p), p, RAN, {"pairs": [{"id": "other", "vllm_version": "0.32.0", "observed": "ok"}]})
    assert other.observed == "harness-error"


def test_merge_keeps_the_plan_order_and_leaves_out_tasks_still_running():
    a, b, c = pair("a"), pair("b"), pair("c")
    skipped, refused = pair("s", run=False), pair("r", predicted="invalid")
    plans = {"v": [a, skipped, b, refused, c]}
    done = {("v", "c"): result_of(spec_of(c, "v"), c, RAN, None), ("v", "a"): result_of(spec_of(a, "v"), a, RAN, None)}
    out = merge(plans, done)
    assert [r.pair.id for r in out] == ["a", "s", "r", "c"]
    assert out[1].observed is None and out[2].detail == NOT_LAUNCHED


def test_the_report_section_says_where_each_task_ran():
    p = pair()
    r = result_of(spec_of(p), p, RAN, entry_report(p))
    md = render_markdown(
        [r, dataclasses.replace(r, ray={})],
        "ray://10.0.0.1:10001",
        [Node("n1", "10.0.0.1", 1, 8), Node("n2", "10.0.0.2", 1, 8)],
        ["matrix b vllm-v"],
    )
    assert "## Ray" in md and "Cluster ray://10.0.0.1:10001: 10.0.0.1 (1 CPUs, 8 GPUs), 10.0.0.2" in md
    rows = [line for line in md.splitlines() if line.startswith("| 0.32.0")]
    assert rows == [
        "| 0.32.0 | tiny-k1-p1-d2 | 10.0.0.2 | 2 | 0 | 0,1 | 4.2 | 0 | /runs/ray/vllm-0.32.0/tiny-k1-p1-d2/task.log |"
    ]
    assert "Cancelled (the driver was interrupted; each entry's own report says so): matrix b vllm-v" in md
