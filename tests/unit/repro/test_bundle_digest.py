"""The KV digest in a repro bundle: the replay's P and D digest their own KV with the harness's hooks (copied), and
repro.sh prints the harness's comparison of their records (copied, run without the project) beside its verdict."""

import importlib.util
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from harness.checks import kv_digest as kd
from harness.models.tiny import ensure_tiny_model
from harness.repro.bundle import write_bundle
from harness.serve.ports import ServerPorts
from harness.serve.vllm_cmd import INJECT_DIR, CpuTuning, Device, Role, ServerSpec, build_server_command
from tests.unit.repro.test_bundle import FAKES, fake_run, group_alive, wrong_answer_run

LAYER = "model.layers.0.self_attn.attn"
FIRST = f"{LAYER} K, head 0, position 0"


def hook_writer(folder: Path, side: str):
    """The harness's own record writer (serve/inject/pd_kv_digest.py), writing into ``folder`` as ``side``."""
    spec = importlib.util.spec_from_file_location(f"pd_kv_digest_{side}", INJECT_DIR / "pd_kv_digest.py")
    assert spec is not None and spec.loader is not None
    hook: Any = importlib.util.module_from_spec(spec)  # its globals are set below, as the server would
    spec.loader.exec_module(hook)
    hook.FOLDER, hook.SIDE = str(folder), side
    return hook


def write_pair(root: Path, request_id: str, swap: bool = False, n: int = 6) -> None:
    """P's and D's records of one request (1 layer, K and V, heads 0 and 1); ``swap``: D holds P's heads swapped."""
    p = np.random.default_rng(len(request_id)).integers(1, 2**62, (1, 2, 2, n), dtype=np.int64)
    d = p[:, :, ::-1, :].copy() if swap else p.copy()
    for side, digests in (("prefill", p), ("decode", d)):
        hook_writer(root / side, side).write_record(
            0, request_id, [LAYER], ["K", "V"], [0, 1], np.arange(n), digests, {"block_size": 4, "num_tokens": n}
        )


def detail(folder: Path) -> str:
    """What the harness's own check says of ``folder``'s records (the run's kv_digest_match detail)."""
    return kd.check(kd.compare(kd.load(folder)[0])).detail


