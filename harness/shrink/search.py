"""The search for the smallest failing configuration (pure; the probes come from an injected oracle).

One axis at a time, in a fixed order, each simplified towards the plainest setting it has (load off, D's prefix cache
off, KV dtype auto, TP pair towards 1/1, block sizes towards equal). A simpler candidate that still fails with the
run's class is adopted; when every simpler candidate of an axis fails otherwise (passes, or another class), the axis
is needed for the failure. The search is bounded in probes and time and says which axes it did not decide.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace


@dataclass(frozen=True)
class Settings:
    """The part of a run's configuration the search moves; everything else is carried unchanged."""

    tp_p: int
    tp_d: int
    block_size_p: int | None
    block_size_d: int | None
    prefix_caching_d: bool = False
    load_requests: int = 0
    kv_cache_dtype: str | None = None
    prompts: tuple[str, ...] | None = None  # the sequential prompts sent (None: all of them)

    def __post_init__(self) -> None:
        if self.tp_p < 1 or self.tp_d < 1:
            raise ValueError(f"TP sizes must be >= 1, got P {self.tp_p}, D {self.tp_d}")
        if self.load_requests < 0:
            raise ValueError(f"load_requests must be >= 0, got {self.load_requests}")

    def flags(self) -> list[str]:
        """These settings as `python -m harness e2e` flags."""
        out = ["--tp-p", str(self.tp_p), "--tp-d", str(self.tp_d), "--load-requests", str(self.load_requests)]
        for flag, v in (
            ("--block-size-p", self.block_size_p),
            ("--block-size-d", self.block_size_d),
            ("--kv-cache-dtype", self.kv_cache_dtype),
        ):
            if v is not None:
                out += [flag, str(v)]
        out += ["--prompts", ",".join(self.prompts)] if self.prompts else []
        return out + (["--prefix-caching-d"] if self.prefix_caching_d else [])

    def describe(self) -> str:
        bs = f"block {self.block_size_p}/{self.block_size_d}" if self.block_size_p else "default block size"
        prefix = "on" if self.prefix_caching_d else "off"
        return (
            f"P TP{self.tp_p} -> D TP{self.tp_d}, {bs}, prefix cache on D {prefix}, "
            f"load {self.load_requests} requests, KV dtype {self.kv_cache_dtype or 'auto'}, "
            f"{'prompts ' + ','.join(self.prompts) if self.prompts else 'all prompts'}"
        )


@dataclass(frozen=True)
class Axis:
    name: str
    simpler: Callable[[Settings], list[Settings]]  # candidates, simplest first; [] when already at its simplest
    needed_words: Callable[[Settings], str]  # what "needed" means, from the settings it could not leave


def _load(s: Settings) -> list[Settings]:
    return [replace(s, load_requests=0)] if s.load_requests else []


def _prefix(s: Settings) -> list[Settings]:
    return [replace(s, prefix_caching_d=False)] if s.prefix_caching_d else []


def _dtype(s: Settings) -> list[Settings]:
    return [replace(s, kv_cache_dtype=None)] if s.kv_cache_dtype not in (None, "auto") else []


def _tp(s: Settings) -> list[Settings]:
    out: list[Settings] = []
    for p, d in ((1, 1), (1, s.tp_d), (s.tp_p, 1)):
        c = replace(s, tp_p=p, tp_d=d)
        if (p, d) != (s.tp_p, s.tp_d) and c not in out:
            out.append(c)
    return out


def _blocks(s: Settings) -> list[Settings]:
    if s.block_size_p == s.block_size_d:
        return []
    out = [replace(s, block_size_d=s.block_size_p), replace(s, block_size_p=s.block_size_d)]
    return [c for c in out if c.block_size_p is not None]


def prompts_axis(failing: tuple[str, ...]) -> Axis:
    """One prompt instead of the set: each of the run's first two failing sequential prompts alone, shortest first."""
    return Axis(
        "prompts",
        lambda s: [replace(s, prompts=(p,)) for p in failing[:2]] if s.prompts is None else [],
        lambda s: (
            "needs more than one prompt, or a load or prefix-cache request (one failing prompt alone did not fail)"
        ),
    )


AXES = (
    Axis("load", _load, lambda s: f"needs the load phase ({s.load_requests} requests)"),
    Axis("prefix cache", _prefix, lambda s: "needs D's prefix cache on"),
    Axis("KV dtype", _dtype, lambda s: f"needs KV dtype {s.kv_cache_dtype}"),
    Axis("TP", _tp, lambda s: f"needs P TP{s.tp_p} -> D TP{s.tp_d}"),
    Axis("block sizes", _blocks, lambda s: f"needs block_size_p {s.block_size_p} != block_size_d {s.block_size_d}"),
)


