"""configs/known_issues.yaml, validated: each known upstream report, what it matches (matrix entries, a failure class,
a log signature, releases), the threads with their state as last checked. Pure lookups for the matrix, the run
report and ISSUE.md, which say "known upstream: ..." or "no known report as of <date>"."""

from __future__ import annotations

import re
from datetime import date
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from harness.core.paths import REPO_ROOT
from harness.models.config import load_yaml, require_unique_ids

KNOWN_YAML = REPO_ROOT / "configs" / "known_issues.yaml"


class Thread(BaseModel):
    model_config = ConfigDict(extra="forbid")
    ref: str = Field(pattern=r"^#\d+$")
    kind: Literal["issue", "pr"]
    state: Literal["open", "closed", "merged"]
    note: str | None = None

    @model_validator(mode="after")
    def _state(self) -> Thread:
        if self.kind == "issue" and self.state == "merged":
            raise ValueError("an issue is open or closed, not merged")
        return self

    def words(self) -> str:
        what = "PR " if self.kind == "pr" else ""
        return f"{what}{self.ref} ({self.state}{'; ' + self.note if self.note else ''})"


class Matches(BaseModel):
    """Any of these: one of the matrix entries; or the failure class (and, when given, a log line matching
    ``signature``). ``releases``: the vLLM versions it applies to (empty: any)."""

    model_config = ConfigDict(extra="forbid")
    entries: list[str] = Field(default_factory=list)
    cls: str | None = Field(default=None, alias="class")
    signature: str | None = None
    releases: list[str] = Field(default_factory=list)

    @field_validator("signature")
    @classmethod
    def _regex(cls, v: str | None) -> str | None:
        if v is not None:
            try:
                re.compile(v)
            except re.error as e:
                raise ValueError(f"not a regular expression: {e}") from None
        return v

    @model_validator(mode="after")
    def _something(self) -> Matches:
        if not self.entries and not self.cls:
            raise ValueError("match at least one matrix entry or a failure class")
        return self


class KnownReport(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1)
    summary: str = Field(min_length=1)
    matches: Matches
    threads: list[Thread] = Field(min_length=1)

    def line(self) -> str:
        return "known upstream: " + "; ".join(t.words() for t in self.threads)


class KnownIssues(BaseModel):
    model_config = ConfigDict(extra="forbid")
    checked: date  # when the threads' states were last read
    reports: list[KnownReport]

    @model_validator(mode="after")
    def _unique(self) -> KnownIssues:
        require_unique_ids([r.id for r in self.reports], "report")
        return self

    def for_entry(self, entry: str, version: str | None = None) -> list[KnownReport]:
        return [r for r in self.reports if entry in r.matches.entries and _applies(r, version)]

    def for_failure(self, cls: str | None, text: str = "", version: str | None = None) -> list[KnownReport]:
        """Reports matching a run's failure class (and its signature, where the report names one, in ``text``)."""
        out = []
        for r in self.reports:
            m = r.matches
            if cls and m.cls == cls and _applies(r, version) and (m.signature is None or re.search(m.signature, text)):
                out.append(r)
        return out

    def line_for(
        self, entry: str | None = None, cls: str | None = None, text: str = "", version: str | None = None
    ) -> str:
        """The line for a matrix entry's reports, else for those its failure (class, log text) matches."""
        return self.line((self.for_entry(entry, version) if entry else []) or self.for_failure(cls, text, version))

    def line(self, reports: list[KnownReport]) -> str:
        """The one line a report carries: the threads, or that none was known when the list was last checked."""
        if not reports:
            return f"no known upstream report as of {self.checked.isoformat()} (configs/known_issues.yaml)"
        return " | ".join(r.line() for r in reports)


def _applies(r: KnownReport, version: str | None) -> bool:
    return not r.matches.releases or version is None or version in r.matches.releases


@lru_cache(maxsize=4)
def load_known(path: Path = KNOWN_YAML) -> KnownIssues:
    """The known reports; any problem is one line naming the file and field."""
    return load_yaml(path, KnownIssues)