# Runs a bundle's repro_client.py with every import of the project refused: the copied comparer must stand alone.
NO_HARNESS = """
import runpy, sys
class NoHarness:
    def find_spec(self, name, path=None, target=None):
        if name == "harness" or name.startswith("harness."):
            raise ImportError("the bundle imported the project: " + name)
sys.meta_path.insert(0, NoHarness())
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def comparer(bundle: Path, records: Path, answers: list[dict], run: Path | None = None) -> str:
    (bundle.parent / "answers.json").write_text(json.dumps(answers))
    argv = [
        str(bundle / "repro_client.py"),
        "digest",
        str(records),
        "--answers",
        str(bundle.parent / "answers.json"),
        "--vllm",
        "0.32.0",
        *(["--run", str(run)] if run else []),
    ]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    cp = subprocess.run(
        [sys.executable, "-c", NO_HARNESS, *argv],
        cwd=bundle.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cp.returncode == 0, cp.stdout + cp.stderr
    return cp.stdout


ANSWERS = [
    {"id": "p03-w5", "rid": "repro-0-aa", "prefill_status": 200},
    {"id": "p05-w13", "rid": "repro-1-bb", "prefill_status": 200},
]


@pytest.fixture
def bundle(tmp_path):
    return write_bundle(wrong_answer_run(tmp_path, sys.executable, "output-mismatch"), tmp_path / "bundle")


def test_the_copied_comparer_runs_alone_and_prints_a_pass_and_a_mismatch(tmp_path, bundle):
    good, bad = tmp_path / "good", tmp_path / "bad"
    for root in (good, bad):
        write_pair(root, "cmpl-repro-1-bb-0")
    write_pair(good, "cmpl-repro-0-aa-0")
    write_pair(bad, "cmpl-repro-0-aa-0", swap=True)
    assert comparer(bundle, good, ANSWERS).splitlines() == [f"KV digest (replay): pass: {detail(good)}"]
    lines = comparer(bundle, bad, ANSWERS).splitlines()
    assert lines[0] == f"KV digest (replay): FAIL: {detail(bad)}"
    assert lines[1] == f"  KV digest: request cmpl-repro-0-aa-0, {FIRST}: D holds P's head 1 (prompt p03-w5)"


def test_an_unavailable_digest_is_skipped_with_its_reason_never_passed(tmp_path, bundle):
    write_pair(tmp_path / "r", "cmpl-repro-0-aa-0")
    (tmp_path / "r" / "decode" / "unavailable-rank1.txt").write_text("this vLLM's receive metadata has no num_tokens\n")
    assert comparer(bundle, tmp_path / "r", ANSWERS).splitlines() == [
        "KV digest (replay): skipped: the hook could not digest on this vLLM: decode/unavailable-rank1: this vLLM's "
        "receive metadata has no num_tokens"
    ]
    assert comparer(bundle, tmp_path / "none", ANSWERS).splitlines() == [
        "KV digest (replay): skipped: no server wrote a digest record: the hook knows no NIXL worker in vLLM 0.32.0 "
        "to patch"
    ]


@pytest.mark.parametrize(
    "run_swap, replay_swap, said",
    [
        (True, True, f"the replay differs at the same place as the run (prompt p03-w5, {FIRST})"),
        (True, False, f"the replay does not differ where the run first did (prompt p03-w5, {FIRST})"),
        (False, True, "the run's records of these prompts match P's; the replay's do not"),
    ],
)
def test_the_replay_is_compared_with_the_runs_records_the_bundle_carries(tmp_path, run_swap, replay_swap, said):
    run = wrong_answer_run(tmp_path, sys.executable, "output-mismatch")
    write_pair(run / "kv_digest", "cmpl-pd-p03-w5-0-ab", swap=run_swap)
    write_pair(run / "kv_digest", "cmpl-pd-p00-w1-0-cd", swap=True)  # a prompt the bundle does not replay
    out = write_bundle(run, tmp_path / "bundle")
    write_pair(tmp_path / "replay", "cmpl-repro-0-aa-0", swap=replay_swap)
    lines = comparer(out, tmp_path / "replay", ANSWERS, run=out / "kv_digest").splitlines()
    assert f"KV digest (the run's records): {'FAIL' if run_swap else 'pass'}: {detail(out / 'kv_digest')}" in lines
    assert lines[-1] == f"KV digest: {said}"


def env_words(sh: str, **env: str) -> dict[str, list[str]]:
    """The words of repro.sh's P_ENV, D_ENV and B_ENV as bash expands them (HERE=/b, WORK=/w)."""
    lines = sh.splitlines()
    keep = [
        ln
        for ln in lines
        if ln.startswith(("REPLAY_DIGEST=", 'if [ "${REPRO_KV_DIGEST', "P_ENV=(", "D_ENV=(", "B_ENV=("))
    ]
    show = [f'printf "{p} %s\\n" "${{{p}_ENV[@]}}"' for p in "PDB"]
    out = subprocess.run(
        ["bash", "-c", "\n".join(["HERE=/b; WORK=/w", *keep, *show])],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", **env},
    ).stdout
    words: dict[str, list[str]] = {"P": [], "D": [], "B": []}
    for line in out.splitlines():
        words[line[0]].append(line[2:])
    return words


