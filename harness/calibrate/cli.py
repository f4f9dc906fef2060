"""python -m harness calibrate: a correct P/D run and the same run with a decode-side KV fault, on this device; where
the logprob threshold must sit between them (threshold.py), and whether the one in use does; with --store, the
suggested one kept for this box, where later GPU runs take it (harness/run/thresholds.py)."""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
from pathlib import Path

from harness.calibrate.threshold import Calibration, calibrate, markdown, per_request_deltas
from harness.core.argtypes import positive
from harness.core.errors import ConfigError
from harness.core.files import new_folder, write_atomic
from harness.run.thresholds import StoredThreshold, ThresholdKey, ThresholdStore

DEFAULT_FAULT = 1.02  # 2 % on one layer's received KV: quiet enough to flip few tokens


def add_parser(sub) -> None:
    c = sub.add_parser(
        "calibrate",
        help="measure the logprob noise of a correct run and a KV fault's effect; check the "
        "threshold sits between them",
    )
    c.add_argument("--out", type=Path, required=True, help="a new folder for both runs, calibration.json and .md")
    c.add_argument(
        "--fault",
        type=positive(float),
        default=DEFAULT_FAULT,
        help=f"D scales one layer's received KV by this (default {DEFAULT_FAULT})",
    )
    c.add_argument("--timeout", type=positive(float), default=3600.0, help="seconds per run (default 3600)")
    c.add_argument(
        "--store",
        action="store_true",
        help="keep the suggested threshold for this box (GPU model, driver, vLLM, model), where later GPU runs "
        "without --logprob-threshold take it; exit 1 when the runs cannot place one",
    )
    c.add_argument(
        "e2e_args",
        nargs=argparse.REMAINDER,
        help="after --: the e2e flags of the runs (--device, --model, --tp-p, --tp-d, ...)",
    )


def run_e2e(out: Path, name: str, args: list[str], timeout_s: float) -> dict:
    run_dir = new_folder(out / name)  # a second calibration into `out` never reads the first one's report
    argv = [sys.executable, "-m", "harness", "e2e", "--run-dir", str(run_dir), *args]
    print(f"calibrate: {name} run: {' '.join(argv[1:])}", file=sys.stderr, flush=True)
    try:
        subprocess.run(argv, timeout=timeout_s, check=False)
    except subprocess.TimeoutExpired:
        raise ConfigError(f"the {name} run took longer than {timeout_s:g} s (log: {run_dir})") from None
    report = run_dir / "report.json"
    if not report.exists():
        raise ConfigError(f"the {name} run left no report ({run_dir}): see its output above")
    return json.loads(report.read_text())


def measure(out: Path, args: list[str], fault: float, timeout_s: float) -> tuple[Calibration, dict]:
    """The calibration, and the correct run's report config (its threshold's key and source)."""
    correct = run_e2e(out, "correct", args, timeout_s)
    if correct.get("verdict") != "pass" and correct.get("failure", {}).get("class") != "logprob-mismatch":
        raise ConfigError(f"the correct run did not pass ({correct.get('reason')}): there is no noise to measure")
    faulty = run_e2e(out, "fault", [*args, "--decode-kv-fault", str(fault)], timeout_s)
    checks = {c["name"]: c for c in faulty.get("checks", [])}
    if not checks.get("decode_kv_fault_fired", {}).get("passed"):
        raise ConfigError("the KV fault did not fire in the fault run: its deltas would say nothing")
    cfg = correct.get("config") or {}
    used = {c["name"]: c for c in correct.get("checks", [])}.get("logprobs_match_baseline", {})
    threshold = float((used.get("data") or {}).get("threshold") or 0)
    c = calibrate(str(cfg.get("device")), per_request_deltas(correct), per_request_deltas(faulty), fault, threshold)
    return c, cfg


def keep(c: Calibration, config: dict, out: Path, store: ThresholdStore) -> tuple[bool, str]:
    """Keep ``c``'s suggested threshold under the key the correct run recorded (harness/run/thresholds.py): whether
    it was kept, and the line that says what was kept or why nothing was."""
    if c.suggested is None:
        return False, f"calibrate: nothing stored: no threshold tells a correct run from the fault here ({c.verdict})"
    raw = config.get("logprob_threshold_key")
    if raw is None:
        why = config.get("logprob_threshold_source") or "no key recorded"
        return False, f"calibrate: nothing stored: the correct run recorded no key for this box; its threshold: {why}"
    key = ThresholdKey.from_dict(raw, f"{out}: the correct run's logprob_threshold_key")
    entry = StoredThreshold(
        key,
        c.suggested,
        c.noise_max,
        c.noise_requests,
        c.fault_factor,
        c.fault_max,
        c.fault_requests,
        str(out.resolve()),
        dt.date.today().isoformat(),
    )
    store.put(entry)
    return True, f"calibrate: stored threshold {c.suggested:.3g} for {key.describe()} in {store.path}"


def main(a: argparse.Namespace) -> int:
    args = [x for x in a.e2e_args if x != "--"]
    if a.out.exists() and any(a.out.iterdir()):
        raise ConfigError(f"--out {a.out} is not empty: give a new folder")
    if any(x.startswith(("--run-dir", "--decode-kv-fault", "--proxy-fault")) for x in args):
        raise ConfigError("calibrate sets --run-dir and --decode-kv-fault itself, and needs no proxy fault")
    a.out.mkdir(parents=True, exist_ok=True)
    c, config = measure(a.out, args, a.fault, a.timeout)
    write_atomic(a.out / "calibration.json", json.dumps(c.to_dict(), indent=2) + "\n")
    write_atomic(a.out / "calibration.md", markdown(c))
    print(markdown(c))
    if a.store:  # the night's step: it passes when later runs have a threshold of this box to use
        kept, line = keep(c, config, a.out, ThresholdStore())
        print(line, flush=True)
        return 0 if kept else 1
    return 0 if c.verdict == "ok" else 1
