"""docs/faults.md's bad-input table is the one tests/unit/test_bad_input.py's cases make, and every row has a test."""

from __future__ import annotations

import pytest

import tests.unit.test_bad_input as bad_input
from tests.unit.bad_input_table import (
    BEGIN,
    DOC,
    END,
    WRITE,
    Case,
    Row,
    doc_block,
    fill,
    render_block,
    row_problems,
    says_pattern,
    with_block,
)
from tests.unit.test_bad_input import ROWS


def test_the_doc_table_is_the_one_the_cases_make():
    block = render_block(ROWS)
    assert doc_block(DOC.read_text()) == block, (
        f"docs/faults.md's bad-input table differs from the tests' cases: run `{WRITE}`, or paste this:\n\n{block}"
    )


def test_every_row_has_a_test_that_exists_and_its_cases_words():
    assert [p for r in ROWS for p in row_problems(r)] == []


def test_every_case_in_the_table_is_run_by_a_test():
    """A row's cases are the parameters of test_bad_input's tests: a case in the table is a case that runs."""
    run = [
        case
        for name, fn in vars(bad_input).items()
        if name.startswith("test_")
        for mark in getattr(fn, "pytestmark", [])
        if mark.name == "parametrize"
        for case in mark.args[1]
        if isinstance(case, Case)
    ]
    not_run = [c.id for r in ROWS for c in r.cases if not any(c is x for x in run)]
    assert not_run == []


def test_the_cases_notation_is_matched_in_full():
    p = says_pattern("error: <run>/report.json: not a report (not JSON: ...)", run="/tmp/a+b")
    assert p.fullmatch("error: /tmp/a+b/report.json: not a report (not JSON: Expecting value: line 1)")
    assert not p.fullmatch("error: /tmp/aab/report.json: not a report (not JSON: x)")  # a value is literal
    assert not p.fullmatch("error: /tmp/a+b/report.json: not a report (not JSON: x) and more")
    with pytest.raises(KeyError, match="<run>"):
        says_pattern("error: <run>: x")
    assert fill(("e2e", "--run-dir", "<dir>", "<other>"), dir="/d") == ["e2e", "--run-dir", "/d", "<other>"]


def test_a_row_untrue_to_its_tests_is_named():
    case = Case("`--x 1`", ("e2e", "--x", "1"), "error: --x must be > 1", shown="must be > 2")
    assert row_problems(Row("{tried}", "{says}; exit 2", cases=(case,))) == [
        "--x 1: shows 'must be > 2', not a part of what it says 'error: --x must be > 1'"
    ]
    assert row_problems(Row("`--y 1`", "anything", cases=(Case("`--x 1`", (), "e", shown=""),))) == [
        "--x 1: its words '`--x 1`' are not in the row's '`--y 1`'"
    ]
    assert row_problems(Row("a | b", "c", owners=("tests/unit/test_bad_input_table.py::no_such_test",))) == [
        "tests/unit/test_bad_input_table.py::no_such_test: tests/unit/test_bad_input_table.py defines no no_such_test",
        "'a | b': a '|' splits the cell",
    ]
    assert row_problems(Row("words", "say")) == ["'words': no case and no test owns this row"]


def test_write_replaces_the_table_and_nothing_else():
    text = f"# Faults\n\nbefore\n{BEGIN}\nold table\n{END}\nafter\n"
    assert with_block(text, f"{BEGIN}\nnew\n{END}") == f"# Faults\n\nbefore\n{BEGIN}\nnew\n{END}\nafter\n"
    with pytest.raises(ValueError, match="markers"):
        doc_block("# Faults\n| a | b |\n")
