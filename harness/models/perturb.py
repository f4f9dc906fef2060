"""A seeded, perturbed copy of one decoder layer: how the harness gives a drafter (an EAGLE head, an MTP layer) a layer
of its own, with its own KV, from a tiny target's first layer (nothing is trained or fetched here)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

NOISE = 0.02  # small against the tiny models' initialisation, so the drafter still resembles the target's layer


def perturbed_layer(
    weights: Mapping[str, torch.Tensor], source: str, target: str, gen: torch.Generator, skip: tuple[str, ...] = ()
) -> dict[str, torch.Tensor]:
    """Each tensor under the prefix ``source`` (names containing any of ``skip`` left out), renamed under ``target``
    with seeded noise added, in the checkpoint's order: the same seed gives the same bytes."""
    import torch

    out = {}
    for name, tensor in weights.items():
        if name.startswith(source) and not any(s in name for s in skip):
            noise = torch.randn(tensor.shape, generator=gen) * NOISE
            out[target + name.removeprefix(source)] = (tensor + noise).contiguous()
    return out
