"""Fault injection inside a vLLM decode server, for tests that must see the harness catch wrong KV.

Armed by this folder's sitecustomize.py when PD_HARNESS_FAULT_KV_SCALE or PD_HARNESS_FAULT_SWAP_HEADS=1 is set.
Each time a NIXL receive completes, before the request's first decode step reads the blocks:
- scale: the received blocks of the first attention layer are multiplied by the factor (keys and values). A small
  factor moves logprobs without flipping greedy tokens, the damage a wrong head offset can do quietly;
- swap: the first two local KV heads of every layer are swapped in the received blocks (a wrong head slice).
Each perturbation is logged, so a test can see it fired: "[pd-harness fault] scaled the received KV of layer L by
F: N blocks of request R" / "[pd-harness fault] swapped local KV heads 0 and 1 ...".
"""

import os
import sys

SCALE = os.environ.get("PD_HARNESS_FAULT_KV_SCALE")
_SWAP = os.environ.get("PD_HARNESS_FAULT_SWAP_HEADS") == "1"
ARMED = SCALE is not None or _SWAP


def _log(msg):
    print(f"[pd-harness fault] {msg}", file=sys.stderr, flush=True)


def unknown(why: str) -> None:
    _log(f"{why}; nothing changed")


def _block_dim(shape, num_blocks):
    # KV cache layouts put the block index before the in-block token index: (2, N, ...) or (N, 2, ...).
    return next((i for i, n in enumerate(shape) if n == num_blocks), None)


def _received_blocks(meta):
    # kernel block ids: where vLLM splits a logical block into smaller kernel blocks, the logical ids index wrong
    ids = getattr(meta, "local_physical_block_ids", None) or meta.local_block_ids
    return list(ids[0])


def _swap_heads(worker, metas, received):
    """Swap the first two local KV heads of every layer in the received blocks: a wrong head slice, as a wrong
    offset under GQA replication would give. Needs a cache [blocks, heads, ...] with at least two local heads."""
    caches = getattr(worker, "_pd_fault_caches", None) or {}
    for req_id in sorted(received):
        meta = metas.get(req_id)
        if meta is None or not caches:
            continue
        blocks = _received_blocks(meta)
        first = caches[sorted(caches)[0]]
        if first.dim() != 4 or first.shape[1] < 2 or not blocks:
            _log(f"could not swap heads of request {req_id}: cache {tuple(first.shape)}; nothing changed")
            continue
        for tensor in caches.values():
            for b in blocks:
                page = tensor[b]
                h0 = page[0].clone()
                page[0].copy_(page[1])
                page[1].copy_(h0)
        _log(f"swapped local KV heads 0 and 1 in every layer: {len(blocks)} blocks of request {req_id}")


def _perturb(worker, metas, received, scale):
    if _SWAP:
        _swap_heads(worker, metas, received)
    if scale is None:
        return
    caches = getattr(worker, "_pd_fault_caches", None)
    for req_id in sorted(received):
        meta = metas.get(req_id)
        if meta is None or not caches:
            continue
        blocks = _received_blocks(meta)
        layer = sorted(caches)[0]
        tensor = caches[layer]
        dim = _block_dim(tuple(tensor.shape), getattr(worker, "num_blocks", None))
        if dim is None or not blocks:
            _log(f"could not place the blocks of request {req_id} in {layer} {tuple(tensor.shape)}; nothing changed")
            continue
        for b in blocks:
            tensor.select(dim, b).mul_(scale)
        _log(f"scaled the received KV of layer {layer} by {scale}: {len(blocks)} blocks of request {req_id}")


def patch_worker(cls) -> None:
    """Arm the fault on the NIXL worker class (a fault that cannot arm says so: the run's check sees it never fired)."""
    try:
        _patch_worker(cls, float(SCALE) if SCALE is not None else None)
    except Exception as e:  # noqa: BLE001 - a fault that cannot arm must not take the server down
        _log(f"could not arm on this vLLM ({type(e).__name__}: {e}); nothing changed")


def _patch_worker(cls, scale):
    """Wrap the worker's KV registration (to keep the caches) and its report of finished receives: vLLM 0.32
    reports them in get_transfer_results(), older releases (0.26) in get_finished() -> (sending, receiving)."""
    register = cls.register_kv_caches

    def register_kv_caches(self, kv_caches):
        self._pd_fault_caches = kv_caches
        return register(self, kv_caches)

    if hasattr(cls, "get_transfer_results"):
        results = cls.get_transfer_results

        def get_transfer_results(self):
            metas = dict(getattr(self, "_recving_metadata", {}))  # popped by the call below
            out = results(self)
            _perturb(self, metas, set(out.finished_recving) - set(getattr(out, "failed_recving", ()) or ()), scale)
            return out

        cls.get_transfer_results = get_transfer_results
    elif hasattr(cls, "get_finished"):
        finished = cls.get_finished

        def get_finished(self):
            metas = dict(getattr(self, "_recving_metadata", {}))
            sending, recving = finished(self)
            _perturb(self, metas, set(recving), scale)
            return sending, recving

        cls.get_finished = get_finished
    else:
        _log(f"{cls.__name__} reports no finished receives this fault knows; nothing changed")
        return
    cls.register_kv_caches = register_kv_caches
    if scale is not None:
        _log(f"armed: received KV of the first layer will be scaled by {scale}")
    if _SWAP:
        _log("armed: the first two local KV heads of received blocks will be swapped")