@dataclass(frozen=True)
class Probe:
    settings: Settings
    outcome: str  # ok, or the run's failure class
    seconds: float = 0.0
    run_dir: str | None = None

    def to_dict(self) -> dict:
        return {
            "settings": asdict(self.settings),
            "flags": self.settings.flags(),
            "outcome": self.outcome,
            "seconds": round(self.seconds, 1),
            "run_dir": self.run_dir,
        }


@dataclass(frozen=True)
class AxisVerdict:
    axis: str
    verdict: str  # irrelevant / needed / minimal / undecided
    words: str


@dataclass
class ShrinkResult:
    cls: str
    start: Settings
    minimal: Settings
    probes: list[Probe] = field(default_factory=list)
    axes: list[AxisVerdict] = field(default_factory=list)
    cut: str | None = None  # why the search stopped before every axis was decided

    def to_dict(self) -> dict:
        return {
            "class": self.cls,
            "start": asdict(self.start),
            "minimal": asdict(self.minimal),
            "minimal_flags": self.minimal.flags(),
            "axes": [asdict(a) for a in self.axes],
            "probes": [p.to_dict() for p in self.probes],
            "cut": self.cut,
        }

    def summary(self) -> str:
        decided = "; ".join(a.words for a in self.axes)
        cut = f" [CUT: {self.cut}]" if self.cut else ""
        return f"smallest configuration failing as {self.cls}: {self.minimal.describe()} ({decided}){cut}"


def shrink(
    start: Settings,
    cls: str,
    probe: Callable[[Settings], Probe],
    max_probes: int = 8,
    max_seconds: float = 3600.0,
    clock: Callable[[], float] = time.monotonic,
    failing_prompts: tuple[str, ...] = (),
) -> ShrinkResult:
    """Greedy, one axis at a time. ``probe`` runs one configuration for real (or, in tests, a fake).
    ``failing_prompts``: the run's failing sequential prompts, shortest first (the prompts axis tries them alone)."""
    result = ShrinkResult(cls, start, start)
    t0 = clock()
    axes = AXES + ((prompts_axis(failing_prompts),) if failing_prompts else ())
    for axis in axes:
        candidates = axis.simpler(result.minimal)
        if not candidates:
            result.axes.append(
                AxisVerdict(
                    axis.name,
                    "minimal",
                    f"{axis.name} not needed (already {_changed(axis, result.minimal)} in the run)",
                )
            )
            continue
        seen: list[str] = []
        adopted = None
        for cand in candidates:
            if len(result.probes) >= max_probes or clock() - t0 >= max_seconds:
                spent, n = clock() - t0, len(result.probes)
                result.cut = (
                    f"{n} probes, the budget is {max_probes}"
                    if n >= max_probes
                    else f"{spent:.0f} s, the budget is {max_seconds:.0f} s"
                )
                break
            p = probe(cand)
            result.probes.append(p)
            seen.append(f"{_changed(axis, cand)}: {p.outcome}")
            if p.outcome == cls:
                adopted = cand
                break
        if adopted is not None:
            result.minimal = adopted
            at = _changed(axis, adopted)
            words = (
                f"one prompt is enough (still {cls} with {at} alone)"
                if axis.name == "prompts"
                else f"{axis.name} irrelevant (still {cls} at {at})"
            )
            result.axes.append(AxisVerdict(axis.name, "irrelevant", words))
        elif result.cut is not None:
            result.axes.append(AxisVerdict(axis.name, "undecided", f"{axis.name} undecided (budget)"))
            break
        else:
            result.axes.append(
                AxisVerdict(
                    axis.name, "needed", f"{axis.needed_words(result.minimal)} (simpler: " + "; ".join(seen) + ")"
                )
            )
    done = {a.axis for a in result.axes}
    result.axes += [
        AxisVerdict(a.name, "undecided", f"{a.name} not tried (budget)") for a in axes if a.name not in done
    ]
    return result


def _changed(axis: Axis, s: Settings) -> str:
    return {
        "load": "load 0",
        "prefix cache": "prefix cache off",
        "KV dtype": "KV dtype auto",
        "TP": f"P TP{s.tp_p} -> D TP{s.tp_d}",
        "block sizes": f"block {s.block_size_p}/{s.block_size_d}",
        "prompts": f"prompt {','.join(s.prompts or ()) or 'all'}",
    }[axis.name]
