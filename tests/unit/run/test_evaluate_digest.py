"""kv_digest_match is decided before its result: skipped with the reason (turned off, attach mode, a vLLM whose
internals the hook does not know), or made over the records the servers wrote; never passed without records."""

from types import SimpleNamespace
from typing import cast

import numpy as np

from harness.checks.kv_digest import load, record_files
from harness.run.context import RunContext
from harness.run.evaluate import digest_checks
from harness.run.pd import PDResult
from tests.unit.checks.test_kv_digest import record, rng_digests


def save(folder, records, prefix=""):
    """``records`` written as the hook writes them, one file each under ``folder/<side>/rank<r>/``."""
    for i, r in enumerate(records):
        side = folder / r.side / f"rank{r.rank}"
        side.mkdir(parents=True, exist_ok=True)
        meta = {
            "side": r.side,
            "rank": r.rank,
            "request_id": r.request_id,
            "layers": list(r.layers),
            "parts": list(r.parts),
        }
        np.savez(
            side / f"{prefix}{i}.npz",
            digest=r.digest,
            positions=r.positions,
            heads=np.asarray(r.heads),
            meta=np.frombuffer(__import__("json").dumps(meta).encode(), dtype=np.uint8),
        )


def run(tmp_path, kv_digest=True, attached=False, records=(), unavailable=None):
    folder = tmp_path / "kv_digest"
    save(folder, records)
    if unavailable:
        (folder / "decode").mkdir(parents=True, exist_ok=True)
        (folder / "decode" / "unavailable-rank0.txt").write_text(unavailable)
    report = SimpleNamespace(skipped_checks=[], versions={"vllm": "0.21.0"})
    ctx = SimpleNamespace(cfg=SimpleNamespace(kv_digest=kv_digest), run_dir=tmp_path, report=report, gpu=None)
    digests = None if attached or not kv_digest else load(folder)  # as run/pd.py reads them after teardown
    pd = SimpleNamespace(attached=attached, digests=digests)
    checks = digest_checks(cast(RunContext, ctx), cast(PDResult, pd))
    return {c.name: c for c in checks}, {s["name"]: s["reason"] for s in report.skipped_checks}


def test_turned_off_and_attach_mode_are_skipped_with_their_reason(tmp_path):
    p = rng_digests(1)
    recs = [record("prefill", "r", p), record("decode", "r", p.copy())]
    checks, skipped = run(tmp_path, kv_digest=False, records=recs)
    assert not checks and "--no-kv-digest" in skipped["kv_digest_match"]
    checks, skipped = run(tmp_path / "a", attached=True, records=recs)
    assert not checks and "attach mode" in skipped["kv_digest_match"]


def test_a_hook_that_could_not_arm_skips_the_check_with_its_words(tmp_path):
    checks, skipped = run(tmp_path, unavailable="NixlBaseConnectorWorker reports no finished receives")
    assert not checks and "reports no finished receives" in skipped["kv_digest_match"]


def test_no_record_from_any_server_is_skipped_with_the_version_never_passed(tmp_path):
    # an older vLLM (0.21: no nixl/base_worker.py) gives the hook nothing to patch, so no server writes a record
    checks, skipped = run(tmp_path)
    assert not checks and "vLLM 0.21.0" in skipped["kv_digest_match"]


def test_records_from_p_only_fail_rather_than_pass(tmp_path):
    checks, skipped = run(tmp_path, records=[record("prefill", "r", rng_digests(3))])
    assert not checks["kv_digest_match"].passed and not skipped


def test_records_are_compared(tmp_path):
    p = rng_digests(2)
    checks, _ = run(tmp_path, records=[record("prefill", "r", p), record("decode", "r", p.copy())])
    assert checks["kv_digest_match"].passed


