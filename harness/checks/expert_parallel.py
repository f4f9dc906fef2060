"""Expert-parallel decode: that D really split its experts over its ranks (pure, from D's logs).

Greedy outputs that match the baseline say nothing of EP unless EP was on: with ``--enable-expert-parallel`` vLLM
logs an MoE rank's place ("[EP Rank r/s] Expert parallelism is enabled ... Local/global number of experts: l/g"), but
only from the first rank of each node (``info_once``, scope "local": on one host, rank 0 alone). The check wants
that line, an EP group of all D's ranks, and each logged rank holding a share (l < g) of the experts.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from harness.checks.check import Check

CHECK_NAME = "d_expert_parallel"
EP_LINE = re.compile(
    r"\[EP Rank (\d+)/(\d+)\] Expert parallelism is enabled\..*?Local/global number of experts: (\d+)/(\d+)"
)


def ep_ranks(logs: Mapping[str, str]) -> dict[int, tuple[int, int, int]]:
    """Each EP rank D's logs show: rank -> (EP size, local experts, global experts)."""
    out: dict[int, tuple[int, int, int]] = {}
    for text in logs.values():
        for m in EP_LINE.finditer(text):
            rank, size, local, total = (int(g) for g in m.groups())
            out[rank] = (size, local, total)
    return out


def check_d_expert_parallel(decode_logs: Mapping[str, str], ranks: int) -> Check:
    """D's logged EP ranks must be of an EP group of all its ``ranks`` (TP x DP), each with fewer experts than the
    model has."""
    seen = ep_ranks(decode_logs)
    wrong = sorted(r for r, (size, local, total) in seen.items() if size != ranks or not 0 < local < total)
    shares = ", ".join(f"rank {r} of {s}: {lo}/{g}" for r, (s, lo, g) in sorted(seen.items()))
    if not seen:
        detail = "no D rank logged expert parallelism: EP did not take effect (a dense model, or the flag was lost)"
    elif wrong:
        detail = f"D's EP is not over its {ranks} ranks with a share of the experts each: {shares}"
    else:
        detail = f"D splits its experts over {ranks} ranks ({shares} experts; vLLM logs each node's first rank only)"
    data = {str(r): {"ep_size": s, "local": lo, "global": g} for r, (s, lo, g) in sorted(seen.items())}
    return Check(CHECK_NAME, bool(seen) and not wrong, detail, data)
