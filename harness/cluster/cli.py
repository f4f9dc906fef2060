"""``python -m harness matrix ... --ray ADDRESS``: the matrix's entries as tasks on a Ray cluster, merged into one
matrix report and the results store.

The flag is the matrix command's (``matrix/cli.py``); ``harness/cli.py`` hands a matrix with ``--ray`` here, since
this package sits above ``matrix`` and ``releases`` (docs/architecture.md). The plan is made for the cluster: its
largest node's GPUs (or ``--gpus``), and the device its nodes have unless ``--device`` or $PD_HARNESS_DEVICE says."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import sys
from pathlib import Path

from harness.cluster.ray_tasks import ClusterError, connected, live_nodes, run_tasks
from harness.cluster.tasks import (
    Node,
    RayAddress,
    RayPairResult,
    TaskSpec,
    fit_problem,
    merge,
    parse_address,
    render_markdown,
    result_of,
    task_specs,
)
from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.core.interrupts import catch_interrupts
from harness.core.paths import REPO_ROOT
from harness.gpu.detect import DEVICE_ENV, default_device
from harness.matrix.plan import PlannedPair
from harness.matrix.run import PairResult, pair_line, summary, write_matrix_report

SIMULATED_STORE = "results-simulated"  # stand-ins' outcomes stay in the matrix folder, never in the results store


def cluster_device(nodes: list[Node], env=None) -> str:
    """The device of a matrix on the cluster given no --device: $PD_HARNESS_DEVICE, else gpu when a node has GPUs."""
    env = os.environ if env is None else env
    if env.get(DEVICE_ENV, "").strip():
        return default_device(env)
    return "gpu" if any(n.gpus for n in nodes) else "cpu"


def main(a: argparse.Namespace) -> int:
    from harness.matrix.config import MATRIX_YAML, load_matrix

    try:
        address = parse_address(a.ray)
        matrix_file = Path(a.file or MATRIX_YAML)
        matrix, models = load_matrix(matrix_file)
        only = {x.strip() for x in a.only.split(",") if x.strip()} if a.only else None
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    catch_interrupts()
    try:
        with connected(address) as ray:
            nodes = live_nodes(ray)
            print(f"ray: {address.url}, nodes " + ", ".join(_node_text(n) for n in nodes), flush=True)
            run_dir = Path(os.path.abspath(a.run_dir or _new_dir()))
            try:
                plans, specs = _plan(a, matrix, models, matrix_file, only, nodes, run_dir)
            except (ConfigError, ValueError) as e:
                print(f"error: {e}", file=sys.stderr)
                return 2
            if a.list:
                print(_render_list(plans, specs, nodes))
                return 0
            return _run(ray, address, nodes, plans, specs, run_dir)
    except ClusterError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt as e:  # while connecting or planning: nothing was submitted
        print("interrupted", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)


def _first_line(e: BaseException) -> str:
    return (str(e).strip().splitlines() or [""])[0]


def _node_text(n: Node) -> str:
    return f"{n.address} ({n.cpus:g} CPUs, {n.gpus:g} GPUs)"


def _plan(a, matrix, models, matrix_file: Path, only, nodes: list[Node], run_dir: Path):
    from harness.envs.vllm_env import versions_from
    from harness.matrix.plan import plan

    device = a.device or cluster_device(nodes)
    versions = versions_from(a.vllm_version, device)
    gpus = a.gpus if a.gpus is not None else int(max((n.gpus for n in nodes), default=0))
    # A node's CPU features are not this machine's: no entry is skipped for them here (the node's own plan does).
    plans = {v: plan(matrix, models, v, device, gpus, only, a.model, a.tp_p, a.tp_d, None) for v in versions}
    if not any(plans.values()):
        raise ConfigError("no matrix entry matches the filters")
    specs = task_specs(
        plans,
        {e.id: e.gpus for e in matrix.entries},
        python=sys.executable,
        cwd=REPO_ROOT,
        matrix_file=matrix_file,
        run_dir=run_dir,
        load_requests=a.load_requests,
        fresh_baseline=a.fresh_baseline,
    )
    return plans, specs


def _new_dir() -> Path:
    from harness.matrix.run import new_matrix_dir
    from harness.run.config import E2EConfig

    return new_matrix_dir(E2EConfig().runs_root)


def _render_list(plans: dict[str, list[PlannedPair]], specs: list[TaskSpec], nodes: list[Node]) -> str:
    from harness.matrix.plan import render_plan

    lines = [render_plan(pairs, v) for v, pairs in plans.items()]
    lines.append(f"Ray tasks ({len(specs)}):")
    for s in specs:
        misfit = fit_problem(s, nodes)
        lines.append(f"  {s.name}: {s.num_cpus} CPUs, {s.num_gpus} GPUs" + (f" [skip: {misfit}]" if misfit else ""))
    return "\n".join(lines)


def _pair_of(plans: dict[str, list[PlannedPair]], spec: TaskSpec) -> PlannedPair:
    return next(p for p in plans[spec.version] if p.id == spec.pair_id)


def _read_report(spec: TaskSpec) -> dict | None:
    try:
        return json.loads(spec.report.read_text())
    except (OSError, ValueError):
        return None


def _run(
    ray,
    address: RayAddress,
    nodes: list[Node],
    plans: dict[str, list[PlannedPair]],
    specs: list[TaskSpec],
    run_dir: Path,
) -> int:
    from dataclasses import replace

    versions = list(plans)
    run_dir.mkdir(parents=True, exist_ok=True)
    print(f"matrix folder: {run_dir}", flush=True)
    done: dict[tuple[str, str], PairResult] = {}
    submit = []
    for s in specs:
        misfit = fit_problem(s, nodes)
        if misfit is None:
            submit.append(s)
        else:  # Ray would wait for such a node for ever
            done[(s.version, s.pair_id)] = RayPairResult(
                replace(_pair_of(plans, s), run=False, skip_reason=misfit), s.version, None, None
            )
    cluster = {"address": address.url, "nodes": [n.to_dict() for n in nodes], "tasks": [s.to_dict() for s in specs]}

    def report(complete: bool) -> list[PairResult]:
        results = merge(plans, done)
        write_cluster_report(results, versions, run_dir, cluster, nodes, complete)
        return results

    for s in submit:
        print(f"  {s.pair_id}: Ray task ({s.num_cpus} CPUs, {s.num_gpus} GPUs), folder {s.folder}", flush=True)
    report(complete=False)

    def on_done(spec: TaskSpec, ran: dict | None, error: str | None) -> None:
        r = result_of(spec, _pair_of(plans, spec), ran, _read_report(spec), error)
        done[(spec.version, spec.pair_id)] = r
        print(pair_line(r) + f"  [Ray node {r.ray.get('node_ip', '?')}]", flush=True)
        report(complete=False)

    try:
        run_tasks(ray, submit, on_done)
    except KeyboardInterrupt as e:  # the tasks were cancelled; each entry's own report says "interrupted"
        cluster["cancelled"] = [s.name for s in submit if (s.version, s.pair_id) not in done]
        report(complete=False)
        print(f"interrupted; partial report: {run_dir / 'report.md'}", file=sys.stderr)
        return 128 + getattr(e, "signum", signal.SIGINT)
    except Exception as e:  # Ray itself failed (the connection to the head lost, ...); the tasks out were cancelled
        cluster["cancelled"] = [s.name for s in submit if (s.version, s.pair_id) not in done]
        report(complete=False)
        print(
            f"error: the Ray cluster failed: {type(e).__name__}: {_first_line(e)}; "
            f"partial report: {run_dir / 'report.md'}",
            file=sys.stderr,
        )
        return 1
    results = report(complete=True)
    stored, where = store_results(results, run_dir)
    print(summary(results, versions))
    print(f"results store: {stored} result(s) in {where}")
    print(f"report: {run_dir / 'report.md'}")
    ran = [r for r in results if r.as_expected is not None]
    return 0 if ran and all(r.as_expected for r in ran) else 1


def write_cluster_report(
    results: list[PairResult],
    versions: list[str],
    run_dir: Path,
    cluster: dict,
    nodes: list[Node],
    complete: bool = True,
) -> None:
    """The matrix report (report.json, .md, .html), with the cluster and where each task ran."""
    write_matrix_report(results, versions, run_dir, complete)
    data = json.loads((run_dir / "report.json").read_text())
    data["ray"] = cluster
    write_atomic(run_dir / "report.json", json.dumps(data, indent=2) + "\n")
    md = (run_dir / "report.md").read_text()
    section = render_markdown(results, cluster["address"], nodes, cluster.get("cancelled", ()))
    write_atomic(run_dir / "report.md", md + section)


def store_results(results: list[PairResult], run_dir: Path) -> tuple[int, str]:
    """Every judged pair into the results store (an unjudgeable one is not kept); a simulated GPU's into the matrix
    folder's own store instead. Returns how many were kept and where."""
    from harness.releases.store import ResultStore

    real = ResultStore()
    simulated = ResultStore(run_dir / SIMULATED_STORE, revision=real.revision)
    command = "python -m harness " + shlex.join(sys.argv[1:])
    kept, where = 0, set()
    for r in results:
        if r.observed is None:
            continue
        store = simulated if r.simulated else real
        seconds = float(getattr(r, "ray", {}).get("seconds") or 0.0)
        if store.put(
            r.pair.id,
            r.vllm_version,
            r.observed,
            seconds=seconds,
            run_dir=r.run_dir,
            detail=r.detail,
            expected=r.pair.expected,
            regime=r.pair.regime,
            by=command,
        ):
            kept += 1
            where.add(str(store.root))
    return kept, ", ".join(sorted(where)) or str(real.root)
