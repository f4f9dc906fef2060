"""KV digest inside a vLLM P/D server: what P's KV cache held for a request's prompt, and what D's holds right after
NIXL delivered it, as one 64-bit digest per (layer, K or V, global KV head, token position).

Armed by this folder's sitecustomize.py (the harness puts the folder on PYTHONPATH) when PD_HARNESS_KV_DIGEST names
a folder; PD_HARNESS_KV_DIGEST_SIDE says which side this server is (prefill | decode). Nothing of vLLM is changed:
- on P, GPUModelRunner.execute_model is wrapped; after the step whose forward completed a request's prompt (before
  sample_tokens, hence before request_finished hands D the block ids), positions [0, prompt) are digested;
- on D, NixlBaseConnectorWorker.get_transfer_results is wrapped (outside any fault patch, so a fault's change is
  seen); after it returns (post-processing done, first decode step not yet run), the received positions
  [prefix-cache hit, P's num_tokens) of each finished receive are digested.

Digest of a vector: its stored bytes as int64 words (zero-padded to 8 bytes), dotted with fixed odd random weights,
mod 2**64 (torch's int64 wraps). Exact and order-independent; a change of one word always changes it; all zeros give
0. Per attention layer, the cache is [blocks, local heads, block_size, C]: CPU_ATTN pages hold the K of the block's
tokens, then their V (C = 2*head_size seen as 2*block_size rows); other backends hold [K | V] per token. A local head
h of rank r is global head (r*K)//tp + h (vLLM's QKVParallelLinear). MLA: one latent part "L", the whole row.

Record: ``<folder>/rank<r>/<n>-<pid>-<request>.npz`` with ``digest`` int64 [layers, parts, heads, positions],
``positions`` int64, ``heads`` int64 (global), ``meta`` (UTF-8 JSON bytes: side, rank, tp, request_id — P's id on
both sides —, layers, parts, block_size, left_out, skipped layers). A rank that cannot digest writes
``<folder>/unavailable-rank<r>.txt`` with why, once. harness/checks/kv_digest.py reads both.
"""

from __future__ import annotations

import json
import os
import re
import sys
import threading
from typing import Any

FOLDER = os.environ.get("PD_HARNESS_KV_DIGEST")
SIDE = os.environ.get("PD_HARNESS_KV_DIGEST_SIDE", "")
SEED = 0x5EED_D16E57
_WEIGHTS: dict[str, Any] = {}
_STATE: dict[str, Any] = {}  # this process's connector worker (one per worker process)
_LOCK = threading.Lock()
_COUNT = [0]


def _load_state_module():
    """pd_kv_state.py, the file beside this one (the inject folder, or a repro bundle's hooks/), by path: this
    module is also loaded by path, outside any package."""
    import importlib.util

    name = "pd_kv_state"
    if name not in sys.modules:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "pd_kv_state.py")
        spec = importlib.util.spec_from_file_location(name, path)
        assert spec is not None and spec.loader is not None, path
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


state = _load_state_module()


def log(msg: str) -> None:
    print(f"[pd-harness digest] {msg}", file=sys.stderr, flush=True)


def weights(n: int, device):
    """``n`` fixed odd int64 weights, the same in every process (numpy's seeded generator)."""
    import numpy as np
    import torch

    key = f"{n}:{device}"
    if key not in _WEIGHTS:
        w = np.random.default_rng(SEED).integers(-(2**63), 2**63 - 1, n, dtype=np.int64) | 1
        _WEIGHTS[key] = torch.from_numpy(w).to(device)
    return _WEIGHTS[key]


def digest_rows(x):
    """int64 digest of each row (last dim) of ``x``, over its stored bytes."""
    import torch

    x = x.contiguous()
    shape = x.shape[:-1]
    b = x.view(torch.uint8).reshape(*shape, -1)
    pad = (-b.shape[-1]) % 8
    if pad:
        b = torch.nn.functional.pad(b, (0, pad))
    words = b.contiguous().view(torch.int64)
    w = weights(words.shape[-1], words.device)
    if words.device.type == "cpu":
        return words.matmul(w)
    return (words * w).sum(-1)  # no int64 matmul on CUDA; the sum wraps the same way


