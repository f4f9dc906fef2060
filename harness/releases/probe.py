"""One matrix entry on one release, through the matrix machinery (plan, run_matrix, observed_outcome).

Reuses a stored result of the same entry, version and harness revision; otherwise installs the
release's environment (on demand), runs the pair and stores what it showed. A release that cannot be
installed is observed as ``install-failed`` (a bisect skips it). ``run_lock``: a file whose lock is
held around each run (not around installs), so runs of several harness users on one machine never
overlap while installs still proceed.
"""

from __future__ import annotations

import contextlib
import fcntl
import sys
import time
from argparse import Namespace
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from harness.core.files import new_folder
from harness.matrix.config import MatrixEntry, MatrixFile
from harness.models.config import ModelEntry
from harness.releases.bisect import Observation
from harness.releases.store import ResultStore


@dataclass
class Prober:
    matrix: MatrixFile
    models: dict[str, ModelEntry]
    store: ResultStore
    run_root: Path  # probes' run folders: <run_root>/<entry>/vllm-<version>/...
    device: str = "cpu"
    gpus: int = 0
    fresh: bool = False  # ignore stored results (measure again; the new result replaces the stored one)
    fresh_baseline: bool = False  # compute baselines again instead of reusing cached answers (docs/performance.md)
    run_lock: Path | None = None
    by: str = ""  # the command, recorded with each stored result
    out: TextIO = sys.stdout

    @classmethod
    def for_command(
        cls, a: Namespace, matrix: MatrixFile, models: dict[str, ModelEntry], store: ResultStore, run_root: Path,
        device: str, command: str
    ) -> Prober:  # fmt: skip
        """The prober of ``bisect`` and ``history``: --fresh, --fresh-baseline and --run-lock from their flags."""
        from harness.gpu.detect import count_gpus

        gpus = count_gpus() if device == "gpu" else 0
        return cls(matrix, models, store, run_root, device, gpus, fresh=a.fresh, fresh_baseline=a.fresh_baseline,
                   run_lock=a.run_lock, by=command)  # fmt: skip

    def entry(self, entry_id: str) -> MatrixEntry:
        e = self.matrix.get(entry_id)
        if e is None:
            raise ValueError(
                f"unknown matrix entry {entry_id!r} (known: {', '.join(x.id for x in self.matrix.entries)})"
            )
        return e

    def observe(self, entry_id: str, version: str) -> Observation:
        self.entry(entry_id)
        if not self.fresh:
            got = self.store.get(entry_id, version)
            if got is not None:
                print(
                    f"  {entry_id} on {version}: {got.outcome} "
                    f"(stored {got.measured_at}, harness revision {got.revision})",
                    file=self.out,
                    flush=True,
                )
                return Observation(got.outcome, "store", 0.0, got.run_dir, got.detail)
        return self._run(entry_id, version)

    def _run(self, entry_id: str, version: str) -> Observation:
        from harness.envs.vllm_env import EnvSetupFailed, ensure_env
        from harness.matrix.plan import plan
        from harness.matrix.run import run_matrix
        from harness.models.rules import as_device
        from harness.run.config import E2EConfig

        t0 = time.monotonic()
        try:
            python = str(ensure_env(self.device, version, out=self.out))
        except EnvSetupFailed as e:
            print(f"  {entry_id} on {version}: install-failed ({e})", file=self.out, flush=True)
            return Observation("install-failed", "run", time.monotonic() - t0, None, str(e)[:500])
        install_s = time.monotonic() - t0
        pairs = plan(self.matrix, self.models, version, self.device, self.gpus, only={entry_id})
        pair = pairs[0]
        if not pair.run:
            return Observation("not-run", "run", time.monotonic() - t0, None, pair.skip_reason or "")
        run_dir = new_folder(self.run_root / entry_id / f"vllm-{version}")  # a re-probe gets its own folder
        with self._locked():
            t1 = time.monotonic()
            results = run_matrix(
                {version: pairs},
                {version: python},
                self.models,
                E2EConfig(device=as_device(self.device), fresh_baseline=self.fresh_baseline),
                run_dir,
                out=self.out,
            )
            run_s = time.monotonic() - t1
        r = results[0]
        if r.observed is None:  # planned but not launched (vLLM refuses the TP sizes)
            return Observation("not-run", "run", time.monotonic() - t0, None, r.detail)
        pair_dir = r.run_dir
        detail = f"install {install_s:.0f} s, run {run_s:.0f} s" + (f"; {r.detail}" if r.detail else "")
        self.store.put(
            entry_id,
            version,
            r.observed,
            seconds=install_s + run_s,
            run_dir=pair_dir,
            detail=detail,
            expected=pair.expected,
            regime=pair.regime,
            by=self.by,
        )
        return Observation(r.observed, "run", install_s + run_s, pair_dir, detail)

    @contextlib.contextmanager
    def _locked(self):
        if self.run_lock is None:
            yield
            return
        with open(self.run_lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                print(f"  waiting for the run lock {self.run_lock} (another run holds it)", file=self.out, flush=True)
                t0 = time.monotonic()
                fcntl.flock(f, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
                print(f"  got the run lock after {time.monotonic() - t0:.0f} s", file=self.out, flush=True)
            yield
