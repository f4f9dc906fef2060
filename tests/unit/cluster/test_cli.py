"""`python -m harness matrix --ray`: bad input and an unreachable cluster are one line and exit 2; the report and
the results store of a matrix run on a cluster (without Ray)."""

import json
import socket
from pathlib import Path

from harness.cli import main as harness_main
from harness.cluster.cli import SIMULATED_STORE, _render_list, cluster_device, store_results, write_cluster_report
from harness.cluster.tasks import Node, result_of, task_specs
from harness.matrix.config import MATRIX_YAML
from harness.matrix.plan import PlannedPair
from harness.releases.store import ResultStore


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_bad_address_is_one_line_and_exit_2(capsys, tmp_path):
    assert harness_main(["matrix", "--ray", "http://head:1", "--run-dir", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --ray 'http://head:1': give ray://HOST[:PORT]") and err.count("\n") == 1
    assert not (tmp_path / "m").exists()


def test_an_unreachable_cluster_is_one_line_and_exit_2(capsys, tmp_path):
    port = free_port()
    rc = harness_main(
        ["matrix", "--ray", f"ray://127.0.0.1:{port}", "--only", "tiny-k1-p1-d2", "--run-dir", str(tmp_path / "m")]
    )
    err = capsys.readouterr().err
    assert rc == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    # Ray installed: the address is probed; not installed: the error says what to install
    assert f"cannot reach the Ray cluster at ray://127.0.0.1:{port}: connection refused" in err or "--ray needs" in err
    assert not (tmp_path / "m").exists()


def test_the_device_is_the_clusters_unless_pinned():
    gpu, cpu = Node("a", "10.0.0.1", 8, 8), Node("b", "10.0.0.2", 8, 0)
    assert cluster_device([cpu, gpu], {}) == "gpu" and cluster_device([cpu], {}) == "cpu"
    assert cluster_device([gpu], {"PD_HARNESS_DEVICE": "cpu"}) == "cpu"


def pair(id_, expected="ok"):
    return PlannedPair(id_, "tiny-llama", "cpu", 1, 2, 1, "B", "ok", expected, "fixed", True, None)


def results(tmp_path):
    out = []
    for id_, observed, simulated in (("real", "ok", False), ("sim", "ok", True), ("broken", None, False)):
        p = pair(id_)
        s = task_specs({"0.32.0": [p]}, {}, python="py", cwd=Path("/r"), matrix_file=MATRIX_YAML, run_dir=tmp_path)[0]
        rep = (
            None
            if observed is None
            else {
                "pairs": [
                    {
                        "id": id_,
                        "vllm_version": "0.32.0",
                        "observed": observed,
                        "run_dir": str(tmp_path / id_),
                        "simulated": simulated,
                    }
                ]
            }
        )
        out.append(result_of(s, p, {"node_ip": "10.0.0.2", "returncode": 0 if rep else 1, "seconds": 3.0}, rep))
    return out


def test_judged_results_go_to_the_store_simulated_ones_to_the_matrix_folder(tmp_path, monkeypatch):
    monkeypatch.setenv("PD_HARNESS_RESULTS_DIR", str(tmp_path / "store"))
    run_dir = tmp_path / "m"
    kept, where = store_results(results(run_dir), run_dir)
    assert kept == 2 and where == ", ".join(sorted([str(tmp_path / "store"), str(run_dir / SIMULATED_STORE)]))
    real = ResultStore(tmp_path / "store").get("real", "0.32.0")
    assert real is not None
    assert real.outcome == "ok" and real.seconds == 3.0 and real.expected == "ok" and real.regime == "B"
    assert ResultStore(tmp_path / "store").get("sim", "0.32.0") is None
    sim = ResultStore(run_dir / SIMULATED_STORE).get("sim", "0.32.0")
    assert sim is not None and sim.outcome == "ok"
    assert ResultStore(tmp_path / "store").get("broken", "0.32.0") is None  # harness-error: never stored


def test_one_matrix_report_with_the_cluster_and_where_each_task_ran(tmp_path):
    rs = results(tmp_path)
    nodes = [Node("n1", "10.0.0.1", 1, 8), Node("n2", "10.0.0.2", 1, 8)]
    cluster = {"address": "ray://10.0.0.1:10001", "nodes": [n.to_dict() for n in nodes], "tasks": []}
    write_cluster_report(rs, ["0.32.0"], tmp_path, cluster, nodes)
    d = json.loads((tmp_path / "report.json").read_text())
    assert d["complete"] and d["ray"]["address"] == "ray://10.0.0.1:10001" and len(d["ray"]["nodes"]) == 2
    assert [p["id"] for p in d["pairs"]] == ["real", "sim", "broken"]
    assert all(p["ray"]["node_ip"] == "10.0.0.2" for p in d["pairs"])
    md = (tmp_path / "report.md").read_text()
    assert md.startswith("# GQA-replication matrix") and "## Ray" in md and md.count("| 10.0.0.2 |") == 3
    assert (tmp_path / "report.html").is_file()


def test_the_list_shows_each_task_with_its_needs_and_what_no_node_can_hold():
    from harness.matrix.config import load_matrix
    from harness.matrix.plan import plan

    matrix, models = load_matrix(MATRIX_YAML)
    plans = {"0.32.0": plan(matrix, models, "0.32.0", "gpu", 8, {"tinyllama-p2-d8", "tinyllama-p2-d4"})}
    specs = task_specs(
        plans,
        {e.id: e.gpus for e in matrix.entries},
        python="py",
        cwd=Path("/r"),
        matrix_file=MATRIX_YAML,
        run_dir=Path("/runs"),
    )
    text = _render_list(plans, specs, [Node("n", "10.0.0.1", 4, 6)])
    assert "Matrix on vLLM 0.32.0: 2 to run" in text and "Ray tasks (2):" in text
    assert "  matrix tinyllama-p2-d4 vllm-0.32.0: 1 CPUs, 6 GPUs\n" in text + "\n"
    assert (
        "  matrix tinyllama-p2-d8 vllm-0.32.0: 1 CPUs, 8 GPUs [skip: no node of the Ray cluster has 1 CPUs and 8 "
        in text
    )