def test_the_replays_p_and_d_digest_with_the_copied_hooks_and_the_plain_server_does_not(bundle):
    sh = (bundle / "repro.sh").read_text()
    assert subprocess.run(["bash", "-n", str(bundle / "repro.sh")]).returncode == 0
    words = env_words(sh)
    for role, p in (("prefill", "P"), ("decode", "D")):
        assert {
            "PYTHONPATH=/b/hooks:/b/cpu_tuning",
            f"PD_HARNESS_KV_DIGEST=/w/replay/kv_digest/{role}",
            f"PD_HARNESS_KV_DIGEST_SIDE={role}",
        } <= set(words[p])
    assert not [w for w in words["B"] if w.startswith("PD_HARNESS_KV_DIGEST") or "hooks" in w], words["B"]
    assert "PD_HARNESS_KV_DIGEST=" in env_words(sh, REPRO_KV_DIGEST="0")["P"]  # off: the hooks stay inert
    for name in ("sitecustomize.py", "pd_kv_digest.py", "pd_kv_state.py"):  # the state half too
        assert (bundle / "hooks" / name).read_text() == (INJECT_DIR / name).read_text()
    stand_in = (bundle / "hooks" / "pd_kv_fault.py").read_text()  # the run injected no fault: no fault code
    assert "ARMED = False" in stand_in and "def " not in stand_in
    assert "`KV digest (replay): pass | FAIL | skipped ...`" in (bundle / "ISSUE.md").read_text()


def digest_run(tmp_path: Path, device: Device, fault: bool) -> Path:
    """A run whose P and D ran with the harness's hooks (the digest on; on D the scale fault, if ``fault``)."""
    run = fake_run(tmp_path, sys.executable, failed=True)
    report = json.loads((run / "report.json").read_text())
    servers: tuple[tuple[Role, int, int], ...] = (("prefill", 1, 21000), ("decode", 2, 22000))
    for role, tp, base in servers:
        spec = ServerSpec(
            role=role,
            model=str(ensure_tiny_model()),
            served_model_name="tiny-llama",
            tp=tp,
            device=device,
            block_size=32,
            gpus=(0, 1) if device == "gpu" else (),
            kv_digest_dir=str(run / "kv_digest" / role),
            fault_kv_scale=1.5 if fault and role == "decode" else None,
        )
        cmd = build_server_command(spec, ServerPorts(base, base + 10, base + 20, 20), sys.executable, CpuTuning())
        report["commands"][role] = cmd.shell()
    (run / "report.json").write_text(json.dumps(report))
    return run


def test_a_gpu_run_with_the_digest_is_bundled_with_the_hooks_alone_on_its_path(tmp_path):
    """The run's PYTHONPATH holds only the hooks' folder (no CPU tuning): rebuilt from the bundle's copy, never
    replayed as the report has it (here with another folder in front)."""
    run = digest_run(tmp_path, "gpu", fault=False)
    report = json.loads((run / "report.json").read_text())
    assert f"PYTHONPATH={INJECT_DIR}" in report["commands"]["decode"]
    report["commands"]["decode"] = report["commands"]["decode"].replace("PYTHONPATH=", "PYTHONPATH=/tmp/evil:")
    (run / "report.json").write_text(json.dumps(report))
    out = write_bundle(run, tmp_path / "bundle")
    sh = (out / "repro.sh").read_text()
    assert env_words(sh)["D"].count("PYTHONPATH=/b/hooks") == 1 and not (out / "cpu_tuning").exists()
    assert str(INJECT_DIR) not in sh and str(run / "kv_digest") not in sh and "/tmp/evil" not in sh


def test_a_run_with_a_fault_replays_it_with_the_fault_module(tmp_path):
    out = write_bundle(digest_run(tmp_path, "cpu", fault=True), tmp_path / "bundle")
    assert (out / "hooks" / "pd_kv_fault.py").read_text() == (INJECT_DIR / "pd_kv_fault.py").read_text()
    words = env_words((out / "repro.sh").read_text())
    assert "PD_HARNESS_FAULT_KV_SCALE=1.5" in words["D"] and "PYTHONPATH=/b/hooks:/b/cpu_tuning" in words["D"]


