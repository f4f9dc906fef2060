"""The KV digest check: D's received KV equals, byte for byte, what P's KV cache held for the same request, layer,
K or V, global KV head and token position; where it does not, what D holds instead.

The records are written inside the servers by ``harness/serve/inject/pd_kv_digest.py`` (one file per server rank
and request; its docstring gives the format). Each record holds one 64-bit digest per (layer, part, head, position):
the stored bytes of that vector as int64 words, dotted with fixed odd weights mod 2**64 — exact, no threshold, the
same on every device. An all-zero vector digests to 0. Everything here is pure over the records, except ``load``.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from harness.checks.check import Check

CHECK_NAME = "kv_digest_match"
UNAVAILABLE = "unavailable"  # a server rank's file saying why it could not digest (its vLLM's internals)
STATE_PARTS = ("conv-x", "conv-B", "conv-C", "ssm")  # a Mamba state's parts (serve/inject/pd_kv_state.py)


def row_word(part: str) -> str:
    """What one row of ``part`` is: a conv state's channel, else a head (K, V, the MLA latent, an SSM head)."""
    return "channel" if part in STATE_PARTS and part != "ssm" else "head"


MAX_EXPLAINED = 2000  # mismatches looked up among P's digests: enough to name a pattern, bounded on big models


@dataclass(frozen=True)
class DigestRecord:
    """One server rank's digests of one request: ``digest[layer, part, head, position]``."""

    side: str  # prefill | decode
    rank: int
    request_id: str  # P's request id on both sides (D's record names the request P served): the join key
    layers: tuple[str, ...]
    parts: tuple[str, ...]  # ("K", "V"), or ("L",) for an MLA latent
    heads: tuple[int, ...]  # global KV head index of each local head
    positions: np.ndarray  # int64 [P], absolute token positions
    digest: np.ndarray  # int64 [L, S, H, P]
    left_out: int = 0  # positions D computed itself (its prefix-cache hits), not compared
    block_size: int = 0  # the side's block size in tokens (to say an offset in blocks)
    seconds: float = 0.0  # the hook's time for this record inside the server's step
    skipped_layers: tuple[str, ...] = ()  # layers the hook does not digest (Mamba), by name
    window: int = 0  # a sliding-window group's window: only the positions it keeps are recorded
    num_tokens: int = 0  # the prompt's length: D's layer needs [left_out, num_tokens), each position received
    kind: str = "kv"  # "state": a Mamba layer's per-request state, one row per channel or head, at position 0


@dataclass(frozen=True)
class Key:
    request_id: str
    layer: str
    part: str
    head: int
    position: int

    def text(self) -> str:
        if self.part in STATE_PARTS:
            return f"request {self.request_id}, {self.layer} {self.part} state, {row_word(self.part)} {self.head}"
        return f"request {self.request_id}, {self.layer} {self.part}, head {self.head}, position {self.position}"


@dataclass
class DigestComparison:
    requests: int = 0
    layers: set[str] = field(default_factory=set)
    heads: set[int] = field(default_factory=set)
    compared: int = 0  # keys compared
    positions: int = 0  # (request, position) pairs compared
    state_rows: int = 0  # Mamba state rows (conv channels, SSM heads) compared, over layers and requests
    state_layers: set[str] = field(default_factory=set)
    left_out: int = 0
    differ: int = 0
    first: Key | None = None
    first_holds: str = ""
    holds: Counter[str] = field(default_factory=Counter)  # what D holds instead, by kind, over the looked-up keys
    by_layer: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # layer -> (count, first pos, last pos)
    unmatched_requests: list[str] = field(default_factory=list)  # D records with no P record to compare against
    differing_requests: list[str] = field(default_factory=list)  # P's ids of the requests whose KV differs
    seconds: dict[str, float] = field(default_factory=dict)  # the hook's time in the servers' steps, per side
    skipped_layers: set[str] = field(default_factory=set)
    missing_first: Key | None = None  # the first position a layer needs that D did not receive


def record_files(folder: Path) -> frozenset[Path]:
    """The record files under ``folder`` now (attach mode: what was there before a run is not the run's); a hidden
    one is a record still being written (the hook renames it when whole), or one a killed server left half written."""
    if not folder.is_dir():
        return frozenset()
    return frozenset(p for p in folder.rglob("*.npz") if not p.name.startswith("."))


