"""Matrix entries as Ray tasks (pure): the Ray address, the task each planned pair becomes (what it asks Ray for and
the command it runs on its node), and the matrix result a finished task gives. No Ray here: ``ray_tasks.py`` submits
what this plans, ``node.py`` is what a task runs on its node.

A task runs one entry as ``python -m harness matrix FILE --only ID --vllm-version V --device D --run-dir FOLDER``:
the same run a local matrix makes of the entry (its environment, its model, its baseline after P/D, its report), in
a folder of its own under the matrix folder, which therefore must be on storage every node and the driver share."""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from harness.matrix.plan import PlannedPair
from harness.matrix.run import PairResult, judge

CLIENT_PORT = 10001  # Ray Client's port on the head (`ray start --ray-client-server-port`, Ray's default)
GCS_PORT = 6379  # the head's GCS port (`ray start --head --port`, Ray's default)
# SIGTERM -> SIGKILL for an entry's harness process: its own teardown (servers, report) runs in between.
ENTRY_STOP_GRACE_S = 60.0
NOT_LAUNCHED = "vLLM refuses these TP sizes for this model; not launched"  # as a local matrix says it
TASKS_FOLDER = "ray"  # under the matrix folder: ray/vllm-<version>/<id>/, one entry's own matrix folder


@dataclass(frozen=True)
class RayAddress:
    """Where the driver connects: ``ray://HOST[:PORT]`` is Ray Client (the driver on any machine that reaches the
    head), ``HOST:PORT`` the head's GCS (the driver on a node of the cluster)."""

    host: str
    port: int
    client: bool

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'ray://' if self.client else ''}{host}:{self.port}"


def parse_address(text: str) -> RayAddress:
    """``ray://HOST[:PORT]`` (port 10001 by default) or ``HOST[:PORT]`` (6379); ValueError saying what is wrong."""
    raw = text.strip()
    client = raw.startswith("ray://")
    rest = raw[len("ray://") :] if client else raw
    if "://" in rest or "/" in rest or not rest:
        raise ValueError(f"--ray {text!r}: give ray://HOST[:PORT] (Ray Client) or HOST:PORT (the head's GCS)")
    if rest.startswith("["):  # [IPv6]:port
        host, _, tail = rest[1:].partition("]")
        port_text = tail[1:] if tail.startswith(":") else ("" if not tail else "bad")
    elif rest.count(":") > 1:  # a bare IPv6 address, no port
        host, port_text = rest, ""
    else:
        host, _, port_text = rest.partition(":")
    if not host or (":" in host and not _is_ip(host)):
        raise ValueError(f"--ray {text!r}: no host")
    if port_text and not (port_text.isdigit() and 0 < int(port_text) < 65536):
        raise ValueError(f"--ray {text!r}: {port_text!r} is not a port")
    port = int(port_text) if port_text else (CLIENT_PORT if client else GCS_PORT)
    return RayAddress(host, port, client)


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class Node:
    """A live node of the cluster, as Ray lists it."""

    node_id: str
    address: str
    cpus: float
    gpus: float
    resources: tuple[str, ...] = ()  # the names of its other resources (custom ones among them), sorted

    def to_dict(self) -> dict:
        return {"node_id": self.node_id, "address": self.address, "cpus": self.cpus, "gpus": self.gpus}


def nodes_from(raw: Iterable[Mapping]) -> list[Node]:
    """The live nodes of ``ray.nodes()``, with their CPUs and GPUs."""
    out = []
    for n in raw:
        if not n.get("Alive"):
            continue
        res = n.get("Resources") or {}
        others = tuple(sorted(k for k in res if k not in ("CPU", "GPU")))
        out.append(
            Node(
                str(n.get("NodeID", "")),
                str(n.get("NodeManagerAddress", "")),
                res.get("CPU", 0.0),
                res.get("GPU", 0.0),
                others,
            )
        )
    return out


