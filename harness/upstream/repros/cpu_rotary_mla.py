"""A kernel-only reproduction of vLLM's CPU rotary-embedding custom op on MLA's strided views (no P/D, no model, no
server): `python harness/upstream/repros/cpu_rotary_mla.py` with vLLM's CPU build installed (seconds: vLLM's import).

MLA rotates the rope part of each head in place through strided views: q_pe = q[..., nope:] of q [T, H, nope+rope]
(strides (H*(nope+rope), nope+rope, 1)) and k_pe [T, 1, rope] (vllm/model_executor/layers/mla.py). With
`custom_ops` on (the default under --enforce-eager), RotaryEmbedding.forward_cpu hands those views to
`_C.rotary_embedding`; its native path (`forward_native`, what `--compilation-config
'{"custom_ops":["-rotary_embedding"]}'` selects) is the reference. The same values as [T, H*rope], the way other
attention layers call the op, agree. Prints the largest difference of each case; exit 1 when the op agrees on the
2-D layout and not on MLA's views (the bug), 0 otherwise.
No harness import: a maintainer can copy this file alone.
"""

from __future__ import annotations

import sys

import torch

TOKENS, HEADS, NOPE, ROPE = 5, 4, 128, 64
TOLERANCE = 1e-4  # float32, a rotation of values of order 1


def rope():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding.base import RotaryEmbedding

    with set_current_vllm_config(VllmConfig()):  # a custom op reads its dispatch from the current config
        return RotaryEmbedding(ROPE, ROPE, 512, 10000.0, False, torch.float32)


def mla_views(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """positions, q [T, H, NOPE+ROPE] and kv [T, 512+ROPE], as MLA lays them out before the rotation."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(TOKENS, HEADS, NOPE + ROPE, generator=g)
    kv = torch.randn(TOKENS, 512 + ROPE, generator=g)
    return torch.arange(3, 3 + TOKENS), q, kv


def rotate(kernel: bool, layout: str) -> tuple[torch.Tensor, torch.Tensor]:
    """The rotated q_pe [T, H, ROPE] and k_pe [T, 1, ROPE], by the custom op or the native path, handed over as
    ``layout``: "mla" (MLA's strided 3-D views), "3d" (contiguous 3-D copies) or "2d" ([T, H*ROPE], as attention
    layers other than MLA call it)."""
    emb = rope()
    positions, q, kv = mla_views()
    q_pe, k_pe = q[..., NOPE:], kv[:, 512:].unsqueeze(1)
    if layout == "3d":
        q_pe, k_pe = q_pe.contiguous(), k_pe.contiguous()
    elif layout == "2d":
        q_pe, k_pe = q_pe.reshape(TOKENS, HEADS * ROPE), k_pe.reshape(TOKENS, ROPE)
    forward = emb.forward_cpu if kernel else emb.forward_native
    q_out, k_out = forward(positions, q_pe, k_pe)
    assert k_out is not None
    return q_out.reshape(TOKENS, HEADS, ROPE).clone(), k_out.reshape(TOKENS, 1, ROPE).clone()


def main() -> int:
    ref_q, ref_k = rotate(kernel=False, layout="2d")
    worst = {}
    for name, layout in (
        ("[T, H*rope] (other attention layers)", "2d"),
        ("contiguous [T, H, rope]", "3d"),
        ("MLA's strided views", "mla"),
    ):
        q, k = rotate(kernel=True, layout=layout)
        worst[layout] = max(float((q - ref_q).abs().max()), float((k - ref_k).abs().max()))
        print(f"_C.rotary_embedding on {name}: max |difference| from forward_native = {worst[layout]:.3g}")
    native_q, native_k = rotate(kernel=False, layout="mla")
    native = max(float((native_q - ref_q).abs().max()), float((native_k - ref_k).abs().max()))
    print(f"forward_native on MLA's strided views: max |difference| = {native:.3g}")
    bad = worst["mla"] > TOLERANCE and worst["2d"] <= TOLERANCE
    print("REPRODUCED: the custom op mis-rotates MLA's 3-D views" if bad else "not reproduced")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