def load(folder: Path, before: frozenset[Path] = frozenset()) -> tuple[list[DigestRecord], list[str]]:
    """Every record under ``folder`` (recursively) but those in ``before``, and every reason a rank gave for not
    digesting."""
    records: list[DigestRecord] = []
    unavailable: list[str] = []
    if not folder.is_dir():
        return records, unavailable
    for path in sorted(record_files(folder) - before):
        records.append(read_record(path))
    for path in sorted(folder.rglob(f"{UNAVAILABLE}*.txt")):
        unavailable.append(f"{path.parent.name}/{path.stem}: {path.read_text().strip()}")
    return records, unavailable


def read_record(path: Path) -> DigestRecord:
    with np.load(path, allow_pickle=False) as z:
        meta = json.loads(bytes(z["meta"]).decode())
        return DigestRecord(
            side=meta["side"],
            rank=int(meta["rank"]),
            request_id=str(meta["request_id"]),
            layers=tuple(meta["layers"]),
            parts=tuple(meta["parts"]),
            heads=tuple(int(h) for h in z["heads"]),
            positions=np.asarray(z["positions"], dtype=np.int64),
            digest=np.asarray(z["digest"], dtype=np.int64),
            left_out=int(meta.get("left_out", 0)),
            block_size=int(meta.get("block_size", 0)),
            seconds=float(meta.get("seconds", 0.0)),
            skipped_layers=tuple(sorted(meta.get("skipped_layers") or {})),
            window=int(meta.get("window", 0)),
            num_tokens=int(meta.get("num_tokens", 0)),
            kind=str(meta.get("kind", "kv")),
        )