def split_parts(pages, cpu_attn: bool, mla: bool):
    """[B, H, N, C] cache pages -> [S, H, B*N, row] (S parts: K and V, or the MLA latent)."""
    b, h, n, c = pages.shape
    if mla:
        parts = pages.unsqueeze(0)
    elif cpu_attn:
        parts = pages.reshape(b, h, 2, n, c // 2).permute(2, 0, 1, 3, 4)  # [K rows of N tokens ; V rows]
    else:
        parts = pages.reshape(b, h, n, 2, c // 2).permute(3, 0, 1, 2, 4)  # [K | V] per token
    s = parts.shape[0]
    row = parts.shape[-1]
    return parts.permute(0, 2, 1, 3, 4).reshape(s, h, b * n, row)


def digest_layer(cache, blocks: list[int], offsets, cpu_attn: bool, mla: bool):
    """[S, H, len(offsets)] digests of the tokens at ``offsets`` (indexes into the blocks' concatenated tokens)."""
    import torch

    idx = torch.tensor(blocks, dtype=torch.long, device=cache.device)
    pages = cache.index_select(0, idx)
    rows = split_parts(pages, cpu_attn, mla)
    rows = rows.index_select(2, torch.as_tensor(offsets, dtype=torch.long, device=cache.device))
    return digest_rows(rows)


def global_heads(rank: int, tp: int, total: int, local: int, mla: bool) -> list[int]:
    if mla:
        return [0]
    return [(rank * total) // tp + h for h in range(local)]


def _unavailable(rank: int, why: str) -> None:
    if _STATE.get(f"unavailable-{rank}"):
        return
    _STATE[f"unavailable-{rank}"] = True
    log(f"unavailable: {why}")
    try:
        os.makedirs(FOLDER or ".", exist_ok=True)
        with open(os.path.join(FOLDER or ".", f"unavailable-rank{rank}.txt"), "w") as f:
            f.write(why + "\n")
    except OSError as e:
        log(f"could not write why: {e}")


def unknown(why: str) -> None:
    """This vLLM's internals are not what the hook knows: say why once; the check is then skipped with it."""
    _unavailable(0, why)


def _spec(worker, group: int):
    try:
        return worker.kv_cache_config.transfer_groups[group].kv_cache_spec
    except Exception:  # noqa: BLE001 - older layouts: treat as full attention
        return None


def window_of(worker, group: int) -> int:
    """The group's sliding window in tokens (0: full attention)."""
    spec = _spec(worker, group)
    return int(getattr(spec, "sliding_window", 0) or 0) if "SlidingWindow" in type(spec).__name__ else 0


def layer_spec(worker, name: str, group: int):
    """A layer's own KV cache spec (the connector keeps one per layer), else its transfer group's."""
    spec = (getattr(worker, "_layer_specs", None) or {}).get(name)
    return spec if spec is not None else _spec(worker, group)


def plan_layers(worker) -> tuple[dict[int, list[str]], dict[str, str], dict[int, list[str]]]:
    """The attention layers to digest by transfer group (one record per group: its layers share positions), the
    layers left out with why, and the state (Mamba) layers by transfer group (pd_kv_state.py)."""
    caches = _STATE.get("caches") or {}
    by_layer = getattr(worker.kv_cache_config, "transfer_group_index_by_layer", {})
    groups: dict[int, list[str]] = {}
    states: dict[int, list[str]] = {}
    skipped: dict[str, str] = {}
    for name in sorted(caches, key=lambda s: [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]):
        cache = caches[name]
        group = by_layer.get(name, 0)
        kind = type(layer_spec(worker, name, group)).__name__
        if not hasattr(cache, "dim") or cache.dim() != 4:
            skipped[name] = f"cache is not [blocks, heads, tokens, row] ({type(cache).__name__})"
        elif "Mamba" in kind:
            states.setdefault(group, []).append(name)
        elif "ChunkedLocal" in kind:
            skipped[name] = f"{kind} layers are not digested yet"
        else:
            groups.setdefault(group, []).append(name)
    return groups, skipped, states


def _read_plan(blocks: list[int], first_block: int, bs: int, start: int, n_tokens: int):
    """(blocks to read, offsets into their tokens, positions) for positions [start, n_tokens) of ``blocks``, block k
    holding block number ``first_block + k`` of the prompt; the null block (id 0) is never read."""
    import numpy as np

    keep = [(first_block + k, b) for k, b in enumerate(blocks) if b != 0]
    keep = [(j, b) for j, b in keep if (j + 1) * bs > start and j * bs < n_tokens]
    offsets, positions = [np.zeros(0, dtype=np.int64)], [np.zeros(0, dtype=np.int64)]
    for k, (j, _) in enumerate(keep):
        pos = np.arange(max(j * bs, start), min((j + 1) * bs, n_tokens), dtype=np.int64)
        offsets.append(k * bs + pos - j * bs)
        positions.append(pos)
    return [b for _, b in keep], np.concatenate(offsets), np.concatenate(positions)


def p_layout(blocks: list[int], n_tokens: int, bs: int, first: int = 0):
    """P: (blocks to read, offsets into their tokens, positions) for positions [first, n_tokens)."""
    return _read_plan(blocks, 0, bs, first, n_tokens)


def d_layout(blocks: list[int], n_tokens: int, bs: int, hit: int, window: int):
    """D: (blocks to read, offsets, positions, left out) of what a receive delivered. Full attention: block i holds
    hit + i*bs + t. Sliding window: the blocks are the tail of the prompt's, and only the positions the window of
    D's first step still needs ([n_tokens - window, n_tokens)) are compared; the others are counted as left out."""
    import numpy as np

    if not window:
        pos = np.arange(hit, min(n_tokens, hit + len(blocks) * bs), dtype=np.int64)
        return list(blocks), pos - hit, pos, hit
    start = max(hit, n_tokens - window)
    return (*_read_plan(blocks, -(-n_tokens // bs) - len(blocks), bs, start, n_tokens), start)


def write_record(rank: int, request_id: str, layers, parts, heads, positions, digests, meta: dict) -> None:
    import numpy as np

    folder = os.path.join(FOLDER or ".", f"rank{rank}")
    os.makedirs(folder, exist_ok=True)
    with _LOCK:
        _COUNT[0] += 1
        n = _COUNT[0]
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", request_id)[:120]
    body = {**meta, "side": SIDE, "rank": rank, "request_id": request_id, "layers": list(layers), "parts": parts}
    # the pid in the name: D at data parallel runs an engine per DP rank, each with a TP rank 0 writing here
    tmp = os.path.join(folder, f".{os.getpid()}-{n}.tmp.npz")
    np.savez(
        tmp,
        digest=np.asarray(digests, dtype=np.int64),
        positions=np.asarray(positions, dtype=np.int64),
        heads=np.asarray(heads, dtype=np.int64),
        meta=np.frombuffer(json.dumps(body).encode(), dtype=np.uint8),
    )
    os.replace(tmp, os.path.join(folder, f"{n:06d}-{os.getpid()}-{safe}.npz"))  # pipeline stages share a rank


def digest_request(worker, request_id: str, block_ids, layout, meta: dict) -> None:
    """Digest one request on this rank, one record per transfer group (and per state part). ``block_ids[g]``:
    kernel block ids of transfer group g; ``layout(group, blocks, window)`` -> (blocks to read, offsets into their
    tokens, positions, left out)."""
    import time

    import torch

    groups, skipped, states = plan_layers(worker)
    state_plans = plan_states(worker, states, skipped)
    if not groups and not state_plans:
        _unavailable(worker.tp_rank, f"no layer this hook can digest: {skipped}")
        return
    mla = bool(getattr(worker, "use_mla", False))
    cpu_attn = str(getattr(worker, "backend_name", "")).upper().startswith("CPU")
    tp = int(worker.world_size)
    total = 1 if mla else int(worker.model_config.get_total_num_kv_heads())
    base = {**meta, "tp": tp, "skipped_layers": skipped, "backend": str(getattr(worker, "backend_name", ""))}
    for group, names in sorted(groups.items()):
        t0 = time.perf_counter()
        window = window_of(worker, group)
        blocks = list(block_ids[group]) if group < len(block_ids) else []
        read, offsets, positions, left_out = layout(group, blocks, window)
        if not read or not len(offsets):
            continue
        tensors = [digest_layer(_STATE["caches"][n], read, offsets, cpu_attn, mla).cpu() for n in names]
        heads = global_heads(worker.tp_rank, tp, total, tensors[0].shape[1], mla)
        body = {**base, "group": group, "window": window, "left_out": int(left_out)}
        body["seconds"] = time.perf_counter() - t0  # the hook's own time in the server's step (docs/kv-digest.md)
        parts = ["L"] if mla else ["K", "V"]
        write_record(worker.tp_rank, request_id, names, parts, heads, positions, torch.stack(tensors).numpy(), body)
    for group, (names, plan, spec_blocks) in sorted(state_plans.items()):
        blocks = list(block_ids[group]) if group < len(block_ids) else []
        digest_states(worker.tp_rank, request_id, names, plan, state.state_block(blocks, spec_blocks), base, group)


def plan_states(worker, states: dict[int, list[str]], skipped: dict[str, str]) -> dict:
    """group -> (layers, StateLayout, speculative scratch blocks) of the state layers this hook can digest; the
    others go into ``skipped`` with why."""
    plans = {}
    for group, names in states.items():
        spec = layer_spec(worker, names[0], group)
        plan = state.plan_state(
            spec, worker.tp_rank, int(worker.world_size), state.n_groups_of(worker.model_config), conv_dim_first()
        )
        if isinstance(plan, str):
            skipped.update((n, plan) for n in names)
        else:
            plans[group] = (names, plan, int(getattr(spec, "num_speculative_blocks", 0) or 0))
    return plans


def conv_dim_first() -> bool:
    """vLLM's conv state layout: DS (channel-major) unless it says otherwise (NIXL's Mamba transfer requires DS)."""
    try:
        from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    except ImportError:
        return True
    return bool(is_conv_state_dim_first())


def digest_states(rank: int, request_id: str, names, plan, block, base: dict, group: int) -> None:
    """One record per state part: digest [layers, 1, rows, 1] of the request's state ``block`` of each layer."""
    import time

    import numpy as np

    if block is None:
        return
    t0 = time.perf_counter()
    per_layer = [state.digest_state(_STATE["caches"][n], block, plan, digest_rows) for n in names]
    seconds = (time.perf_counter() - t0) / len(plan.parts)
    for part in plan.parts:
        digests = np.stack([d[part].cpu().numpy() for d in per_layer])[:, None, :, None]
        body = {**base, "group": group, "kind": "state", "num_tokens": 0, "left_out": 0, "seconds": seconds}
        write_record(rank, request_id, names, [part], plan.globals_[part], [state.STATE_POSITION], digests, body)


def completed_prompts(runner, scheduler_output) -> list[tuple]:
    """P: what to digest of each request whose prompt this step's forward completed, read from the runner's state now
    (it moves on with the next step): (request id, kernel block ids, layout, meta)."""
    worker = _STATE.get("worker")
    if worker is None:
        return []
    done: set[str] = _STATE.setdefault("p_done", set())
    for rid in getattr(scheduler_output, "finished_req_ids", ()) or ():
        done.discard(rid)
    out = []
    for rid, n in dict(scheduler_output.num_scheduled_tokens).items():
        state = runner.requests.get(rid)
        if state is None or rid in done or state.num_computed_tokens + n < state.num_prompt_tokens:
            continue
        done.add(rid)
        prompt = int(state.num_prompt_tokens)
        cfg = worker.kv_cache_config
        ids = cfg.select_transfer_block_ids(state.block_ids) if hasattr(cfg, "select_transfer_block_ids") else None
        ids = worker._logical_to_kernel_block_ids(ids or state.block_ids, worker._physical_blocks_per_logical_kv_block)
        bs = int(worker.block_size)

        def layout(group: int, blocks: list[int], window: int, prompt: int = prompt, bs: int = bs):
            # a sliding-window layer: only what the window of D's first step needs (earlier blocks may be freed)
            read, offsets, positions = p_layout(blocks, prompt, bs, max(0, prompt - window) if window else 0)
            return read, offsets, positions, 0

        out.append((rid, ids, layout, {"block_size": bs, "num_tokens": prompt}))
    return out


def digest_pending(pending: list[tuple]) -> None:
    worker = _STATE.get("worker")
    for rid, ids, layout, meta in pending:
        digest_request(worker, rid, ids, layout, meta)


def after_receive(worker, metas: dict, finished) -> None:
    """D: digest what each finished receive delivered, positions [hit, P's num_tokens)."""
    bs = int(worker.block_size)
    logical = bs * int(getattr(worker, "_physical_blocks_per_logical_kv_block", 1))
    for rid in sorted(finished):
        meta = metas.get(rid)
        if meta is None or meta.remote is None:
            continue
        total = meta.remote.num_tokens
        if total is None:
            _unavailable(worker.tp_rank, "this vLLM's receive metadata has no num_tokens (P's prompt length)")
            return
        hits = tuple(getattr(meta, "local_num_computed_blocks", ()) or ())

        def layout(group: int, blocks: list[int], window: int, total: int = int(total), hits: tuple = hits):
            hit = (hits[group] if group < len(hits) else 0) * logical
            return d_layout(blocks, total, bs, hit, window)

        ids = getattr(meta, "local_physical_block_ids", None) or meta.local_block_ids
        digest_request(
            worker,
            str(meta.remote.request_id),
            ids,
            layout,
            {"block_size": bs, "num_tokens": int(total), "d_request_id": rid},
        )


def _guarded(what: str, fn, *args) -> None:
    """A digest that fails must not take the server down: the rank says why and the check is skipped."""
    try:
        fn(*args)
    except Exception as e:  # noqa: BLE001
        worker = _STATE.get("worker")
        _unavailable(getattr(worker, "tp_rank", 0), f"{what} failed: {type(e).__name__}: {e}")


def patch_worker(cls) -> None:
    """Keep the caches at registration (P and D); on D, digest after each get_transfer_results."""
    register = cls.register_kv_caches

    def register_kv_caches(self, kv_caches):
        _STATE["worker"], _STATE["caches"] = self, kv_caches
        return register(self, kv_caches)

    cls.register_kv_caches = register_kv_caches
    if SIDE != "decode":
        return
    if not hasattr(cls, "get_transfer_results"):
        _patch_get_finished(cls)
        return
    results = cls.get_transfer_results

    def get_transfer_results(self):
        metas = dict(getattr(self, "_recving_metadata", {}))  # popped by the call below
        out = results(self)
        failed = set(getattr(out, "failed_recving", ()) or ())
        finished = set(out.finished_recving) - failed
        if finished:
            _guarded("digesting D's received KV", after_receive, self, metas, finished)
        return out

    cls.get_transfer_results = get_transfer_results


def _patch_get_finished(cls) -> None:
    """Older releases (0.26) report finished receives from get_finished() -> (sending, receiving)."""
    if not hasattr(cls, "get_finished"):
        _unavailable(0, f"{cls.__name__} reports no finished receives this hook knows: D cannot be digested")
        return
    finished_fn = cls.get_finished

    def get_finished(self):
        metas = dict(getattr(self, "_recving_metadata", {}))
        sending, recving = finished_fn(self)
        if recving:
            _guarded("digesting D's received KV", after_receive, self, metas, set(recving))
        return sending, recving

    cls.get_finished = get_finished


def patch_runner(cls) -> None:
    """P: digest once the step that completed a prompt has run whole: its forward and the connector's save
    (execute_model) and, where vLLM samples apart, its sampling and the drafter's forward (sample_tokens): speculative
    decoding writes the drafter's layers' KV there, after execute_model has returned."""
    if SIDE != "prefill":  # D computes its own prompt positions too: never digested (not what P sent)
        return
    execute = cls.execute_model
    sample = getattr(cls, "sample_tokens", None)

    def execute_model(self, scheduler_output, *args, **kwargs):
        out = execute(self, scheduler_output, *args, **kwargs)
        pending: list[tuple] = []
        _guarded("finding P's completed prompts", lambda: pending.extend(completed_prompts(self, scheduler_output)))
        if out is None and sample is not None:  # vLLM calls sample_tokens next: digest after it
            self._pd_digest_pending = pending
        else:
            _guarded("digesting P's prompt KV", digest_pending, pending)
        return out

    cls.execute_model = execute_model
    if sample is None:
        return

    def sample_tokens(self, *args, **kwargs):
        out = sample(self, *args, **kwargs)
        pending, self._pd_digest_pending = getattr(self, "_pd_digest_pending", None), None
        if pending:
            _guarded("digesting P's prompt KV", digest_pending, pending)
        return out

    cls.sample_tokens = sample_tokens
