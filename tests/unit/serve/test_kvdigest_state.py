"""The state half of the KV digest (serve/inject/pd_kv_state.py) on Mamba2 state pages laid out as vLLM's are: a
correct TP1 -> TP2 slicing of P's state matches row by row, and the conv offsets of the hybrid finding (B and C read
as if sharded while each D rank holds a replica of the one group) are named: D's B holds P's C, D's C bytes P never
had as a row."""

import importlib.util
from types import SimpleNamespace

import numpy as np
import pytest

from harness.checks import kv_digest

torch = pytest.importorskip("torch")

INJECT = "harness/serve/inject/"
spec = importlib.util.spec_from_file_location("pd_kv_digest_state_test", INJECT + "pd_kv_digest.py")
assert spec is not None and spec.loader is not None
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)
state = hook.state

HEADS, HEAD_DIM, D_STATE, ROWS = 8, 4, 4, 3  # Mamba2: x = 32 channels, one B/C group of 4 each
X = HEADS * HEAD_DIM


def mamba2_spec(tp: int):
    local_heads = HEADS // tp
    conv = local_heads * HEAD_DIM + 2 * D_STATE  # one group: every rank holds a replica of B and C
    return SimpleNamespace(
        mamba_type=SimpleNamespace(name="MAMBA2"),
        shapes=((conv, ROWS), (local_heads, HEAD_DIM, D_STATE)),
        dtypes=(torch.float32, torch.float32),
        num_speculative_blocks=0,
    )