WORKER = """
class NixlBaseConnectorWorker:
    def register_kv_caches(self, kv_caches):
        pass
    def get_transfer_results(self):
        class Out:
            finished_recving = set()
            failed_recving = set()
        return Out()
"""
PROBE = """
import {mod} as m
w = m.NixlBaseConnectorWorker()
w.register_kv_caches({{}})
w.get_transfer_results()
import pd_kv_digest, pd_kv_fault
print("digest saw the worker", pd_kv_digest._STATE.get("worker") is w)
print("from", pd_kv_digest.__file__, pd_kv_fault.__file__, "armed", pd_kv_fault.ARMED)
"""


def test_the_bundles_hooks_arm_on_a_nixl_worker_with_the_fault_stand_in(tmp_path, bundle):
    mod = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
    path = tmp_path / "fake" / (mod.replace(".", "/") + ".py")
    path.parent.mkdir(parents=True)
    for parent in path.parents:
        if parent == tmp_path / "fake":
            break
        (parent / "__init__.py").touch()
    path.write_text(textwrap.dedent(WORKER))
    env = {k: v for k, v in os.environ.items() if not k.startswith("PD_HARNESS_")}
    env.update(
        PYTHONPATH=f"{bundle}/hooks:{bundle}/cpu_tuning:{tmp_path / 'fake'}",
        PD_HARNESS_KV_DIGEST=str(tmp_path / "digest"),
        PD_HARNESS_KV_DIGEST_SIDE="decode",
    )
    cp = subprocess.run(
        [sys.executable, "-c", PROBE.format(mod=mod)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert cp.returncode == 0, cp.stderr[-3000:]
    assert "digest saw the worker True" in cp.stdout, cp.stdout + cp.stderr[-2000:]
    assert f"from {bundle}/hooks/pd_kv_digest.py {bundle}/hooks/pd_kv_fault.py armed False" in cp.stdout
    assert not list((tmp_path / "digest").glob("unavailable*"))


def test_repro_sh_prints_the_digest_beside_its_verdict_and_where_the_run_differed(tmp_path):
    """Stand-in servers write records with the bundle's copy of the hook's writer; D holds P's heads swapped, as in
    the run's records of the prompt: the replay differs at the same place, and the exit code stays the verdict's."""
    fake_python = str(FAKES / "python-fake-pd")
    run = wrong_answer_run(tmp_path, fake_python, "output-mismatch")
    write_pair(run / "kv_digest", "cmpl-pd-p03-w5-0-ab", swap=True)
    out = write_bundle(run, tmp_path / "bundle")
    record, work = tmp_path / "servers.jsonl", tmp_path / "clean"
    work.mkdir()
    env = {
        **os.environ,
        "REPRO_PYTHON": fake_python,
        "FAKE_PD_REAL_PYTHON": sys.executable,
        "FAKE_PD_RECORD": str(record),
        "FAKE_PD_KV_SWAP": "1",
        "MODEL_DIR": str(ensure_tiny_model()),
        "READY_TIMEOUT": "60",
        "REQUEST_TIMEOUT": "30",
    }
    cp = subprocess.run(["bash", str(out / "repro.sh")], cwd=work, env=env, capture_output=True, text=True, timeout=180)
    assert cp.returncode == 1 and "NOT REPRODUCED: all 3 replayed request(s) match" in cp.stdout, cp.stdout + cp.stderr
    lines = cp.stdout.splitlines()
    replay = work / "repro-work" / "replay" / "kv_digest"
    assert f"KV digest (replay): FAIL: {detail(replay)}" in lines
    assert any(ln.endswith(f"{FIRST}: D holds P's head 1 (prompt p03-w5)") for ln in lines), cp.stdout
    assert lines[-1] == f"KV digest: the replay differs at the same place as the run (prompt p03-w5, {FIRST})"
    servers = [json.loads(line) for line in record.read_text().splitlines()]
    assert group_alive([s["pid"] for s in servers] + [s["child"] for s in servers]) == []