def digest_only(tmp_path, monkeypatch, **kw):
    """A --no-baseline run's evaluation over the given records (the transfer and server checks stubbed out: their
    own tests are elsewhere)."""
    import harness.run.evaluate as ev

    for name in ("transfer_checks", "server_checks", "closing_checks"):
        monkeypatch.setattr(ev, name, lambda *a: [])
    monkeypatch.setattr(ev.simulated, "apply", lambda ctx: None)
    checks, _ = run(tmp_path, **kw)  # writes the records; its own evaluation is discarded
    folder = tmp_path / "kv_digest"
    report = SimpleNamespace(skipped_checks=[], versions={"vllm": "0.32.0"}, checks=None, config={})
    cfg = SimpleNamespace(kv_digest=True, device="gpu", cpu_tuning=None)
    ctx = SimpleNamespace(cfg=cfg, run_dir=tmp_path, report=report, gpu=None, prompts=[1, 2])
    answered = SimpleNamespace(completions=[1, 2], failures=[])
    pd = SimpleNamespace(attached=False, digests=load(folder), completions=answered)
    ev.evaluate(cast(RunContext, ctx), None, cast(PDResult, pd))
    return {c.name: c for c in report.checks}, {s["name"]: s["reason"] for s in report.skipped_checks}


def test_without_a_baseline_the_digest_judges_and_the_comparisons_are_skipped(tmp_path, monkeypatch):
    p = rng_digests(2)
    checks, skipped = digest_only(tmp_path, monkeypatch, records=[record("prefill", "r", p), record("decode", "r", p)])
    assert checks["kv_digest_match"].passed and checks["all_requests_answered"].passed
    for name in ("outputs_match_baseline", "logprobs_match_baseline"):
        assert "--no-baseline" in skipped[name]
    d = p.copy()
    d[0, 0, 0, 0] += 1
    checks, _ = digest_only(tmp_path / "b", monkeypatch, records=[record("prefill", "r", p), record("decode", "r", d)])
    assert not checks["kv_digest_match"].passed


def test_without_a_baseline_a_digest_that_could_not_be_made_fails_the_run(tmp_path, monkeypatch):
    # nothing else judged D's KV: a skipped digest must not leave a run that passes on transfer counters alone
    checks, skipped = digest_only(tmp_path, monkeypatch, unavailable="no finished receives")
    assert not checks["kv_digest_judged"].passed and "no finished receives" in checks["kv_digest_judged"].detail
    assert "kv_digest_match" in skipped


def attached_run(folder, earlier, added):
    """Attach mode with --attached-kv-digest: ``earlier`` records were in the folder before the run, ``added`` are
    written during it; run/pd.py compares only what the run added."""
    save(folder, earlier, "old-")
    before = record_files(folder)
    save(folder, added, "new-")
    report = SimpleNamespace(skipped_checks=[], versions={"vllm": "0.32.0"})
    ctx = SimpleNamespace(cfg=SimpleNamespace(kv_digest=True), report=report, gpu=None)
    pd = SimpleNamespace(attached=True, digests=load(folder, before))
    checks = digest_checks(cast(RunContext, ctx), cast(PDResult, pd))
    return {c.name: c for c in checks}, {s["name"]: s["reason"] for s in report.skipped_checks}


def test_attached_servers_started_with_the_hook_are_judged_on_this_runs_records_only(tmp_path):
    p = rng_digests(4)
    wrong = p.copy()
    wrong[0, 0, 0, 0] += 1
    stale = [record("prefill", "old", p), record("decode", "old", wrong)]  # an earlier run's mismatch: not this run's
    checks, skipped = attached_run(tmp_path / "a", stale, [record("prefill", "r", p), record("decode", "r", p.copy())])
    assert checks["kv_digest_match"].passed and checks["kv_digest_match"].data["requests"] == 1 and not skipped
    checks, _ = attached_run(tmp_path / "b", [], [record("prefill", "r", p), record("decode", "r", wrong)])
    assert not checks["kv_digest_match"].passed


def test_attached_servers_that_wrote_nothing_during_the_run_skip_the_check_saying_so(tmp_path):
    p = rng_digests(5)
    checks, skipped = attached_run(tmp_path, [record("prefill", "old", p), record("decode", "old", p.copy())], [])
    assert not checks and "wrote no digest record during this run" in skipped["kv_digest_match"]
