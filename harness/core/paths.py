"""Where the project's files live: the repository, build caches, run folders, vLLM environments."""

from __future__ import annotations

import os
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent.parent
# Root of the harness's build caches (models/, tasks/); PD_HARNESS_CACHE_DIR moves it (tests, shared machines).
CACHE_ROOT = Path(os.environ.get("PD_HARNESS_CACHE_DIR") or REPO_ROOT / ".cache")
RUNS_ROOT = REPO_ROOT / "runs"
VENVS_DIR = REPO_ROOT / ".venvs"
CONFIGS_DIR = REPO_ROOT / "configs"


def results_root() -> Path:
    """Where measured results are kept across runs and nights: the results store (harness/releases/store.py) and the
    calibrated logprob thresholds (harness/run/thresholds.py). PD_HARNESS_RESULTS_DIR moves it out of a checkout (CI
    wipes the checkout's .cache/ each night)."""
    return Path(os.environ.get("PD_HARNESS_RESULTS_DIR") or CACHE_ROOT / "results")