@dataclass(frozen=True)
class TaskSpec:
    """One matrix entry on one vLLM version as a Ray task."""

    version: str
    pair_id: str
    device: str
    num_cpus: int
    num_gpus: int
    argv: tuple[str, ...]
    cwd: str  # the harness checkout, at the same path on every node
    folder: str  # the entry's own matrix folder: its report.json, the pair's run folder, task.log

    @property
    def name(self) -> str:
        return f"matrix {self.pair_id} vllm-{self.version}"

    @property
    def log(self) -> str:
        return str(Path(self.folder) / "task.log")

    @property
    def report(self) -> Path:
        return Path(self.folder) / "report.json"

    def payload(self) -> dict:
        """What the node task receives: plain data only."""
        return {
            "name": self.name,
            "argv": list(self.argv),
            "cwd": self.cwd,
            "log": self.log,
            "stop_grace_s": ENTRY_STOP_GRACE_S,
        }

    def to_dict(self) -> dict:
        return {
            "task": self.name,
            "num_cpus": self.num_cpus,
            "num_gpus": self.num_gpus,
            "argv": list(self.argv),
            "folder": self.folder,
        }


def resources(pair: PlannedPair, gpus: int | None) -> tuple[int, int]:
    """(num_cpus, num_gpus) a pair's task asks Ray for. GPU: the entry's GPUs (Ray hands them to the task as its
    CUDA_VISIBLE_DEVICES), and one CPU for the harness itself. CPU: the cores its larger TP side needs (what the
    harness's preflight asks of a machine; P and D then share them, as on one machine)."""
    if pair.device == "gpu":
        if not gpus:
            raise ValueError(f"{pair.id}: a gpu entry needs its GPU count")
        return 1, gpus
    return max(pair.tp_p, pair.tp_d), 0


def entry_folder(run_dir: Path, version: str, pair_id: str) -> Path:
    return run_dir / TASKS_FOLDER / f"vllm-{version}" / pair_id


def entry_argv(
    python: str,
    matrix_file: Path,
    pair: PlannedPair,
    version: str,
    folder: Path,
    gpus: int,
    load_requests: int | None = None,
    fresh_baseline: bool = False,
) -> tuple[str, ...]:
    """The command a task runs: the local matrix on this one entry, in its own folder."""
    argv = [python, "-m", "harness", "matrix", str(matrix_file), "--only", pair.id, "--vllm-version", version]
    argv += ["--device", pair.device, "--run-dir", str(folder)]
    if pair.device == "gpu":
        argv += ["--gpus", str(gpus)]  # the GPUs Ray gave the task (its CUDA_VISIBLE_DEVICES), no more
    if load_requests is not None:
        argv += ["--load-requests", str(load_requests)]
    if fresh_baseline:
        argv.append("--fresh-baseline")
    return tuple(argv)


def launched(pair: PlannedPair) -> bool:
    """Whether a local matrix would run the pair (the others are reported without a task)."""
    return pair.run and pair.predicted != "invalid"


def task_specs(
    plans: Mapping[str, Sequence[PlannedPair]],
    gpus_by_id: Mapping[str, int | None],
    *,
    python: str,
    cwd: Path,
    matrix_file: Path,
    run_dir: Path,
    load_requests: int | None = None,
    fresh_baseline: bool = False,
) -> list[TaskSpec]:
    """One task per pair that runs, in plan order. Paths are made absolute: a node has its own working folder."""
    run_dir, matrix_file, cwd = (Path(os.path.abspath(p)) for p in (run_dir, matrix_file, cwd))
    out = []
    for version, pairs in plans.items():
        for p in pairs:
            if not launched(p):
                continue
            cpus, gpus = resources(p, gpus_by_id.get(p.id))
            folder = entry_folder(run_dir, version, p.id)
            argv = entry_argv(python, matrix_file, p, version, folder, gpus, load_requests, fresh_baseline)
            out.append(TaskSpec(version, p.id, p.device, cpus, gpus, argv, str(cwd), str(folder)))
    return out


def fit_problem(spec: TaskSpec, nodes: Sequence[Node]) -> str | None:
    """Why no live node can run the task (Ray would wait for one for ever), or None."""
    if any(n.cpus >= spec.num_cpus and n.gpus >= spec.num_gpus for n in nodes):
        return None
    have = ", ".join(f"{n.address}: {n.cpus:g} CPUs, {n.gpus:g} GPUs" for n in nodes) or "no live node"
    return f"no node of the Ray cluster has {spec.num_cpus} CPUs and {spec.num_gpus} GPUs ({have})"


