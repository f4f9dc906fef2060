"""The injected hooks (the KV digest and the decode-KV fault, one sitecustomize.py in harness/serve/inject) stack
with the CPU tuning's sitecustomize.py behind it on PYTHONPATH: a server starts (no recursion between the import
hooks), each patches the NIXL worker once, and the digest's wrapper is the outer one, so that it sees what the fault
changed."""

import os
import subprocess
import sys
import textwrap

import pytest

from harness.serve.vllm_cmd import INJECT_DIR, TUNING_DIR

WORKER = """
class NixlBaseConnectorWorker:
    calls = []
    def register_kv_caches(self, kv_caches):
        self.calls.append("register")
    def get_transfer_results(self):
        self.calls.append("inner")
        class Out:
            finished_recving = set()
            failed_recving = set()
        return Out()
"""

PROBE = """
import sys
sys.setrecursionlimit(200)  # a loop between the hooks' finders fails at once
import {mod} as m
w = m.NixlBaseConnectorWorker()
w.register_kv_caches({{}})
w.get_transfer_results()
import pd_kv_digest
print("calls", m.NixlBaseConnectorWorker.calls)
print("digest saw the worker", pd_kv_digest._STATE.get("worker") is w)
print("fault kept caches", hasattr(w, "_pd_fault_caches"))
print("digest outermost", "pd_kv_digest" in m.NixlBaseConnectorWorker.register_kv_caches.__code__.co_filename)
"""


OLD_WORKER = """
class NixlBaseConnectorWorker:
    calls = []
    def register_kv_caches(self, kv_caches):
        self.calls.append("register")
    def get_finished(self):
        self.calls.append("inner")
        return set(), set()
"""

OLD_PROBE = PROBE.replace("w.get_transfer_results()", "w.get_finished()")


@pytest.mark.parametrize("worker,probe", [(WORKER, PROBE), (OLD_WORKER, OLD_PROBE)], ids=["0.32", "0.26"])
def test_digest_fault_and_tuning_hooks_stack(tmp_path, worker, probe):
    """vLLM 0.32 reports finished receives in get_transfer_results(), 0.26 in get_finished(): both are wrapped."""
    mod = "vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker"
    pkg = tmp_path / "fake" / mod.replace(".", "/")
    pkg.parent.mkdir(parents=True)
    for parent in [pkg.parent, *pkg.parent.parents]:
        if parent == tmp_path / "fake":
            break
        (parent / "__init__.py").touch()
    pkg.with_suffix(".py").write_text(textwrap.dedent(worker))
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(INJECT_DIR), str(TUNING_DIR), str(tmp_path / "fake")]),
        "PD_HARNESS_KV_DIGEST": str(tmp_path / "digest"),
        "PD_HARNESS_KV_DIGEST_SIDE": "decode",
        "PD_HARNESS_FAULT_KV_SCALE": "1.5",
    }
    out = subprocess.run(
        [sys.executable, "-c", probe.format(mod=mod)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert "calls ['register', 'inner']" in out.stdout, out.stdout + out.stderr[-2000:]
    assert "digest saw the worker True" in out.stdout and "fault kept caches True" in out.stdout
    assert "digest outermost True" in out.stdout
    assert out.stderr.count("[pd-harness fault] armed") == 1, out.stderr[-2000:]
    assert not list((tmp_path / "digest").glob("unavailable*")), "the digest hook armed on this worker"
