"""The KV digest comparison: exact equality per (request, layer, part, head, position), and what D holds instead."""

from typing import Any

import numpy as np
import pytest

from harness.checks import kv_digest as kd


def rng_digests(seed, layers=2, parts=2, heads=2, n=8):
    return np.random.default_rng(seed).integers(1, 2**62, (layers, parts, heads, n), dtype=np.int64)


def record(side, req, digest, heads=(0, 1), start=0, rank=0, left_out=0, bs=4):
    L, S, H, n = digest.shape
    return kd.DigestRecord(
        side=side,
        rank=rank,
        request_id=req,
        layers=tuple(f"model.layers.{i}.self_attn.attn" for i in range(L)),
        parts=("K", "V")[:S],
        heads=tuple(heads),
        positions=np.arange(start, start + n, dtype=np.int64),
        digest=digest,
        left_out=left_out,
        block_size=bs,
    )


def test_identical_bytes_pass_with_counts():
    p = rng_digests(1)
    c = kd.check(kd.compare([record("prefill", "r1", p), record("decode", "r1", p.copy())]))
    assert c.passed, c.detail
    assert c.detail.startswith("1 requests, 2 layers, 2 heads, 8 positions compared (64 digests), 0 left out")


def test_d_positions_after_its_prefix_hit_compare_against_the_same_positions_on_p():
    p = rng_digests(2, n=12)
    d = p[..., 4:].copy()
    c = kd.check(kd.compare([record("prefill", "r", p), record("decode", "r", d, start=4, left_out=4)]))
    assert c.passed and "8 positions compared" in c.detail and "4 left out" in c.detail


def test_a_block_offset_is_named_in_tokens_and_blocks():
    p = rng_digests(3, n=12)
    d = p.copy()
    d[..., 0:4] = p[..., 4:8]  # D's first block holds P's second block
    c = kd.check(kd.compare([record("prefill", "r", p), record("decode", "r", d)]))
    assert not c.passed
    assert c.data is not None
    assert c.data["first"] == "request r, model.layers.0.self_attn.attn K, head 0, position 0"
    assert c.data["first_holds"] == "P's position 4 (+4 tokens = +1 blocks)"
    assert c.data["holds"] == {"another position": 2 * 2 * 2 * 4}


def test_a_swapped_head_is_named():
    p = rng_digests(4)
    d = p[:, :, ::-1, :].copy()
    c = kd.check(kd.compare([record("prefill", "r", p), record("decode", "r", d)]))
    assert c.data is not None
    assert not c.passed and c.data["first_holds"] == "P's head 1"
    assert c.data["holds"] == {"another head": 64}


def test_another_requests_kv_zeros_and_foreign_bytes_are_told_apart():
    p1, p2 = rng_digests(5), rng_digests(6)
    d = p1.copy()
    d[0, 0, 0, 0] = p2[1, 1, 1, 3]
    d[0, 0, 0, 1] = 0
    d[0, 0, 0, 2] = 12345
    c = kd.check(kd.compare([record("prefill", "a", p1), record("prefill", "b", p2), record("decode", "a", d)]))
    assert not c.passed
    assert c.data is not None
    assert c.data["holds"] == {"another request": 1, "zeros": 1, "nothing P had": 1}
    assert c.data["first_holds"].startswith("request b's model.layers.1.self_attn.attn V head 1 position 3")
    assert c.data["by_layer"] == {"model.layers.0.self_attn.attn": {"differ": 3, "positions": [0, 2]}}
    where = kd.location_line(c)
    assert where is not None
    assert where.startswith("KV digest: request a, model.layers.0.self_attn.attn K, head 0, position 0")


def test_a_scaled_layer_is_located_by_layer_and_positions():
    p = rng_digests(7, n=8)
    d = p.copy()
    d[1] ^= 0x10  # every vector of layer 1 changed
    c = kd.check(kd.compare([record("prefill", "r", p), record("decode", "r", d)]))
    assert not c.passed
    assert c.data is not None
    assert list(c.data["by_layer"]) == ["model.layers.1.self_attn.attn"]
    assert c.data["by_layer"]["model.layers.1.self_attn.attn"] == {"differ": 32, "positions": [0, 7]}


