"""The state half of the KV digest: a hybrid model's Mamba layers hold one state per request (not one entry per
token), and NIXL moves it whole, in TP slices. Imported by pd_kv_digest.py inside the server; no harness import.

A Mamba layer's cache is a byte page per block ([blocks, 1, 1, page]); a request's running state is one block of
its Mamba group (the last, once speculative scratch slots are dropped). The page holds the conv state, then the
SSM state (vLLM's MambaSpec.shapes and .dtypes give their shapes):
- conv state, DS layout (conv_dim, conv_rows): one row of conv_rows values per channel. Mamba2 channels are
  [x | B | C]: x is sharded by head (rank r holds x channels r*x_local ...), B and C by group (the groups of the
  rank's heads: with fewer groups than ranks, each rank holds a replica). Mamba1 holds x only.
- SSM state: [local heads, ...], one row per head, global head r*local_heads + h.
Each row is digested as one key (part, global index): parts "conv-x", "conv-B", "conv-C", "ssm"; position 0.
P digests the state after its prompt (vLLM's P stops one token short with Mamba: D recomputes the last), D the
state it received: the two must be equal row by row.
"""

from __future__ import annotations

from dataclasses import dataclass

STATE_POSITION = 0  # a state has no token position: its key uses 0, and the record says kind "state"
GROUP_ATTRS = ("mamba_n_groups", "n_groups", "ngroups")  # the hf config's name of Mamba2's B/C group count


@dataclass(frozen=True)
class StateLayout:
    """Where each part of one rank's state page lies, and the global index of each of its rows."""

    conv_rows: int
    conv_channels: int  # local
    conv_itemsize: int
    ssm_shape: tuple[int, ...]  # local
    ssm_itemsize: int
    parts: dict[str, tuple[int, int]]  # part -> (first local conv channel, count); "ssm" -> (0, local heads)
    globals_: dict[str, list[int]]  # part -> global index of each row
    dim_first: bool = True  # conv state DS (channel-major); else (conv_rows, conv_dim)

    @property
    def conv_bytes(self) -> int:
        return self.conv_channels * self.conv_rows * self.conv_itemsize

    @property
    def ssm_bytes(self) -> int:
        n = self.ssm_itemsize
        for d in self.ssm_shape:
            n *= d
        return n


def rank_groups(rank: int, local_heads: int, total_heads: int, n_groups: int) -> list[int]:
    """The global B/C groups of a rank's heads (a group is held by every rank one of its heads is on)."""
    per_group = max(1, total_heads // max(1, n_groups))
    return sorted({(rank * local_heads + h) // per_group for h in range(local_heads)})


def plan_state(spec, rank: int, tp: int, n_groups: int | None, dim_first: bool = True) -> StateLayout | str:
    """The rank's StateLayout from its MambaSpec, or why this state cannot be digested."""
    import torch

    kind = str(getattr(getattr(spec, "mamba_type", None), "name", getattr(spec, "mamba_type", ""))).upper()
    if "MAMBA1" not in kind and "MAMBA2" not in kind:
        return f"{kind or 'this'} state layers are not digested yet (Mamba1 and Mamba2 are)"
    shapes, dtypes = tuple(spec.shapes), tuple(spec.dtypes)
    if len(shapes) != 2 or len(shapes[0]) != 2:
        return f"state shapes {shapes} are not (conv, ssm) with a 2-D conv state"
    channels, conv_rows = (shapes[0][0], shapes[0][1]) if dim_first else (shapes[0][1], shapes[0][0])
    ssm_shape = tuple(int(d) for d in shapes[1])
    itemsize = [torch.empty(0, dtype=d).element_size() for d in dtypes]
    local_heads = ssm_shape[0]
    parts: dict[str, tuple[int, int]] = {"ssm": (0, local_heads)}
    globals_: dict[str, list[int]] = {"ssm": [rank * local_heads + h for h in range(local_heads)]}
    if "MAMBA1" in kind:
        parts["conv-x"] = (0, channels)
        globals_["conv-x"] = [rank * channels + c for c in range(channels)]
    else:
        if len(ssm_shape) != 3:
            return f"Mamba2 SSM state shape {ssm_shape} is not (heads, head_dim, d_state)"
        x_local, d_state = local_heads * ssm_shape[1], ssm_shape[2]
        bc = (channels - x_local) // 2
        if bc <= 0 or channels != x_local + 2 * bc or bc % d_state:
            return f"conv channels {channels} do not split into x {x_local} + B + C of d_state {d_state}"
        if n_groups is None:
            return "the model config names no Mamba2 group count (" + ", ".join(GROUP_ATTRS) + ")"
        groups = rank_groups(rank, local_heads, local_heads * tp, n_groups)
        if len(groups) * d_state != bc:
            return f"rank {rank} holds {bc // d_state} B/C groups but its heads touch groups {groups}"
        bc_ids = [g * d_state + j for g in groups for j in range(d_state)]
        parts.update({"conv-x": (0, x_local), "conv-B": (x_local, bc), "conv-C": (x_local + bc, bc)})
        globals_.update({"conv-x": [rank * x_local + c for c in range(x_local)], "conv-B": bc_ids, "conv-C": bc_ids})
    return StateLayout(conv_rows, channels, itemsize[0], ssm_shape, itemsize[1], parts, globals_, dim_first)


def state_block(blocks: list[int], spec_blocks: int) -> int | None:
    """The block holding a request's running state: the last real one once speculative scratch slots are dropped
    (vLLM's clip_ssm_state_blocks), never the null block 0."""
    real = [b for b in blocks if b != 0]
    if not real:
        return None
    scratch = min(spec_blocks, len(real) - 1)
    return (real[:-scratch] if scratch else real)[-1]


def state_rows(page, layout: StateLayout) -> dict:
    """part -> uint8 [rows, bytes per row] of one state page (a 1-D byte tensor)."""
    conv = page[: layout.conv_bytes]
    width = layout.conv_rows * layout.conv_itemsize
    if layout.dim_first:
        by_channel = conv.reshape(layout.conv_channels, width)
    else:  # (conv_rows, conv_dim): a channel's values are strided
        by_channel = (
            conv.reshape(layout.conv_rows, layout.conv_channels, layout.conv_itemsize)
            .permute(1, 0, 2)
            .reshape(layout.conv_channels, width)
        )
    out = {}
    for part, (first, count) in layout.parts.items():
        if part == "ssm":
            ssm = page[layout.conv_bytes : layout.conv_bytes + layout.ssm_bytes]
            out[part] = ssm.reshape(count, -1)
        else:
            out[part] = by_channel[first : first + count]
    return out


def digest_state(cache, block: int, layout: StateLayout, digest_rows) -> dict:
    """part -> int64 digests [rows] of one layer's state in ``block`` (``cache``: [blocks, ...] of byte pages)."""
    import torch

    page = cache[block].contiguous().view(torch.uint8).reshape(-1)
    return {part: digest_rows(rows) for part, rows in state_rows(page, layout).items()}


def n_groups_of(model_config) -> int | None:
    cfg = getattr(model_config, "hf_text_config", None) or getattr(model_config, "hf_config", None)
    for name in GROUP_ATTRS:
        v = getattr(cfg, name, None)
        if isinstance(v, int) and v > 0:
            return v
    return None
