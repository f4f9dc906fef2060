"""Logprob thresholds calibrated on a box (`python -m harness calibrate --store`), kept for later runs and nights.

A threshold is keyed by what can move a correct run's noise: the GPU model NVML names, the driver, the vLLM version
and the model. One JSON file beside the results store (``results_root``: PD_HARNESS_RESULTS_DIR, which CI keeps across
nights), rewritten whole and atomically under a lock. A GPU run without --logprob-threshold takes its key's threshold
(``apply_threshold``, where the pipeline resolves the run); its report's config says which threshold it used
(``logprob_threshold``, None: the device's default) and where it came from (``logprob_threshold_source``). The
nightly plans a calibrate step for a key with no entry (harness/nightly/calibration.py).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from harness.core.cache import cache_lock
from harness.core.errors import ConfigError
from harness.core.files import write_atomic
from harness.core.paths import results_root
from harness.core.safe import comment, load_json_object, shown
from harness.run.config import E2EConfig

if TYPE_CHECKING:  # the store is read by calibrate and the nightly too: they need none of a run's machinery
    from harness.gpu.run import GpuRun
    from harness.run.context import RunContext

STORE_FILE = "calibrated_thresholds.json"
GIVEN = "given"
NOT_CALIBRATED = "default (not calibrated on this box)"
_TEXT_MAX = 300  # a key part or a folder longer than this is no value the harness wrote


@dataclass(frozen=True)
class ThresholdKey:
    gpu: str  # NVML's model name of the run's GPUs ("+"-joined, sorted, when they differ)
    driver: str
    vllm: str  # without a local part (0.32.0+cu130 -> 0.32.0): the night names versions without it
    model: str  # hub id (or path) as the run resolved it

    def describe(self) -> str:
        return f"{self.gpu}, driver {self.driver}, vLLM {self.vllm}, {self.model}"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object, where: str) -> ThresholdKey:
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: the key is {shown(d)}, not an object")
        return cls(*(_text(d.get(name), f"{where}: key {name}") for name in ("gpu", "driver", "vllm", "model")))


def threshold_key(
    gpu_names: Iterable[str], driver: str | None, vllm: str | None, model: str | None
) -> ThresholdKey | str:
    """The key of a calibration on this box, or why there is none (a part NVML or the environment did not give)."""
    names = sorted({n for n in gpu_names if n})
    parts = (("GPU model name", names), ("driver version", driver), ("vLLM version", vllm), ("model", model))
    missing = [what for what, value in parts if not value]
    if missing:
        return f"no {', '.join(missing)} to key a calibration by"
    return ThresholdKey("+".join(names), str(driver), str(vllm).split("+")[0], str(model))


@dataclass(frozen=True)
class StoredThreshold:
    key: ThresholdKey
    threshold: float  # what runs of the key use
    noise_max: float  # the calibration's numbers (harness/calibrate/threshold.py Calibration)
    noise_requests: int
    fault_factor: float
    fault_max: float
    fault_requests: int
    folder: str  # the calibration's --out
    date: str  # ISO date it was measured

    @property
    def source(self) -> str:
        return f"calibrated {self.date} ({self.folder})"

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: object, where: str) -> StoredThreshold:
        """ConfigError naming ``where`` for an entry the harness did not write (a hand edit, a truncated copy)."""
        if not isinstance(d, dict):
            raise ConfigError(f"{where}: {shown(d)} is not an object")
        threshold = _number(d.get("threshold"), f"{where}: threshold")
        if threshold <= 0:
            raise ConfigError(f"{where}: threshold {threshold!r} must be > 0")
        return cls(
            ThresholdKey.from_dict(d.get("key"), where),
            threshold,
            _number(d.get("noise_max"), f"{where}: noise_max"),
            int(_number(d.get("noise_requests"), f"{where}: noise_requests")),
            _number(d.get("fault_factor"), f"{where}: fault_factor"),
            _number(d.get("fault_max"), f"{where}: fault_max"),
            int(_number(d.get("fault_requests"), f"{where}: fault_requests")),
            comment(_text(d.get("folder"), f"{where}: folder")),  # shown in reports and the dry run: one line
            comment(_text(d.get("date"), f"{where}: date")),
        )


def _text(value: object, what: str) -> str:
    if isinstance(value, str) and value.strip() and len(value) <= _TEXT_MAX:
        return value
    raise ConfigError(f"{what} is {shown(value)}, not a text of 1 to {_TEXT_MAX} characters")


def _number(value: object, what: str) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value) and value >= 0:
        return float(value)
    raise ConfigError(f"{what} is {shown(value)}, not a finite number >= 0")


class ThresholdStore:
    """The calibrated thresholds, one file (default: ``results_root()/calibrated_thresholds.json``)."""

    def __init__(self, path: Path | None = None):
        self.path = Path(path) if path is not None else results_root() / STORE_FILE

    def entries(self) -> list[StoredThreshold]:
        """Every entry; none when there is no file. A file the harness did not write is a ConfigError (one line
        naming it): a run must not guess its threshold from it."""
        if not self.path.exists():
            return []
        data = load_json_object(self.path, "calibrated-thresholds file")
        raw = data.get("entries")
        if not isinstance(raw, list):
            raise ConfigError(f"{self.path}: 'entries' is {shown(raw)}, not a list (fix or delete the file)")
        return [StoredThreshold.from_dict(e, f"{self.path}: entry {i}") for i, e in enumerate(raw)]

    def lookup(self, key: ThresholdKey) -> StoredThreshold | None:
        return next((e for e in self.entries() if e.key == key), None)

    def put(self, entry: StoredThreshold) -> None:
        """Keep ``entry``, replacing the key's earlier one; under a lock, so two calibrations at once keep both."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with cache_lock(self.path):
            kept = [e.to_dict() for e in self.entries() if e.key != entry.key]
            write_atomic(self.path, json.dumps({"entries": [*kept, entry.to_dict()]}, indent=1) + "\n")