def test_replicated_heads_match_any_p_replica():
    p = rng_digests(8, heads=1)
    recs = [record("prefill", "r", p, heads=(0,), rank=0), record("prefill", "r", p, heads=(0,), rank=1)]
    recs += [record("decode", "r", p.copy(), heads=(0,), rank=r) for r in (0, 1)]
    c = kd.check(kd.compare(recs))
    assert c.passed and "1 heads" in c.detail


def test_nothing_to_compare_fails_rather_than_passing():
    c = kd.check(kd.compare([record("decode", "r", rng_digests(9))]))
    assert c.data is not None
    assert not c.passed and "no request's KV" in c.detail and c.data["unmatched_requests"] == ["r"]
    assert not kd.check(kd.compare([])).passed


def test_a_d_record_without_p_record_fails_beside_matching_ones():
    p = rng_digests(10)
    recs = [record("prefill", "a", p), record("decode", "a", p.copy()), record("decode", "b", p.copy())]
    c = kd.check(kd.compare(recs))
    assert not c.passed and "1 requests received on D have no record on P" in c.detail


def test_records_round_trip_through_the_hooks_file_format(tmp_path):
    import importlib.util
    import os

    spec = importlib.util.spec_from_file_location("pd_kv_digest_rt", "harness/serve/inject/pd_kv_digest.py")
    assert spec is not None and spec.loader is not None
    hook: Any = importlib.util.module_from_spec(spec)  # its globals are set below, as the server would
    spec.loader.exec_module(hook)
    hook.FOLDER, hook.SIDE = str(tmp_path / "decode"), "decode"
    d = rng_digests(11)
    hook.write_record(1, "cmpl-x/../y", ["l0", "l1"], ["K", "V"], [2, 3], np.arange(8), d, {"block_size": 16})
    (tmp_path / "prefill").mkdir()
    (tmp_path / "prefill" / "unavailable-rank0.txt").write_text("no hook\n")
    records, unavailable = kd.load(tmp_path)
    assert len(records) == 1 and unavailable == ["prefill/unavailable-rank0: no hook"]
    r = records[0]
    assert (r.side, r.rank, r.request_id, r.layers, r.heads, r.block_size) == (
        "decode", 1, "cmpl-x/../y", ("l0", "l1"), (2, 3), 16)  # fmt: skip
    assert np.array_equal(r.digest, d)
    assert all(os.path.commonpath([str(tmp_path), str(p)]) == str(tmp_path) for p in tmp_path.rglob("*"))


def load_hook(name: str) -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, "harness/serve/inject/pd_kv_digest.py")
    assert spec is not None and spec.loader is not None
    hook: Any = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_two_engines_of_one_dp_server_never_share_a_records_temporary_file(tmp_path, monkeypatch):
    # D at data parallel 2: two engine processes, each a TP rank 0 with its own record counter, write into rank0/.
    # Their first records are both number 1; the temporary file they are written to must still be their own.
    engines = [load_hook("pd_kv_digest_dp0"), load_hook("pd_kv_digest_dp1")]
    for hook in engines:
        hook.FOLDER, hook.SIDE = str(tmp_path / "decode"), "decode"
    written: list[str] = []
    real_savez = np.savez

    def savez(path, **arrays):  # record where each engine writes before it renames
        written.append(str(path))
        real_savez(path, **arrays)

    monkeypatch.setattr(np, "savez", savez)
    for pid, (hook, rid) in zip((101, 202), zip(engines, ("cmpl-a", "cmpl-b"), strict=True), strict=True):
        monkeypatch.setattr(hook.os, "getpid", lambda pid=pid: pid)
        hook.write_record(0, rid, ["l0"], ["K"], [0], np.arange(4), rng_digests(3)[:1, :1, :1, :4], {"block_size": 16})
    assert len(set(written)) == 2, written
    records, _ = kd.load(tmp_path)
    assert sorted(r.request_id for r in records) == ["cmpl-a", "cmpl-b"]


def test_a_record_left_half_written_by_a_killed_server_is_not_read(tmp_path):
    # the hook writes a hidden temporary file and renames it when whole; a server killed in between leaves it behind
    hook = load_hook("pd_kv_digest_half")
    hook.FOLDER, hook.SIDE = str(tmp_path / "decode"), "decode"
    hook.write_record(0, "cmpl-a", ["l0"], ["K"], [0], np.arange(4), rng_digests(3)[:1, :1, :1, :4], {"block_size": 16})
    (tmp_path / "decode" / "rank0" / ".77-2.tmp.npz").write_bytes(b"PK\x03\x04 cut")
    records, _ = kd.load(tmp_path)
    assert [r.request_id for r in records] == ["cmpl-a"]
    assert all(not p.name.startswith(".") for p in kd.record_files(tmp_path))


