"""docs/faults.md's bad-input table, generated from the tests' declared cases (``ROWS`` in
tests/unit/test_bad_input.py), so that a row of the table is a case that runs.

``python -m tests.unit.bad_input_table`` prints the table; ``--write`` rewrites it in docs/faults.md, between the
markers. tests/unit/test_bad_input_table.py fails while the doc's table differs from this rendering."""

from __future__ import annotations

import argparse
import ast
import re
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache

from harness.core.paths import REPO_ROOT

DOC = REPO_ROOT / "docs" / "faults.md"
WRITE = "python -m tests.unit.bad_input_table --write"
BEGIN = f"<!-- generated from the tests' cases by `{WRITE}`: do not edit by hand -->"
END = "<!-- end of the generated table -->"
HEADER = "| bad input tried | what the harness says |\n|---|---|"

# In a case's `says`: <name> is a value the test fills in (a path, an index), ... is any text.
PLACEHOLDER = re.compile(r"<\w+>|\.\.\.")


@dataclass(frozen=True)
class Case:
    """One bad input a test hands the harness, and the error line the harness must answer with."""

    tried: str  # the input in the doc's words (markdown); "" where the words of the case before cover it
    args: tuple[str, ...]  # the command line the test runs; <name> words are filled in by the test
    says: str  # the whole error line in the doc's notation (PLACEHOLDER); the test matches it in full
    shown: str | None = None  # what the table shows of `says`: None all of it, "" nothing, else this part of it
    # made under the test's folder before it runs (a name ending in "/": a folder)
    files: Mapping[str, str | bytes] = field(default_factory=dict)

    @property
    def id(self) -> str:
        return self.tried.replace("`", "") or " ".join(self.args)


@dataclass(frozen=True)
class Row:
    """One row of the table: its cells, the cases that run it here, and the tests elsewhere that try (part of) it."""

    tried: str  # the left cell (markdown); {tried} stands for the cases' `tried` words, listed
    says: str  # the right cell; {says} stands for the cases' shown `says`, each in a code span, joined by " / "
    cases: tuple[Case, ...] = ()
    owners: tuple[str, ...] = ()  # "tests/unit/<file>.py::<test function>"
    last: str = ", "  # what lists the last of the cases' `tried` words ("a, b, or c": ", or ")


def says_pattern(says: str, **bound: str) -> re.Pattern[str]:
    """The regular expression of a case's `says`, its <name>s replaced by the test's values (each must be given)."""
    parts, at = [], 0
    for m in PLACEHOLDER.finditer(says):
        parts.append(re.escape(says[at : m.start()]))
        if m.group() == "...":
            parts.append(".*")
        elif m.group()[1:-1] in bound:
            parts.append(re.escape(bound[m.group()[1:-1]]))
        else:
            raise KeyError(f"{m.group()} in {says!r} has no value: the test must give it")
        at = m.end()
    parts.append(re.escape(says[at:]))
    return re.compile("".join(parts))


def fill(args: Sequence[str], **bound: str) -> list[str]:
    """A case's command line with its <name> words replaced by the test's values."""
    return [bound.get(a[1:-1], a) if a.startswith("<") and a.endswith(">") else a for a in args]


def listed(words: Sequence[str], last: str) -> str:
    """ "a, b" + last + "c": the cases' words as the cell lists them."""
    return ", ".join(words[:-1]) + last + words[-1] if len(words) > 1 else "".join(words)


def cell_tried(row: Row) -> str:
    return row.tried.replace("{tried}", listed([c.tried for c in row.cases if c.tried], row.last))


def cell_says(row: Row) -> str:
    shown = [c.says if c.shown is None else c.shown for c in row.cases]
    return row.says.replace("{says}", " / ".join(f"`{s}`" for s in shown if s))


def render_table(rows: Sequence[Row]) -> str:
    return "\n".join([HEADER, *(f"| {cell_tried(r)} | {cell_says(r)} |" for r in rows)])


def render_block(rows: Sequence[Row]) -> str:
    """What goes between the markers: where the rows come from, then the table."""
    here = "tests/unit/test_bad_input.py"
    files = sorted({o.split("::")[0] for r in rows for o in r.owners} - {here})
    lead = (
        f"Each row is declared in `{here}` (`ROWS`) with the cases that test runs and the tests elsewhere that try it: "
        + listed([f"`{f}`" for f in files], ", and ")
        + "."
    )
    return f"{BEGIN}\n{lead}\n\n{render_table(rows)}\n\n{END}"


@cache
def functions_in(path: str) -> frozenset[str]:
    """The test functions defined at the top of a test file (read, not imported)."""
    tree = ast.parse((REPO_ROOT / path).read_text())
    return frozenset(n.name for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef))


def owner_problem(owner: str) -> str | None:
    path, _, name = owner.partition("::")
    if not (REPO_ROOT / path).is_file():
        return f"{owner}: no file {path}"
    if name not in functions_in(path):
        return f"{owner}: {path} defines no {name}"
    return None


def row_problems(row: Row) -> list[str]:
    """What makes a row untrue to its tests: no test at all, a test that is gone, words no case has."""
    out = [] if row.cases or row.owners else [f"{row.tried!r}: no case and no test owns this row"]
    out += [p for p in map(owner_problem, row.owners) if p]
    tried, says = cell_tried(row), cell_says(row)
    for c in row.cases:
        shown = c.says if c.shown is None else c.shown
        if "{tried}" not in row.tried and c.tried not in tried:
            out.append(f"{c.id}: its words {c.tried!r} are not in the row's {tried!r}")
        if shown not in c.says:
            out.append(f"{c.id}: shows {shown!r}, not a part of what it says {c.says!r}")
        if "{says}" not in row.says and shown not in says:
            out.append(f"{c.id}: {shown!r} is not in the row's {says!r}")
    out += [f"{row.tried!r}: a '|' splits the cell" for text in (tried, says) if re.search(r"(?<!\\)\|", text)]
    return out


def doc_block(text: str) -> str:
    """The generated part of a doc's text, markers included."""
    start, end = text.find(BEGIN), text.find(END)
    if start < 0 or end < start:
        raise ValueError(f"{DOC.relative_to(REPO_ROOT)} has no generated bad-input table (its markers are missing)")
    return text[start : end + len(END)]


def with_block(text: str, block: str) -> str:
    return text.replace(doc_block(text), block, 1)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tests.unit.bad_input_table", description=__doc__)
    p.add_argument("--write", action="store_true", help=f"rewrite the table in {DOC.relative_to(REPO_ROOT)}")
    a = p.parse_args(argv)
    from tests.unit.test_bad_input import ROWS  # the cases live beside the tests that run them

    problems = [q for r in ROWS for q in row_problems(r)]
    if problems:
        print("\n".join(f"error: {q}" for q in problems), file=sys.stderr)
        return 2
    block = render_block(ROWS)
    if not a.write:
        print(block)
        return 0
    text = DOC.read_text()
    new = with_block(text, block)
    if new != text:
        DOC.write_text(new)
    print(f"{DOC.relative_to(REPO_ROOT)}: {'rewritten' if new != text else 'already up to date'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