@dataclass(frozen=True)
class ThresholdChoice:
    threshold: float | None  # None: the device's default (E2EConfig.logprob_limit)
    source: str  # "given", "calibrated <date> (<folder>)" or "default (<why>)"
    key: ThresholdKey | None = None  # this run's key: what `calibrate --store` keeps a measurement under


def run_key(cfg: E2EConfig, gpu: GpuRun | None, vllm: str | None, model: str, attached: bool) -> ThresholdKey | str:
    """A run's key, or why it has none: only a run whose servers all start here on real GPUs has a box to key by."""
    if attached:
        return "attached servers: their box is not known here"
    if cfg.device != "gpu" or gpu is None:
        return f"the {cfg.device} threshold"
    if gpu.simulated:
        return f"simulated GPUs ({gpu.simulated}): no box to calibrate"
    return threshold_key((g.name for g in gpu.plan.gpus), gpu.driver, vllm, model)


def choose_threshold(cfg: E2EConfig, key: ThresholdKey | str, store: ThresholdStore) -> ThresholdChoice:
    """Given (--logprob-threshold) first, then the key's calibration, else the device's default, saying why."""
    k = key if isinstance(key, ThresholdKey) else None
    if cfg.logprob_threshold is not None:
        return ThresholdChoice(cfg.logprob_threshold, GIVEN, k)
    if k is None:
        return ThresholdChoice(None, f"default ({key})")
    if (cfg.axes.kv_cache_dtype or "").startswith("fp8"):  # its own noise (config.py FP8_KV_LOGPROB_THRESHOLD)
        return ThresholdChoice(None, "default (an fp8 KV cache: the calibration measured an unquantized one)", k)
    hit = store.lookup(k)
    if hit is None:
        return ThresholdChoice(None, NOT_CALIBRATED, k)
    return ThresholdChoice(hit.threshold, hit.source, k)


def apply_threshold(ctx: RunContext, attached: bool, store: ThresholdStore) -> E2EConfig:
    """The run's config with the threshold it uses, recorded in its report's config (the model, GPUs and versions
    are resolved by now)."""
    vllm = (ctx.report.versions or {}).get("vllm")
    key = run_key(ctx.cfg, ctx.gpu, vllm, ctx.model, attached)
    choice = choose_threshold(ctx.cfg, key, store)
    ctx.report.config["logprob_threshold"] = choice.threshold
    ctx.report.config["logprob_threshold_source"] = choice.source
    ctx.report.config["logprob_threshold_key"] = choice.key.to_dict() if choice.key else None
    return replace(ctx.cfg, logprob_threshold=choice.threshold)
