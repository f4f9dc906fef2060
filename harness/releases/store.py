"""Results measured per (matrix entry, vLLM version, harness revision), kept on disk for reuse.

A bisect probe and a history cell are the same measurement: one entry run on one release. Once made,
it is reused by later bisects and histories as long as the code that launches, drives and judges a
pair is unchanged: the harness revision is a hash of that code (not of the git commit, so a commit
that only touches docs keeps the results, and an uncommitted edit of a checked module does not).
An interrupted or unjudgeable run (install failed, harness error) is never stored.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path

from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.core.paths import REPO_ROOT, results_root
from harness.core.safe import safe_name, under

# The code a pair's outcome depends on: launching (serve), the workload, the checks, the run's phases,
# the proxy and the matrix's judging of a run. Planning, reporting on releases and bundles are left out.
# (An environment is installed once per release and reused whatever the revision, so the installer is not part of it.)
REVISION_GLOBS = (
    "harness/workload/*.py",
    "harness/models/tiny.py",
    "harness/models/heads.py",
    "harness/serve/*.py",
    "harness/serve/cpu_tuning/*.py",
    "harness/proxy/*.py",
    "harness/checks/*.py",
    "harness/run/*.py",
    "harness/matrix/run.py",
    "toy_proxy_server.py",
    "requirements/cpu.txt",
    "requirements/gpu.txt",
)
NOT_STORED = frozenset({"install-failed", "not-run", "harness-error", "interrupted"})


def harness_revision(root: Path = REPO_ROOT) -> str:
    """12 hex digits over the contents of REVISION_GLOBS (paths included, sorted)."""
    h = hashlib.sha256()
    for pattern in REVISION_GLOBS:
        for p in sorted(root.glob(pattern)):
            h.update(str(p.relative_to(root)).encode() + b"\0" + p.read_bytes() + b"\0")
    return h.hexdigest()[:12]


def default_store_dir() -> Path:
    return results_root()


@dataclass(frozen=True)
class StoredResult:
    entry: str
    version: str
    revision: str
    outcome: str  # matrix outcome or failure class
    expected: str | None  # what the entry expected of this version when it ran (None: unknown)
    regime: str | None
    seconds: float  # the run (and install, for a probe that installed)
    run_dir: str | None
    detail: str
    measured_at: str  # ISO time
    by: str  # the command that measured it

    def to_dict(self) -> dict:
        return asdict(self)


class ResultStore:
    def __init__(self, root: Path | None = None, revision: str | None = None):
        self.root = Path(root) if root else default_store_dir()
        self.revision = revision or harness_revision()

    def _path(self, entry: str, version: str, revision: str | None = None) -> Path:
        """``<root>/<revision>/<entry>/<version>.json``; each part a safe name (they may come from imported
        reports), and the path checked to stay under the root: ConfigError otherwise."""
        parts = (
            safe_name(revision or self.revision, "harness revision"),
            safe_name(entry, "matrix entry id"),
            safe_name(version, "vLLM version") + ".json",
        )
        return under(self.root, self.root.joinpath(*parts))

    def get(self, entry: str, version: str) -> StoredResult | None:
        try:  # ConfigError: a name no result is stored under
            return StoredResult(**json.loads(self._path(entry, version).read_text()))
        except (OSError, ValueError, TypeError):
            return None

    def put(
        self,
        entry: str,
        version: str,
        outcome: str,
        *,
        seconds: float,
        run_dir: str | None,
        detail: str = "",
        expected: str | None = None,
        regime: str | None = None,
        by: str = "",
    ) -> StoredResult | None:
        """Keep a judged result (an unjudgeable one is not kept: it says nothing about the release)."""
        if outcome in NOT_STORED:
            return None
        r = StoredResult(
            entry,
            version,
            self.revision,
            outcome,
            expected,
            regime,
            round(seconds, 1),
            run_dir,
            detail[:500],
            dt.datetime.now().isoformat(timespec="seconds"),
            by,
        )
        p = self._path(entry, version)
        p.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(p, json.dumps(r.to_dict(), indent=1) + "\n")
        return r

    def other_revisions(self, entry: str, version: str) -> list[str]:
        """Revisions other than this one that hold a result for the pair (shown, never reused)."""
        if not self.root.is_dir():
            return []
        try:
            safe_name(entry, "matrix entry id"), safe_name(version, "vLLM version")
        except ConfigError:
            return []
        return sorted(
            d.name
            for d in self.root.iterdir()
            if d.is_dir() and d.name != self.revision and (d / entry / f"{version}.json").exists()
        )