def test_equal_kv_in_another_request_does_not_hide_the_same_requests_head():
    # two prompts with a common prefix have equal KV there: D's wrong head is still named within its own request
    p = rng_digests(12)
    other = p.copy()
    d = p[:, :, ::-1, :].copy()
    recs = [record("prefill", "a-other", other), record("prefill", "b", p), record("decode", "b", d)]
    c = kd.check(kd.compare(recs))
    assert c.data is not None
    assert c.data["holds"] == {"another head": 64} and c.data["first_holds"] == "P's head 1"


def test_k_and_v_halves_crossed_as_in_a_cpu_attn_block_size_conversion_are_named_with_their_offset():
    # D block of 8 from P blocks of 4, pages read token-major: V of tokens 0-3 holds P's K of tokens 4-7
    p = rng_digests(13, layers=1, heads=1, n=8)
    d = p.copy()
    d[0, 1, 0, 0:4] = p[0, 0, 0, 4:8]
    d[0, 0, 0, 4:8] = p[0, 1, 0, 0:4]
    c = kd.check(kd.compare([record("prefill", "r", p, heads=(0,)), record("decode", "r", d, heads=(0,))]))
    assert c.data is not None
    assert c.data["holds"] == {"K/V swapped": 8}
    assert c.data["first"].endswith("K, head 0, position 4")
    assert c.data["first_holds"] == "P's V of head 0 position 0 (-4 tokens)"


def test_a_position_the_window_needs_but_d_never_received_fails_the_check():
    # sliding window 4 over 8 tokens: D's layer needs 4..7; position 4 sits in D's null block (not received)
    p = rng_digests(14, layers=1, heads=1, n=8)
    d_rec = kd.DigestRecord(
        "decode",
        0,
        "r",
        ("model.layers.0.self_attn.attn",),
        ("K", "V"),
        (0,),
        np.arange(5, 8),
        p[..., 5:8].copy(),
        left_out=4,
        block_size=4,
        window=4,
        num_tokens=8,
    )
    c = kd.check(kd.compare([record("prefill", "r", p, heads=(0,)), d_rec]))
    assert c.data is not None
    assert not c.passed and c.data["holds"] == {"not received": 2}, c.detail
    assert c.data["first"].endswith("K, head 0, position 4") and "null block" in c.data["first_holds"]
    full = kd.DigestRecord(
        "decode",
        0,
        "r",
        ("model.layers.0.self_attn.attn",),
        ("K", "V"),
        (0,),
        np.arange(4, 8),
        p[..., 4:8].copy(),
        left_out=4,
        block_size=4,
        window=4,
        num_tokens=8,
    )
    assert kd.check(kd.compare([record("prefill", "r", p, heads=(0,)), full])).passed


class FakeRunner:
    """A model runner as vLLM's v1 one: execute_model runs the forward and returns None, sample_tokens then samples
    and runs the drafter (whose layers' KV it writes)."""

    def __init__(self, events: list, returns=None):
        self.events, self.returns = events, returns

    def execute_model(self, scheduler_output):
        self.events.append("forward")
        return self.returns

    def sample_tokens(self, grammar_output=None):
        self.events.append("drafter")
        return "sampled"


@pytest.mark.parametrize("returns, order", [(None, ["forward", "drafter", "digest"]), ("out", ["forward", "digest"])])
def test_p_digests_a_prompt_after_the_drafter_has_written_its_layers(returns, order):
    # speculative decoding writes the drafter's KV in sample_tokens, after execute_model: a digest taken between the
    # two read the drafter's layers stale (another request's, from a block used before)
    hook = load_hook("pd_kv_digest_p")
    hook.SIDE = "prefill"
    events: list[str] = []
    hook.completed_prompts = lambda runner, so: [("cmpl-a", [0], None, {})]
    hook.digest_pending = lambda pending: events.append("digest") if pending else None

    class Runner(FakeRunner):
        pass

    hook.patch_runner(Runner)
    runner = Runner(events, returns)
    out = runner.execute_model(object())
    if returns is None:
        assert events == ["forward"]  # not yet: vLLM calls sample_tokens next
        assert runner.sample_tokens() == "sampled"
    assert out == returns and events == order
