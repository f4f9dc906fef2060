"""The caller's CUDA_VISIBLE_DEVICES mapped onto NVML's GPUs (pure).

NVML lists every GPU of the host, numbered in PCI bus order, whatever CUDA_VISIBLE_DEVICES says;
CUDA shows a process only the GPUs its CUDA_VISIBLE_DEVICES names, in that order. So a run under
Slurm or on a shared box (CUDA_VISIBLE_DEVICES=4,5,6,7) must plan on NVML's GPUs 4-7 only.

A child process does not inherit its parent's numbering: its own CUDA_VISIBLE_DEVICES replaces the
parent's and is read against the host's GPUs again. The servers therefore get the physical NVML
indices of the caller's GPUs (never 0..n-1 relative ones) with CUDA_DEVICE_ORDER=PCI_BUS_ID, so that
CUDA counts in NVML's order. Not UUIDs: vLLM's platform code calls int() on every entry of
CUDA_VISIBLE_DEVICES to find the NVML device (vllm-project/vllm#13815, #32569), so a caller's UUIDs
are resolved here to NVML indices.

Entries are read as CUDA reads them: an index, or ``GPU-`` and a unique prefix of a GPU's UUID;
empty means no GPU. Where CUDA would silently drop an entry (an index past the last GPU, an unknown
or repeated one: CUDA hides it and everything after it) the harness refuses instead, naming it.
A caller's numeric ids mean PCI bus order only with CUDA_DEVICE_ORDER=PCI_BUS_ID, or when every GPU
is the same model (CUDA's default FASTEST_FIRST order then falls back to PCI bus order); on a host of
mixed models without it they are ambiguous and refused.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

VISIBLE_ENV = "CUDA_VISIBLE_DEVICES"
ORDER_ENV = "CUDA_DEVICE_ORDER"
PCI_BUS_ID = "PCI_BUS_ID"


@dataclass(frozen=True)
class Visible:
    indices: tuple[int, ...]  # NVML indices of the GPUs the caller sees, in the caller's order
    problem: str | None = None  # why the caller's list cannot be taken as it is (one line)


def resolve_visible(
    raw: str | None, uuids: Sequence[str], names: Sequence[str] = (), order: str | None = None
) -> Visible:
    """``raw``: the caller's CUDA_VISIBLE_DEVICES (None: unset); ``uuids``/``names``: NVML's, by NVML index."""
    n = len(uuids)
    if raw is None:
        return Visible(tuple(range(n)))
    if not raw.strip():
        return Visible(())  # CUDA: set but empty hides every GPU
    out: list[int] = []
    for entry in (e.strip() for e in raw.split(",")):
        index, why = _entry(entry, uuids)
        if why is None and index in out:
            why = "repeats an earlier entry"
        if why is not None:
            return Visible(
                tuple(out),
                f"{VISIBLE_ENV}={raw!r}: {entry!r} {why} (CUDA would hide it and every entry "
                "after it); fix it or unset it",
            )
        out.append(index)  # type: ignore[arg-type]
    numeric = any(e.strip().isdigit() for e in raw.split(","))
    if numeric and len(set(names)) > 1 and (order or "").strip() != PCI_BUS_ID:
        models = ", ".join(sorted(set(names)))
        return Visible(
            tuple(out),
            f"{VISIBLE_ENV}={raw!r} gives indices on a host of different GPU models ({models}) "
            f"without {ORDER_ENV}={PCI_BUS_ID}: CUDA may number them otherwise than NVML; "
            f"set {ORDER_ENV}={PCI_BUS_ID} or give GPU UUIDs",
        )
    return Visible(tuple(out))


def _entry(entry: str, uuids: Sequence[str]) -> tuple[int | None, str | None]:
    """(NVML index, None) or (None, why this entry names no GPU)."""
    n = len(uuids)
    if entry.isdigit():
        i = int(entry)
        if i < n:
            return i, None
        return None, f"names no GPU (NVML lists {n}, indices 0-{n - 1})" if n else "names no GPU (NVML lists none)"
    if entry.upper().startswith("GPU-"):
        hits = [i for i, u in enumerate(uuids) if u.lower().startswith(entry.lower())]
        if len(hits) == 1:
            return hits[0], None
        return None, "matches no GPU UUID" if not hits else f"matches {len(hits)} GPU UUIDs"
    if entry.upper().startswith("MIG-"):
        return None, "is a MIG instance: the GPU plan places whole GPUs"
    return None, "is neither a GPU index nor a GPU UUID"
