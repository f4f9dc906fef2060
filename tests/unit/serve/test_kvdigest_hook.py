"""The digest hook's math on tensors laid out as vLLM's caches are: one digest per token's K or V of one head,
independent of which blocks hold the tokens, exact, and 0 for zeros."""

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")

spec = importlib.util.spec_from_file_location("pd_kv_digest_math", "harness/serve/inject/pd_kv_digest.py")
assert spec is not None and spec.loader is not None
hook = importlib.util.module_from_spec(spec)
spec.loader.exec_module(hook)

H, HD = 2, 6  # head_dim 6 x float32 = 24 bytes: exercises the padding to 8-byte words


def tokens(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, HD, generator=g), torch.randn(n, H, HD, generator=g)  # K, V per token and head


def cpu_attn_cache(k, v, blocks, bs, num_blocks=16):
    """CPU_ATTN: each (block, head) page is [K of bs tokens ; V of bs tokens], seen as [B, H, bs, 2*HD]."""
    cache = torch.zeros(num_blocks, H, 2 * bs, HD)
    for t in range(k.shape[0]):
        b, off = blocks[t // bs], t % bs
        cache[b, :, off] = k[t]
        cache[b, :, bs + off] = v[t]
    return cache.view(num_blocks, H, bs, 2 * HD)


def flash_cache(k, v, blocks, bs, num_blocks=16):
    """Token-major [B, H, N, K|V]."""
    cache = torch.zeros(num_blocks, H, bs, 2 * HD)
    for t in range(k.shape[0]):
        b, off = blocks[t // bs], t % bs
        cache[b, :, off, :HD] = k[t]
        cache[b, :, off, HD:] = v[t]
    return cache


def expected(k, v):
    return torch.stack([hook.digest_rows(k.permute(1, 0, 2)), hook.digest_rows(v.permute(1, 0, 2))])


@pytest.mark.parametrize("make", [cpu_attn_cache, flash_cache])
def test_same_tokens_in_other_blocks_and_block_sizes_give_the_same_digests(make):
    k, v = tokens(10)
    cpu = make is cpu_attn_cache
    p = hook.digest_layer(make(k, v, [3, 7, 1], 4), [3, 7, 1], np.arange(10), cpu, False)
    d = hook.digest_layer(make(k, v, [9, 2], 8), [9, 2], np.arange(10), cpu, False)
    assert p.shape == (2, H, 10)
    assert torch.equal(p, d)
    assert torch.equal(p, expected(k, v))


def test_reading_cpu_pages_token_major_would_give_other_digests():
    # the two semantics differ: the hook must branch on the backend (flash view of a CPU_ATTN page is wrong)
    k, v = tokens(8)
    cache = cpu_attn_cache(k, v, [0, 1], 4)
    assert not torch.equal(hook.digest_layer(cache, [0, 1], np.arange(8), False, False), expected(k, v))


def test_one_changed_element_changes_only_its_digest_and_zeros_digest_to_zero():
    k, v = tokens(4, seed=1)
    base = expected(k, v)
    k2 = k.clone()
    k2[2, 1, 5] = torch.nextafter(k2[2, 1, 5], torch.tensor(10.0))
    moved = expected(k2, v)
    assert (moved != base).sum() == 1 and moved[0, 1, 2] != base[0, 1, 2]
    assert int(hook.digest_rows(torch.zeros(3, HD))[0]) == 0


def test_digest_is_the_wrapping_dot_product_of_the_words():
    x = torch.randn(5, 4, dtype=torch.float64)  # 4 words a row
    w = hook.weights(4, "cpu").numpy().astype(np.uint64)
    words = x.numpy().view(np.uint64)
    want = (words * w).sum(axis=1).view(np.int64)  # numpy uint64 wraps mod 2**64
    assert np.array_equal(hook.digest_rows(x).numpy(), want)
    assert (hook.weights(4, "cpu").numpy() & 1).all()


def test_global_heads_follow_qkv_parallel_linear():
    assert hook.global_heads(1, 2, 4, 2, False) == [2, 3]
    assert hook.global_heads(1, 2, 1, 1, False) == [0]  # K=1, TP 2: both ranks hold the one head
    assert hook.global_heads(3, 4, 2, 1, False) == [1]
    assert hook.global_heads(0, 8, 8, 1, True) == [0]


def test_p_layout_reads_real_blocks_from_a_first_position_and_skips_the_null_block():
    read, offsets, pos = hook.p_layout([5, 0, 7, 9], 14, 4, first=6)
    assert read == [7, 9]  # block 1 (positions 4-7) is the null block; block 0 lies before position 6
    assert pos.tolist() == [8, 9, 10, 11, 12, 13] and offsets.tolist() == [0, 1, 2, 3, 4, 5]
    read, offsets, pos = hook.p_layout([3, 4], 6, 4)
    assert read == [3, 4] and pos.tolist() == list(range(6)) and offsets.tolist() == list(range(6))


def test_d_layout_full_attention_starts_after_the_prefix_hit():
    read, offsets, pos, left = hook.d_layout([11, 12], 14, 4, hit=8, window=0)
    assert read == [11, 12] and pos.tolist() == [8, 9, 10, 11, 12, 13] and left == 8
    assert offsets.tolist() == [0, 1, 2, 3, 4, 5]


def test_d_layout_sliding_window_aligns_the_tail_and_keeps_what_the_window_needs():
    # 14 tokens in blocks of 4 -> 4 blocks; D got the last 3 (blocks 1-3, positions 4-13); window 6 -> 8..13
    read, offsets, pos, left = hook.d_layout([21, 22, 23], 14, 4, hit=0, window=6)
    assert read == [22, 23] and pos.tolist() == [8, 9, 10, 11, 12, 13] and left == 8
    assert offsets.tolist() == [0, 1, 2, 3, 4, 5]
    # window 7 -> position 7 too, in the first tail block
    read, offsets, pos, _ = hook.d_layout([21, 22, 23], 14, 4, hit=0, window=7)
    assert read == [21, 22, 23] and pos.tolist()[0] == 7 and offsets.tolist()[0] == 3
