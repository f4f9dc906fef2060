"""Which UCX transport carried the KV, read from the protocol tables UCX prints with UCX_PROTO_INFO=y.

D reads P's KV blocks (NIXL READ, UCX ``ucp_get``). Each table names its endpoint's scope (``self``, ``intra-node``,
``inter-node``), the operation, and per message size the transport/device that carries it. Between hosts, KV must go
over the network: a same-host shortcut (CMA, shared memory) there means the test did not test what it says."""

from __future__ import annotations

import re
from dataclasses import dataclass

from harness.checks.check import Check

CHECK_NAME = "kv_over_network"
PROTO_INFO_ENV = {"UCX_PROTO_INFO": "y"}  # UCX prints each endpoint's protocol choice once, into the server's log
# UCX transports that work only between processes of one machine
SAME_HOST_TRANSPORTS = frozenset({"cma", "knem", "xpmem", "posix", "sysv"})
KV_OPERATIONS = ("remote memory read", "remote memory write")  # NIXL READ/WRITE of KV blocks

_PREFIX = re.compile(r"^\[[\d.]+\]\s+\[([^\]]+)\]\s+(.*)$")  # [time] [host:pid:thread] rest
_HEADER = re.compile(r"^\|\s*\S+\s+(self|intra-node|inter-node)\s+cfg#\d+\s*\|$")
_LANE = re.compile(r"\b([a-z][a-z0-9_]*)/([A-Za-z0-9_.:-]+)")


@dataclass(frozen=True)
class ProtoTable:
    process: str  # the process that printed it (one per TP rank of a server)
    scope: str  # self, intra-node or inter-node
    operation: str  # e.g. "remote memory read by ucp_get*(multi) into host memory from host"
    transports: tuple[str, ...]  # transport/device per row, in order

    @property
    def carries_kv(self) -> bool:
        return self.scope != "self" and self.operation.startswith(KV_OPERATIONS)


def proto_tables(log: str) -> list[ProtoTable]:
    """Every UCX protocol table in ``log`` (tables of several processes and threads may interleave)."""
    open_tables: dict[str, list] = {}  # per process:thread: [scope, operation, transports]
    done: list[ProtoTable] = []
    for line in log.splitlines():
        m = _PREFIX.match(line.strip())
        if not m:
            continue
        who, rest = m.group(1), m.group(2).strip()
        head = _HEADER.match(rest)
        cur = open_tables.get(who)
        if head:
            if cur and cur[1]:
                done.append(ProtoTable(_pid(who), cur[0], cur[1], tuple(cur[2])))
            open_tables[who] = [head.group(1), "", []]
        elif cur is not None and rest.startswith("|"):
            cells = [c.strip() for c in rest.strip("|").split("|")]
            if not cur[1] and len(cells) == 1:
                cur[1] = cells[0]
            elif len(cells) >= 3 and cells[0] != "Range":
                cur[2] += [f"{t}/{d}" for t, d in _LANE.findall(cells[-1])]
        elif cur is not None and rest.startswith("+") and cur[2]:
            done.append(ProtoTable(_pid(who), cur[0], cur[1], tuple(cur[2])))
            del open_tables[who]
    done += [ProtoTable(_pid(w), c[0], c[1], tuple(c[2])) for w, c in open_tables.items() if c[1] and c[2]]
    return done


def _pid(who: str) -> str:
    """host:pid:thread -> pid (a rank's threads are one process)."""
    parts = who.split(":")
    return parts[-2] if len(parts) >= 3 else who


def kv_transports(logs: dict[str, str]) -> dict[str, dict[str, list[str]]]:
    """Per log (D's, one per node) and per process in it (one per TP rank): the transports/devices its KV reads and
    writes used, sorted, each once."""
    out: dict[str, dict[str, list[str]]] = {}
    for name, text in logs.items():
        per: dict[str, set[str]] = {}
        for table in proto_tables(text):
            if table.carries_kv:
                per.setdefault(table.process, set()).update(table.transports)
        out[name] = {pid: sorted(ts) for pid, ts in sorted(per.items())}
    return out


def check_kv_over_network(decode_logs: dict[str, str], ranks: int) -> Check:
    """P and D on different hosts: each of D's ``ranks`` TP ranks read KV, and every KV read went over a network
    transport, as UCX itself reported."""
    used = kv_transports(decode_logs)
    every = sorted({t for per in used.values() for ts in per.values() for t in ts})
    seen = sum(len(per) for per in used.values())
    data = {"transports": used, "ranks_seen": seen, "ranks": ranks}
    if not every:
        return Check(
            CHECK_NAME,
            False,
            "no UCX protocol table for a KV read in D's log (UCX_PROTO_INFO=y): cannot tell what carried the KV",
            data,
        )
    shortcut = [t for t in every if t.split("/")[0] in SAME_HOST_TRANSPORTS]
    if shortcut:
        return Check(
            CHECK_NAME,
            False,
            f"KV went over a same-host shortcut ({', '.join(shortcut)}), not the network, between hosts",
            data,
        )
    if seen < ranks:
        return Check(CHECK_NAME, False, f"only {seen} of D's {ranks} ranks reported a KV read (UCX's tables)", data)
    return Check(CHECK_NAME, True, f"KV read over {', '.join(every)} by each of D's {ranks} ranks", data)
