"""Binary search for the first release where an entry's outcome changes, with ``git bisect skip`` semantics (pure).

The releases are ordered oldest first. The oldest shows the "old" outcome (e.g. assert-45330), the
newest the "new" one (e.g. ok); which of them is --good or --bad only decides the words. A probe whose
outcome is neither (the release cannot be installed, or fails for another reason such as a server that
does not start) says nothing about the change: it is skipped, and the search goes on around it. When
skipped releases sit between the last old and the first new one, the answer names them: the change
may have happened in any of them.

The outcome of a release comes from an injected oracle, so the search is tested with a fake one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, field

# Outcomes that never judge a release: the release could not be tried at all.
UNJUDGEABLE = frozenset({"install-failed", "not-run", "harness-error", "interrupted"})


@dataclass(frozen=True)
class Observation:
    """What the oracle saw of one release."""

    outcome: str  # the matrix outcome or failure class (ok, assert-45330, server-exited, install-failed, ...)
    source: str = "run"  # run (probed now) / store (measured before, same entry, version and harness revision) / given
    seconds: float = 0.0  # time the probe took (install + run); 0 for store and given
    run_dir: str | None = None
    detail: str = ""


@dataclass(frozen=True)
class Probe:
    version: str
    observation: Observation
    verdict: str  # old / new / skip

    def to_dict(self) -> dict:
        return {"version": self.version, "verdict": self.verdict, **asdict(self.observation)}


@dataclass(frozen=True)
class BisectResult:
    entry: str
    versions: tuple[str, ...]  # oldest first
    old_outcome: str
    new_outcome: str
    last_old: str  # newest release seen with the old outcome
    first_new: str  # oldest release seen with the new outcome
    skipped_between: tuple[str, ...]  # releases between those two that could not be judged
    probes: tuple[Probe, ...] = field(default=())  # in the order they were made (ends included when looked up)
    exhausted: bool = False  # stopped at the probe budget before the boundary was pinned

    @property
    def runs(self) -> tuple[Probe, ...]:
        """The probes that ran a release now (not read from the store, not taken as given)."""
        return tuple(p for p in self.probes if p.observation.source == "run")

    @property
    def exact(self) -> bool:
        """The change is pinned to one release: adjacent old and new releases, nothing skipped between."""
        i, j = self.versions.index(self.last_old), self.versions.index(self.first_new)
        return j == i + 1 and not self.exhausted

    def line(self) -> str:
        """The one line a maintainer reads."""
        latest = {p.version: p for p in self.probes}  # an end given first and run later shows what the run saw
        tested = ", ".join(
            f"{v}={p.observation.outcome}"
            + (" (given)" if p.observation.source == "given" else "")
            + (" (skipped)" if p.verdict == "skip" else "")
            for v, p in sorted(latest.items(), key=lambda kv: self.versions.index(kv[0]))
        )
        head = f"{self.entry}: {self.old_outcome} up to {self.last_old}, {self.new_outcome} from {self.first_new}"
        if self.exhausted:
            head += " (NOT PINNED: the probe budget ran out; the change lies between those two)"
        elif self.skipped_between:
            head += (
                f" (NOT PINNED to one release: {', '.join(self.skipped_between)} could not be judged, so the change "
                f"is in one of {', '.join([*self.skipped_between, self.first_new])})"
            )
        return f"{head} (tested: {tested})"

    def to_dict(self) -> dict:
        return {
            "entry": self.entry,
            "versions": list(self.versions),
            "old_outcome": self.old_outcome,
            "new_outcome": self.new_outcome,
            "last_old": self.last_old,
            "first_new": self.first_new,
            "skipped_between": list(self.skipped_between),
            "exact": self.exact,
            "exhausted": self.exhausted,
            "probes_run": len(self.runs),
            "probes": [p.to_dict() for p in self.probes],
            "line": self.line(),
        }


class BisectError(ValueError):
    pass


def verdict(outcome: str, old: str | None, new: str, aliases: dict[str, str] | None = None) -> str:
    """old / new / skip for one outcome. ``old`` None: any judgeable outcome other than ``new`` is old.
    ``aliases`` maps an outcome to the one it counts as (e.g. a known intermittent failure that passed the
    handshake)."""
    o = (aliases or {}).get(outcome, outcome)
    if o == new:
        return "new"
    if o in UNJUDGEABLE:
        return "skip"
    if old is None or o == old:
        return "old"
    return "skip"


def next_index(lo: int, hi: int, tried: set[int]) -> int | None:
    """The untried index strictly between ``lo`` and ``hi`` nearest their middle (lower one on a tie), or None."""
    free = [i for i in range(lo + 1, hi) if i not in tried]
    if not free:
        return None
    mid = (lo + hi) / 2
    return min(free, key=lambda i: (abs(i - mid), i))


def bisect(
    entry: str,
    versions: list[str],
    oracle: Callable[[str], Observation],
    old_outcome: str | None,
    new_outcome: str,
    ends: dict[str, Observation] | None = None,
    aliases: dict[str, str] | None = None,
    max_probes: int = 12,
    confirm: bool = True,
) -> BisectResult:
    """Find the boundary between the old outcome (oldest release) and the new one (newest).

    ``ends``: observations of the two ends already known (from the store, or given by the user); an end
    not in it is probed. ``old_outcome`` None: whatever the oldest release shows (it is then probed or
    looked up). ``confirm``: the two releases around the answer are both measured; an end that was only
    given is probed at the end. ``max_probes`` bounds the oracle calls (each a real run)."""
    if len(versions) < 2:
        raise BisectError("a bisect needs at least two releases")
    if len(set(versions)) != len(versions):
        raise BisectError("releases are listed twice")
    known: dict[str, Observation] = dict(ends or {})
    probes: list[Probe] = []
    calls = 0

    def look(i: int) -> Observation:
        nonlocal calls
        v = versions[i]
        if v not in known:
            calls += 1
            known[v] = oracle(v)
        return known[v]

    first, last = look(0), look(len(versions) - 1)
    old = old_outcome if old_outcome is not None else (aliases or {}).get(first.outcome, first.outcome)
    if old == new_outcome:
        raise BisectError(f"both outcomes are {new_outcome!r}: nothing to bisect")
    for i, o in ((0, first), (len(versions) - 1, last)):
        want = "old" if i == 0 else "new"
        got = verdict(o.outcome, old, new_outcome, aliases)
        probes.append(Probe(versions[i], o, got))
        if got != want:
            raise BisectError(
                f"{versions[i]} shows {o.outcome}, not the {old if want == 'old' else new_outcome} "
                f"its end of the range needs ({o.source})"
            )

    lo, hi = 0, len(versions) - 1
    tried: set[int] = set()
    exhausted = False
    while True:
        found = next_index(lo, hi, tried)
        if found is None:
            break
        i = found
        if calls >= max_probes:
            exhausted = True
            break
        tried.add(i)
        o = look(i)
        got = verdict(o.outcome, old, new_outcome, aliases)
        probes.append(Probe(versions[i], o, got))
        if got == "old":
            lo = i
        elif got == "new":
            hi = i
    if confirm and not exhausted:
        # The answer rests on measurements of both sides: an end that was only given is run now.
        for i in (lo, hi):
            o = known[versions[i]]
            if o.source == "given":
                if calls >= max_probes:
                    exhausted = True
                    break
                calls += 1
                o = known[versions[i]] = oracle(versions[i])
                got = verdict(o.outcome, old, new_outcome, aliases)
                probes.append(Probe(versions[i], o, got))
                if got != ("old" if i == lo else "new"):
                    raise BisectError(f"{versions[i]} was given as {'old' if i == lo else 'new'} but shows {o.outcome}")
    skipped = tuple(versions[k] for k in range(lo + 1, hi))
    return BisectResult(
        entry, tuple(versions), old, new_outcome, versions[lo], versions[hi], skipped, tuple(probes), exhausted
    )


def max_probes_needed(n_between: int) -> int:
    """Probes a search over ``n_between`` releases between the ends needs without skips: ceil(log2(n + 1))."""
    k = 0
    while (1 << k) < n_between + 1:
        k += 1
    return k