@dataclass(frozen=True)
class RayPairResult(PairResult):
    """A pair's matrix result, with where its task ran (node, address, seconds, exit code, log)."""

    ray: dict = field(default_factory=dict)

    def to_dict(self) -> dict:
        return {**super().to_dict(), "ray": self.ray}


def result_of(
    spec: TaskSpec, pair: PlannedPair, ran: Mapping | None, report: Mapping | None, error: str | None = None
) -> RayPairResult:
    """The matrix result of a finished task. ``ran``: what the node task returned (None: it did not return);
    ``report``: the entry's own matrix report (None: none was written); ``error``: why the task failed in Ray."""
    where = {"task": spec.name, "log": spec.log, "num_cpus": spec.num_cpus, "num_gpus": spec.num_gpus, **(ran or {})}
    if error:
        where["error"] = error
    rows = [
        r for r in (report or {}).get("pairs") or [] if r.get("id") == pair.id and r.get("vllm_version") == spec.version
    ]
    node = where.get("node_ip") or "?"
    if rows and rows[0].get("observed"):
        row = rows[0]
        observed = str(row["observed"])
        return RayPairResult(
            pair,
            spec.version,
            observed,
            judge(pair, observed),
            row.get("run_dir"),
            str(row.get("detail") or ""),
            bool(row.get("simulated")),
            ray=where,
        )
    if rows:  # the node's own plan skipped it (e.g. fewer GPUs there than the driver counted)
        why = rows[0].get("skip_reason") or rows[0].get("detail") or "not run"
        return RayPairResult(
            replace(pair, run=False, skip_reason=f"on Ray node {node}: {why}"), spec.version, None, None, ray=where
        )
    if error:
        why = f"the Ray task failed: {error}"
    elif ran is None:
        why = "the Ray task returned nothing"
    else:
        why = f"the entry's harness ended with exit code {ran.get('returncode')} and wrote no matrix report"
    return RayPairResult(
        pair, spec.version, "harness-error", False, None, f"on Ray node {node}: {why}; log {spec.log}", ray=where
    )


def merge(plans: Mapping[str, Sequence[PlannedPair]], done: Mapping[tuple[str, str], PairResult]) -> list[PairResult]:
    """The matrix's results in plan order: the pairs no task runs (skipped, refused) and the tasks done so far
    (keyed by (version, id)); a task still running is left out, as a local matrix leaves out the pairs to come."""
    out: list[PairResult] = []
    for version, pairs in plans.items():
        for p in pairs:
            if not p.run:
                out.append(PairResult(p, version, None, None))
            elif p.predicted == "invalid":
                out.append(PairResult(p, version, None, None, detail=NOT_LAUNCHED))
            elif (version, p.id) in done:
                out.append(done[(version, p.id)])
    return out


def render_markdown(
    results: Sequence[PairResult], address: str, nodes: Sequence[Node], cancelled: Sequence[str] = ()
) -> str:
    """The matrix report's section on the cluster: its nodes, where each task ran, the tasks an interrupt cancelled."""
    lines = [
        "",
        "## Ray",
        "",
        f"Cluster {address}: " + ", ".join(f"{n.address} ({n.cpus:g} CPUs, {n.gpus:g} GPUs)" for n in nodes),
        "",
        "| vLLM | id | node | CPUs | GPUs | CUDA_VISIBLE_DEVICES | seconds | exit | log |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        ray = getattr(r, "ray", None)
        if not ray:
            continue
        lines.append(
            f"| {r.vllm_version} | {r.pair.id} | {ray.get('node_ip', '?')} | {ray.get('num_cpus')} | "
            f"{ray.get('num_gpus')} | {ray.get('cuda_visible_devices') or '-'} | {ray.get('seconds', '-')} | "
            f"{ray.get('returncode', '-')} | {ray.get('log')} |"
        )
    if cancelled:
        lines += [
            "",
            "Cancelled (the driver was interrupted; each entry's own report says so): " + ", ".join(cancelled),
        ]
    return "\n".join(lines) + "\n"
