"""What a run against attached servers knows of them, and where the baseline differs from them.

vLLM 0.32.0 serves its block size, prefix caching and KV cache dtype in /metrics (``vllm:cache_config_info``) and its
TP size only at /server_info (VLLM_SERVER_DEV_MODE=1); a TP size may also be given (--tp-p/--tp-d). What is neither
served nor given is said to be unknown, never filled in with a default. The report's ``config.attach`` lists every
setting in which the baseline differs from an attached server (``differences``) and each one that could not be
compared, with why (``not_compared``). Pure: from the run's config and what the servers said.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from harness.render.run_markdown import difference_line
from harness.run.config import TP_UNKNOWN, E2EConfig
from harness.serve.servers import Attach, Served, endpoints

SETTINGS = ("block size", "prefix caching", "KV cache dtype", "TP")
_PREFIX = {"True": "on", "False": "off"}


@dataclass(frozen=True)
class Side:
    """One server's value of each setting (None: unknown, with why in ``why``)."""

    name: str  # prefill, decode[1], baseline
    values: Mapping[str, str | None]
    why: Mapping[str, str] = field(default_factory=dict)  # setting -> why its value is unknown


@dataclass(frozen=True)
class Difference:
    """A setting in which the baseline differs from attached servers: their values by server name."""

    setting: str
    baseline: str
    servers: Mapping[str, str]

    def to_dict(self) -> dict[str, Any]:
        return {"setting": self.setting, "baseline": self.baseline, "servers": dict(self.servers)}

    def line(self) -> str:
        return difference_line(self.setting, self.baseline, self.servers)


def _cache_side(name: str, served: Served | None, tp: str | None, tp_why: str) -> Side:
    """A server's settings from its /metrics labels and a TP size (None: unknown because ``tp_why``)."""
    cache = served.cache if served else {}
    unread = "its /metrics was not read" if served is None or any("/metrics" in u for u in served.unread) else None
    values = {
        "block size": cache.get("block_size"),
        "prefix caching": _PREFIX.get(cache.get("enable_prefix_caching", ""), cache.get("enable_prefix_caching")),
        "KV cache dtype": cache.get("cache_dtype"),
        "TP": tp,
    }
    why = {k: unread or "not in its vllm:cache_config_info" for k, v in values.items() if v is None and k != "TP"}
    if tp is None:
        why["TP"] = tp_why
    return Side(name, values, why)


def attached_sides(cfg: E2EConfig, attach: Attach) -> list[Side]:
    """Every attached P and D server's settings; TP as the run knows it (given or served), else unknown."""
    by_url = {s.url: s for s in attach.served}
    out = []
    for role, urls, tp_name in (("prefill", attach.prefill_urls, "tp_p"), ("decode", attach.decode_urls, "tp_d")):
        tp = None if tp_name in cfg.tp_unknown else str(getattr(cfg, tp_name))
        for ep in endpoints(role, urls):
            out.append(_cache_side(ep.name, by_url.get(ep.url), tp, TP_UNKNOWN))
    return out


def baseline_side(cfg: E2EConfig, attach: Attach) -> Side:
    """The baseline's settings: an attached one's as it serves them, or those of the server launched here."""
    if attach.baseline_url is not None:
        served = next((s for s in attach.served if s.url == attach.baseline_url.rstrip("/")), None)
        tp = str(served.tp) if served and served.tp else None
        return _cache_side("baseline", served, tp, TP_UNKNOWN)
    block = cfg.block_sizes()[1]
    values = {
        "block size": str(block) if block else None,
        "prefix caching": "off",  # the baseline launched here keeps its prefix cache off (harness/run/launch.py)
        "KV cache dtype": cfg.axes.kv_cache_dtype or "auto",
        "TP": None if "tp_d" in cfg.tp_unknown else str(cfg.tp_d),
    }
    why = {
        "block size": "the baseline takes vLLM's default, which its attention backend chooses",
        "TP": f"the baseline runs at TP {cfg.tp_d}, a guess: D's TP is {TP_UNKNOWN}",
    }
    return Side("baseline", values, {k: w for k, w in why.items() if values[k] is None})


def compare(baseline: Side, servers: list[Side]) -> tuple[list[Difference], list[str]]:
    """(the settings in which ``baseline`` differs from ``servers``, a line for each that could not be compared)."""
    differences: list[Difference] = []
    unknown: dict[tuple[str, str], list[str]] = {}  # (setting, why) -> the servers it applies to
    for setting in SETTINGS:
        b = baseline.values[setting]
        if b is None:
            unknown.setdefault((setting, baseline.why[setting]), []).append("the baseline")
            continue
        differ: dict[str, str] = {}
        for side in servers:
            v = side.values[setting]
            if v is None:
                unknown.setdefault((setting, side.why[setting]), []).append(side.name)
            elif v != b:
                differ[side.name] = v
        if differ:
            differences.append(Difference(setting, b, differ))
    not_compared = [f"{setting} of {', '.join(names)}: {why}" for (setting, why), names in unknown.items()]
    return differences, not_compared


def attach_report(cfg: E2EConfig, attach: Attach) -> dict[str, Any]:
    """``config.attach`` of the report: the URLs, what each server said, where each setting came from, and how the
    baseline differs from the attached servers."""
    differences, not_compared = compare(baseline_side(cfg, attach), attached_sides(cfg, attach))
    return {
        **attach.to_dict(),
        "differences": [d.to_dict() for d in differences],
        "not_compared": not_compared,
    }