def p_state(seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(X + 2 * D_STATE, ROWS, generator=g), torch.randn(HEADS, HEAD_DIM, D_STATE, generator=g)


def page_cache(conv, ssm, block, num_blocks=4, pad=16):
    """[blocks, 1, 1, page] bytes with the state in ``block``: conv (DS, channel-major), then SSM, then padding."""
    body = torch.cat([conv.reshape(-1).view(torch.uint8), ssm.reshape(-1).view(torch.uint8)])
    cache = torch.zeros(num_blocks, 1, 1, len(body) + pad, dtype=torch.uint8)
    cache[block, 0, 0, : len(body)] = body
    return cache


def d_slice(conv, ssm, rank, tp, buggy=False):
    """What D rank ``rank`` holds: a correct slice, or the one vLLM's remote_conv_offsets reads (B at P column
    X + b_local * rank, C past it, where b_local is D's B width)."""
    lh = HEADS // tp
    x = conv[rank * X // tp : (rank + 1) * X // tp]
    ssm_d = ssm[rank * lh : (rank + 1) * lh]
    if not buggy:
        return torch.cat([x, conv[X:]]), ssm_d
    flat = torch.cat([conv.reshape(-1), ssm.reshape(-1)])  # reads past the conv state land in P's SSM bytes
    cols = lambda first, n: flat[first * ROWS : (first + n) * ROWS].reshape(n, ROWS)  # noqa: E731
    b = cols(X + D_STATE * rank, D_STATE)
    c = cols(X + 2 * D_STATE + D_STATE * rank, D_STATE)
    return torch.cat([x, b, c]), ssm_d


def records(side, rank, tp, conv, ssm, block=2):
    plan = state.plan_state(mamba2_spec(tp), rank, tp, n_groups=1)
    assert not isinstance(plan, str), plan
    digests = state.digest_state(page_cache(conv, ssm, block), block, plan, hook.digest_rows)
    return [
        kv_digest.DigestRecord(
            side=side,
            rank=rank,
            request_id="r0",
            layers=("layers.0.mamba",),
            parts=(part,),
            heads=tuple(plan.globals_[part]),
            positions=np.array([0]),
            digest=d.numpy()[None, None, :, None],
            kind="state",
        )
        for part, d in digests.items()
    ]


def comparison(buggy):
    conv, ssm = p_state()
    recs = records("prefill", 0, 1, conv, ssm)
    for r in range(2):
        recs += records("decode", r, 2, *d_slice(conv, ssm, r, 2, buggy))
    return kv_digest.compare(recs)


def test_a_correct_tp_slice_of_the_state_matches_every_row_and_is_counted():
    out = comparison(buggy=False)
    assert out.differ == 0
    # D's two ranks: 32 x channels, the B/C replica twice (2 x 8 rows), 8 SSM heads
    assert out.state_rows == X + 2 * 2 * D_STATE + HEADS
    c = kv_digest.check(out)
    assert c.passed and "1 state layers: 56 state rows compared" in c.detail


def test_the_hybrid_conv_offsets_are_named_b_holds_p_s_c_and_c_is_past_the_state():
    out = comparison(buggy=True)
    c = kv_digest.check(out)
    assert not c.passed
    assert out.differ == 3 * D_STATE  # rank 1's B (4 rows) and both ranks' C (8): x and SSM are right
    assert out.holds == {"another part": D_STATE, "nothing P had": 2 * D_STATE}
    assert "layers.0.mamba conv-C state, channel 0: D holds bytes P never had" in c.detail


def test_what_d_s_b_holds_is_said_in_p_s_terms():
    conv, ssm = p_state()
    index = kv_digest._PIndex(records("prefill", 0, 1, conv, ssm))
    d1 = {r.parts[0]: r for r in records("decode", 1, 2, *d_slice(conv, ssm, 1, 2, buggy=True))}
    value = int(d1["conv-B"].digest[0, 0, 0, 0])
    want = kv_digest.Key("r0", "layers.0.mamba", "conv-B", 0, 0)
    found = kv_digest.nearest(want, index.where({value})[value])
    assert kv_digest.explain(want, value, found, 0) == ("another part", "P's conv-C channel 0")


def test_groups_follow_the_heads_replicated_below_tp_and_sharded_above():
    assert state.rank_groups(0, 4, 8, 1) == state.rank_groups(1, 4, 8, 1) == [0]
    assert [state.rank_groups(r, 4, 8, 2) for r in range(2)] == [[0], [1]]
    assert [state.rank_groups(r, 2, 8, 2) for r in range(4)] == [[0], [0], [1], [1]]
    assert state.rank_groups(0, 8, 8, 4) == [0, 1, 2, 3]


def test_a_state_layout_the_hook_cannot_map_is_a_reason_never_a_guess():
    assert "group count" in state.plan_state(mamba2_spec(2), 0, 2, n_groups=None)
    gdn = SimpleNamespace(mamba_type=SimpleNamespace(name="GDN_ATTN"), shapes=((8, 3), (2, 4, 4)), dtypes=(1, 1))
    assert "not digested yet" in state.plan_state(gdn, 0, 1, n_groups=1)
    # two groups on a rank whose conv state holds one: vLLM laid it out otherwise
    assert "groups" in state.plan_state(mamba2_spec(1), 0, 1, n_groups=8)


def test_the_running_state_block_drops_scratch_slots_and_the_null_block():
    assert state.state_block([0, 0, 7], 0) == 7
    assert state.state_block([5, 8, 9], 2) == 5
    assert state.state_block([0], 0) is None
    assert state.state_block([6], 3) == 6


def test_conv_rows_of_a_state_stored_row_major_are_regathered_per_channel():
    conv, ssm = p_state(1)
    ds = state.plan_state(mamba2_spec(1), 0, 1, n_groups=1)
    sd_spec = mamba2_spec(1)
    sd_spec.shapes = ((ROWS, X + 2 * D_STATE), sd_spec.shapes[1])
    sd = state.plan_state(sd_spec, 0, 1, n_groups=1, dim_first=False)
    a = state.digest_state(page_cache(conv, ssm, 1), 1, ds, hook.digest_rows)
    b = state.digest_state(page_cache(conv.t().contiguous(), ssm, 1), 1, sd, hook.digest_rows)
    assert all(torch.equal(a[p], b[p]) for p in a)
