"""The README stays a short front page that links every doc, and no link or path in the docs points at nothing."""

from __future__ import annotations

import re
from pathlib import Path

from harness.checks.classify import CLASSES

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
DOCS = REPO / "docs"
README_MAX_BYTES = 8000  # a newcomer reads it in five minutes; the rest belongs in docs/

# [text](target) outside code; images too. Targets with a scheme (https:, mailto:) are not checked.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^```.*?^```", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
# Repository paths written in code spans, e.g. `harness/run/pipeline.py` or `tests/fakes/` (bare file names such
# as `pd.py` are relative to the text around them and not checked).
PATH_IN_CODE = re.compile(r"`((?:harness|tests|configs|scripts|requirements|ci|docs|\.ci)/[\w./-]*)`")


def markdown_files() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def without_code(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    h = re.sub(r"[`*]", "", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", h).replace(" ", "-")


def anchors(md: Path) -> set[str]:
    text = FENCE.sub("", md.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#{1,6}\s+(.+?)\s*#*$", text, re.MULTILINE)}


def broken_links(md: Path) -> list[str]:
    out = []
    for target in LINK.findall(without_code(md.read_text())):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (md.parent / path).resolve() if path else md
        if not dest.exists():
            out.append(f"{md.relative_to(REPO)}: {target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            out.append(f"{md.relative_to(REPO)}: {target} (no heading #{anchor} in {dest.relative_to(REPO)})")
    return out


def test_readme_is_a_short_front_page():
    size = len(README.read_bytes())
    assert size < README_MAX_BYTES, (
        f"README.md is {size} bytes; keep it under {README_MAX_BYTES} and move detail to docs/"
    )


def test_every_relative_link_resolves():
    broken = [b for md in markdown_files() for b in broken_links(md)]
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_every_doc_is_linked_from_the_readme():
    linked = {(README.parent / t.partition("#")[0]).resolve() for t in LINK.findall(without_code(README.read_text()))}
    missing = [str(p.relative_to(REPO)) for p in sorted(DOCS.glob("*.md")) if p.resolve() not in linked]
    assert not missing, f"docs not linked from README.md (add them to its 'More' list): {missing}"


def test_repository_paths_named_in_the_docs_exist():
    missing = []
    for md in markdown_files():
        for p in PATH_IN_CODE.findall(FENCE.sub("", md.read_text())):
            if "<" in p or "*" in p:
                continue
            if not (REPO / p).exists():
                missing.append(f"{md.relative_to(REPO)}: {p}")
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


def test_the_faults_page_explains_every_failure_class():
    rows = "\n".join(ln for ln in (REPO / "docs" / "faults.md").read_text().splitlines() if ln.startswith("| `"))
    missing = [c for c in CLASSES if f"`{c}`" not in rows]
    assert not missing, f"failure classes missing from docs/faults.md's table: {missing}"