class _PIndex:
    """P's digests by (request, layer, part, head): one vector over positions per replica rank (and which
    positions it holds), so that D's positions are looked up at once."""

    def __init__(self, records: Iterable[DigestRecord]):
        self.by_key: dict[tuple[str, str, str, int], list[tuple[np.ndarray, np.ndarray]]] = defaultdict(list)
        self.records = [r for r in records if r.side == "prefill"]
        self.block_size = next((r.block_size for r in self.records if r.block_size), 0)
        for r in self.records:
            size = int(r.positions.max()) + 1 if len(r.positions) else 0
            held = np.zeros(size, dtype=bool)
            held[r.positions] = True
            for li, layer in enumerate(r.layers):
                for si, part in enumerate(r.parts):
                    for hi, head in enumerate(r.heads):
                        vec = np.zeros(size, dtype=np.int64)
                        vec[r.positions] = r.digest[li, si, hi]
                        self.by_key[(r.request_id, layer, part, head)].append((vec, held))
        self.requests = {r.request_id for r in self.records}

    def matches(self, key: tuple[str, str, str, int], positions: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Which of D's ``values`` at ``positions`` equal P's (any replica holding that position)."""
        ok = np.zeros(len(values), dtype=bool)
        for vec, held in self.by_key.get(key, []):
            inside = positions < len(vec)
            at = np.where(inside, positions, 0)
            ok |= inside & held[at] & (vec[at] == values)
        return ok

    def where(self, values: set[int], cap: int = 64) -> dict[int, list[Key]]:
        """Places in P's records holding each of ``values`` (up to ``cap`` each: equal prompt prefixes give equal
        KV, so a value may sit in several requests)."""
        found: dict[int, list[Key]] = defaultdict(list)
        if not values:
            return found
        wanted = np.fromiter(values, dtype=np.int64)
        for r in self.records:
            hit = np.isin(r.digest, wanted)
            for li, si, hi, pi in zip(*np.nonzero(hit), strict=True):
                places = found[int(r.digest[li, si, hi, pi])]
                if len(places) < cap:
                    places.append(Key(r.request_id, r.layers[li], r.parts[si], r.heads[hi], int(r.positions[pi])))
        return found


def nearest(expected: Key, places: Sequence[Key]) -> Key | None:
    """The place most like ``expected``: the same request first, then layer, part, head, nearest position."""
    return min(
        places,
        key=lambda k: (
            k.request_id != expected.request_id,
            k.layer != expected.layer,
            k.part != expected.part,
            k.head != expected.head,
            abs(k.position - expected.position),
        ),
        default=None,
    )


def explain(expected: Key, value: int, found: Key | None, block_size: int) -> tuple[str, str]:
    """What D holds instead of ``expected``: (kind, words)."""
    if value == 0:
        return "zeros", "all zeros (a block never written, or zeroed)"
    if found is None:
        return "nothing P had", "bytes P never had (not any P position, head, layer or request)"
    if found.request_id != expected.request_id:
        return (
            "another request",
            f"request {found.request_id}'s {found.layer} {found.part} head {found.head} position {found.position}",
        )
    if found.layer != expected.layer:
        return "another layer", f"P's {found.layer} {found.part} head {found.head} position {found.position}"
    off = found.position - expected.position
    shift = f" ({off:+d} tokens)" if off else ""
    if found.part != expected.part:
        if {found.part, expected.part} == {"K", "V"}:
            return "K/V swapped", f"P's {found.part} of head {found.head} position {found.position}{shift}"
        return "another part", f"P's {found.part} {row_word(found.part)} {found.head}"
    if found.head != expected.head:
        where = "" if found.position == expected.position else f" position {found.position}"
        if expected.part in STATE_PARTS:
            row = row_word(expected.part)
            return f"another {row}", f"P's {found.part} {row} {found.head}"
        return "another head", f"P's head {found.head}{where}"
    blocks = f" = {off // block_size:+d} blocks" if block_size and off % block_size == 0 else ""
    return "another position", f"P's position {found.position} ({off:+d} tokens{blocks})"


def compare(records: Sequence[DigestRecord]) -> DigestComparison:
    """Every D record against P's records of the same request (any P replica of a head matches)."""
    index = _PIndex(records)
    out = DigestComparison()
    wrong: list[tuple[Key, int]] = []
    layer_pos: dict[str, list[int]] = defaultdict(list)
    seen: dict[str, set[int]] = defaultdict(set)  # positions compared per request, over D's ranks
    left: dict[str, int] = {}
    differing: set[str] = set()
    for r in (r for r in records if r.side == "decode"):
        if r.request_id not in index.requests:
            out.unmatched_requests.append(r.request_id)
            continue
        if r.kind == "state":
            out.state_layers.update(r.layers)
            out.state_rows += r.digest.size
            seen.setdefault(r.request_id, set())
        else:
            seen[r.request_id].update(int(p) for p in r.positions)
            out.layers.update(r.layers)
            out.heads.update(r.heads)
        # a sliding-window group's left out is the part before its window, not D's own compute (a state has none)
        if not r.window and r.kind != "state":
            left[r.request_id] = max(left.get(r.request_id, 0), r.left_out)
        _missing(r, out, layer_pos, differing)
        for li, layer in enumerate(r.layers):
            for si, part in enumerate(r.parts):
                for hi, head in enumerate(r.heads):
                    values = r.digest[li, si, hi]
                    ok = index.matches((r.request_id, layer, part, head), r.positions, values)
                    out.compared += len(values)
                    bad = np.nonzero(~ok)[0]
                    out.differ += len(bad)
                    if len(bad):
                        differing.add(r.request_id)
                    layer_pos[layer] += [int(r.positions[i]) for i in bad]
                    for i in bad[: max(0, MAX_EXPLAINED - len(wrong))]:
                        wrong.append((Key(r.request_id, layer, part, head, int(r.positions[i])), int(values[i])))
    for r in records:
        out.seconds[r.side] = out.seconds.get(r.side, 0.0) + r.seconds
        out.skipped_layers.update(r.skipped_layers)
    out.requests = len(seen)
    out.positions = sum(len(v) for v in seen.values())
    out.left_out = sum(left.values())
    out.differing_requests = sorted(differing)
    out.by_layer = {k: (len(v), min(v), max(v)) for k, v in layer_pos.items() if v}
    _explain_all(out, wrong, index)
    return out


NOT_RECEIVED = "not received"


def _missing(r: DigestRecord, out: DigestComparison, layer_pos: dict[str, list[int]], differing: set[str]) -> None:
    """Positions D's layer needs ([left_out, num_tokens): its prefix hit, or a sliding window's start) that no
    received block holds: D's block for them is the null block, so D attends over bytes P never sent."""
    if not r.num_tokens:
        return
    held = set(int(p) for p in r.positions)
    gone = [p for p in range(r.left_out, r.num_tokens) if p not in held]
    if not gone:
        return
    n = len(gone) * len(r.parts) * len(r.heads)
    for layer in r.layers:
        out.differ += n
        out.compared += n
        out.holds[NOT_RECEIVED] += n
        layer_pos[layer] += gone
        if out.missing_first is None:
            out.missing_first = Key(r.request_id, layer, r.parts[0], r.heads[0], gone[0])
    differing.add(r.request_id)


