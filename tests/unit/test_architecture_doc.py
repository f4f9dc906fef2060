"""docs/architecture.md cannot drift from the tree: every module of a package is named in that package's row (by its
file name, or by its folder for a module of a sub-folder such as ``serve/inject/``)."""

from __future__ import annotations

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
ROW = re.compile(r"^\| \[`(\w+)/`\]")


def rows() -> dict[str, str]:
    out = {}
    for line in (REPO / "docs" / "architecture.md").read_text().splitlines():
        m = ROW.match(line)
        if m:
            out[m.group(1)] = line
    return out


def unnamed(harness: Path, table: dict[str, str]) -> list[str]:
    missing = []
    for p in sorted(harness.rglob("*.py")):
        parts = p.relative_to(harness).parts
        if len(parts) < 2 or p.name == "__init__.py":
            continue
        row = table.get(parts[0], "")
        named = p.name in row if len(parts) == 2 else f"{parts[1]}/" in row or p.name in row
        if not named:
            missing.append("/".join(parts))
    return missing


def test_every_module_is_named_in_its_packages_row():
    missing = unnamed(REPO / "harness", rows())
    assert not missing, "modules docs/architecture.md does not name in their package's row: " + ", ".join(missing)


def test_the_check_sees_an_unnamed_module(tmp_path):
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "named.py").write_text("")
    (tmp_path / "pkg" / "forgotten.py").write_text("")
    assert unnamed(tmp_path, {"pkg": "| [`pkg/`](x) | the named one (`named.py`) |"}) == ["pkg/forgotten.py"]