def _explain_all(out: DigestComparison, wrong: list[tuple[Key, int]], index: _PIndex) -> None:
    found = index.where({v for _, v in wrong if v != 0})
    for i, (key, v) in enumerate(wrong):
        kind, words = explain(key, v, nearest(key, found.get(v, ())), index.block_size)
        out.holds[kind] += 1
        if i == 0:
            out.first, out.first_holds = key, words
    if out.first is None and out.missing_first is not None:
        out.first = out.missing_first
        out.first_holds = "no received bytes: its block on D is the null block, which P never wrote"


def check(result: DigestComparison) -> Check:
    """Exact: every transferred key on every D rank equals P's."""
    counts = (
        f"{result.requests} requests, {len(result.layers)} layers, {len(result.heads)} heads, "
        f"{result.positions} positions compared ({result.compared} digests), {result.left_out} left out "
        f"(computed on D)"
    )
    data: dict = {
        "requests": result.requests,
        "layers": len(result.layers),
        "heads": sorted(result.heads),
        "positions": result.positions,
        "digests": result.compared,
        "left_out": result.left_out,
        "differ": result.differ,
        "hook_seconds": {k: round(v, 4) for k, v in sorted(result.seconds.items())},
    }
    if result.state_rows:
        data["state_layers"] = len(result.state_layers)
        data["state_rows"] = result.state_rows
        counts += (
            f"; {len(result.state_layers)} state layers: {result.state_rows} state rows compared "
            f"(conv channels, SSM heads)"
        )
    if result.skipped_layers:
        data["layers_not_digested"] = sorted(result.skipped_layers)
        counts += f"; {len(result.skipped_layers)} layers not digested"
    if result.unmatched_requests:
        data["unmatched_requests"] = result.unmatched_requests[:20]
    if result.requests == 0:
        why = "no request's KV was both digested on P and received on D"
        if result.unmatched_requests:
            why += f" ({len(result.unmatched_requests)} D records had no P record)"
        return Check(CHECK_NAME, False, why, data)
    if result.differ == 0 and not result.unmatched_requests:
        return Check(CHECK_NAME, True, counts, data)
    if result.differ == 0:
        return Check(
            CHECK_NAME,
            False,
            f"{len(result.unmatched_requests)} requests received on D have no record "
            f"on P (P's hook missed them); {counts}",
            data,
        )
    data["first"] = result.first.text() if result.first else None
    data["first_holds"] = result.first_holds
    data["holds"] = dict(result.holds)
    data["differing_requests"] = result.differing_requests
    data["by_layer"] = {k: {"differ": n, "positions": [a, b]} for k, (n, a, b) in result.by_layer.items()}
    layers = "; ".join(
        f"{k}: {n} state rows" if k in result.state_layers else f"{k}: {n} at positions {a}-{b}"
        for k, (n, a, b) in sorted(result.by_layer.items())
    )
    holds = ", ".join(f"{k} {n}" for k, n in result.holds.most_common())
    assert result.first is not None
    detail = (
        f"{result.differ} of {result.compared} digests differ; first: {result.first.text()}: D holds "
        f"{result.first_holds}; D holds instead (of {sum(result.holds.values())} looked up): {holds}; "
        f"by layer: {layers}"
    )
    return Check(CHECK_NAME, False, detail, data)


def location_line(c: Check) -> str | None:
    """The line a maintainer needs first, for the report's banner: where D first differs and what it holds."""
    return location_from_report(c.to_dict())


def location_from_report(c: dict) -> str | None:
    """``location_line`` of a check as report.json holds it."""
    data = c.get("data") or {}
    if c.get("name") != CHECK_NAME or c.get("passed") or not data.get("first"):
        return None
    return f"KV digest: {data['first']}: D holds {data['first_holds']}"


def location_in(checks: Iterable[dict]) -> str | None:
    """The location line of a report's checks, if its digest check failed with one."""
    return next((line for c in checks if (line := location_from_report(c))), None)
