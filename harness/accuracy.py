"""Accuracy through lm-eval: one task against the P/D proxy and against the baseline, scored and diffed per sample.

lm-eval runs as a subprocess of the serving interpreter (``local-completions`` against
``/v1/completions``; the server tokenizes), with per-sample logging into the run folder and no
request cache, so the two runs never share answers. Reading its output, the per-sample diff, the
tolerance and the checks are pure functions.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from harness.checks import Check
from harness.procs import ManagedProcess, ProcessSpec

OFFLINE_TASK = "gsm8k_offline"
HUB_TASK = "gsm8k"
HUB_DATASET = "openai/gsm8k"  # what lm-eval's builtin gsm8k loads
# Upstream compares full GSM8K scores with a model's published value at this tolerance.
EXPECTED_SCORE_TOLERANCE = 0.05
# Greedy P/D and baseline should agree almost everywhere: at most this share of responses may differ.
MAX_DIFFERING_SHARE = 0.05


class AccuracyFailed(RuntimeError):
    """lm-eval did not produce a result (it exited non-zero, timed out, or wrote no output)."""

    def __init__(self, reason: str, log_tail: str = ""):
        super().__init__(reason)
        self.reason, self.log_tail = reason, log_tail


@dataclass(frozen=True)
class AccuracySettings:
    task: str | None = None  # None: the offline task for the local model, gsm8k for a hub model
    include_path: str | None = None  # folder with the task YAML (the offline task); None for builtin tasks
    num_fewshot: int | None = None  # None: the task's default
    limit: int | None = None  # None: the whole test split
    num_concurrent: int = 2
    max_gen_toks: int = 64
    seed: int = 0
    timeout_s: float = 1800.0  # the whole lm-eval run
    request_timeout_s: float = 300.0
    metric: str = "exact_match"
    filter: str = "strict-match"
    min_baseline_score: float | None = None  # a model whose score makes the comparison meaningful (trained tiny model)
    expected_score: float | None = None  # a hub model's published score on the full task

    @property
    def metric_key(self) -> str:
        return f"{self.metric},{self.filter}"

    def to_dict(self) -> dict:
        return asdict(self)


def lm_eval_argv(python: str, base_url: str, model_name: str, s: AccuracySettings, out_dir: Path) -> list[str]:
    """The lm-eval command line: the same for P/D and baseline except ``base_url`` and ``out_dir``."""
    model_args = ",".join([
        f"model={model_name}", f"base_url={base_url}/v1/completions", "tokenizer_backend=None",
        "tokenized_requests=False", f"num_concurrent={s.num_concurrent}", "max_retries=3", f"timeout={int(s.request_timeout_s)}",
    ])
    if s.task is None:
        raise ValueError("resolve the accuracy task before building the lm-eval command")
    argv = [python, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks", s.task,
            "--gen_kwargs", f"max_gen_toks={s.max_gen_toks},temperature=0,do_sample=False",
            "--seed", str(s.seed), "--output_path", str(out_dir), "--log_samples"]
    if s.include_path:
        argv += ["--include_path", s.include_path]
    if s.num_fewshot is not None:
        argv += ["--num_fewshot", str(s.num_fewshot)]
    if s.limit is not None:
        argv += ["--limit", str(s.limit)]
    return argv


@dataclass(frozen=True)
class Sample:
    doc_id: int
    prompt_hash: str
    response: str  # the raw generation
    extracted: str  # after the task's filter
    correct: bool


@dataclass(frozen=True)
class EvalRun:
    task: str
    score: float
    samples: dict[int, Sample]
    lm_eval_version: str | None = None
    output_dir: str = ""

    @property
    def n(self) -> int:
        return len(self.samples)


def _first(x):
    while isinstance(x, list) and x:
        x = x[0]
    return x if isinstance(x, str) else ("" if x is None else str(x))


def read_eval_output(out_dir: Path, s: AccuracySettings) -> EvalRun:
    """The score and per-sample answers lm-eval wrote under ``out_dir`` (it nests a folder per model)."""
    results = sorted(Path(out_dir).rglob("results_*.json"))
    samples_files = sorted(Path(out_dir).rglob(f"samples_{s.task}_*.jsonl"))
    if not results or not samples_files:
        raise AccuracyFailed(f"lm-eval wrote no results/samples for task {s.task} under {out_dir}")
    data = json.loads(results[-1].read_text())
    task_results = data.get("results", {}).get(s.task, {})
    if s.metric_key not in task_results:
        raise AccuracyFailed(f"no {s.metric_key} for {s.task} in {results[-1]} (has: {', '.join(task_results)})")
    samples: dict[int, Sample] = {}
    for line in samples_files[-1].read_text().splitlines():
        if not line.strip():
            continue
        row = json.loads(line)
        if row.get("filter", s.filter) != s.filter:
            continue
        samples[int(row["doc_id"])] = Sample(int(row["doc_id"]), str(row.get("prompt_hash", "")), _first(row.get("resps")),
                                             _first(row.get("filtered_resps")), float(row.get(s.metric, 0)) >= 1.0)
    version = data.get("lm_eval_version") or (data.get("versions") or {}).get(s.task)
    return EvalRun(s.task, float(task_results[s.metric_key]), samples, None if version is None else str(version), str(out_dir))


@dataclass(frozen=True)
class SampleDiff:
    compared: int
    differing: list[int] = field(default_factory=list)  # doc ids whose response text differs
    flips: list[tuple[int, bool, bool]] = field(default_factory=list)  # (doc id, baseline correct, P/D correct)
    unpaired: list[int] = field(default_factory=list)  # in one run only, or with a different prompt

    def to_dict(self) -> dict:
        return {"compared": self.compared, "differing_responses": len(self.differing), "differing_doc_ids": self.differing[:50],
                "score_flips": len(self.flips), "flips": [{"doc_id": d, "baseline": b, "pd": p} for d, b, p in self.flips[:50]],
                "unpaired": self.unpaired[:50]}


def diff_samples(baseline: EvalRun, pd: EvalRun) -> SampleDiff:
    """Per doc: did P/D answer with other text than the baseline, and did its score flip?"""
    differing, flips, unpaired = [], [], []
    compared = 0
    for doc_id in sorted(set(baseline.samples) | set(pd.samples)):
        b, p = baseline.samples.get(doc_id), pd.samples.get(doc_id)
        if b is None or p is None or b.prompt_hash != p.prompt_hash:
            unpaired.append(doc_id)
            continue
        compared += 1
        if b.response != p.response:
            differing.append(doc_id)
        if b.correct != p.correct:
            flips.append((doc_id, b.correct, p.correct))
    return SampleDiff(compared, differing, flips, unpaired)


def score_tolerance(n: int, baseline_score: float) -> float:
    """How far the P/D score may sit from the baseline's in the same run.

    Three binomial standard errors of the baseline score over ``n`` samples, and never less than
    one sample (1/n): more samples, tighter tolerance. Greedy P/D should agree with the baseline
    almost everywhere, so this only absorbs a few near-tie flips; a corrupted transfer moves the
    score far more (the per-sample check catches smaller damage).
    """
    if n <= 0:
        return 0.0
    p = min(max(baseline_score, 0.0), 1.0)
    return max(1.0 / n, 3.0 * math.sqrt(p * (1.0 - p) / n))


def max_differing(n: int) -> int:
    return max(1, math.floor(MAX_DIFFERING_SHARE * n))


def check_through_pd(samples: int, stats_before: dict, stats_after: dict, xfers: float) -> Check:
    """lm-eval's requests really took the P/D path: P answered each with kv_transfer_params and D read over NIXL."""
    def grew(key: str) -> int:
        return int(stats_after.get(key, 0)) - int(stats_before.get(key, 0))

    with_params, missing = grew("prefill_with_kv_transfer_params"), grew("prefill_missing_kv_transfer_params")
    ok = samples > 0 and with_params >= samples and missing == 0 and xfers >= samples
    return Check("accuracy_through_pd", ok, f"{with_params} prefill answers with kv_transfer_params ({missing} without) and "
                 f"{xfers:.0f} NIXL transfers for {samples} lm-eval samples")


def accuracy_checks(baseline: EvalRun, pd: EvalRun, s: AccuracySettings) -> tuple[list[Check], dict]:
    """The named accuracy checks and the report's ``accuracy`` block."""
    diff = diff_samples(baseline, pd)
    n = diff.compared
    tol = score_tolerance(n, baseline.score)
    delta = pd.score - baseline.score
    checks = [
        Check("accuracy_samples_paired", n > 0 and not diff.unpaired,
              f"{n} samples paired" + (f"; {len(diff.unpaired)} unpaired (doc ids {diff.unpaired[:10]})" if diff.unpaired else "")),
        Check("accuracy_pd_within_tolerance", n > 0 and abs(delta) <= tol,
              f"P/D {pd.score:.3f} vs baseline {baseline.score:.3f} (delta {delta:+.3f}, tolerance {tol:.3f} for {n} samples)"),
        Check("accuracy_responses_agree", n > 0 and len(diff.differing) <= max_differing(n),
              f"{len(diff.differing)}/{n} responses differ (at most {max_differing(n)}), {len(diff.flips)} score flips"
              + _examples(baseline, pd, diff.differing)),
    ]
    if s.min_baseline_score is not None:
        checks.append(Check("accuracy_baseline_meaningful", baseline.score >= s.min_baseline_score,
                            f"baseline {baseline.score:.3f} (at least {s.min_baseline_score} so that a broken transfer shows)"))
    if s.expected_score is not None:
        off = max(abs(baseline.score - s.expected_score), abs(pd.score - s.expected_score))
        checks.append(Check("accuracy_matches_expected", off <= EXPECTED_SCORE_TOLERANCE,
                            f"baseline {baseline.score:.3f}, P/D {pd.score:.3f}, expected {s.expected_score} ± {EXPECTED_SCORE_TOLERANCE}"))
    block = {"task": s.task, "samples": n, "metric": s.metric_key, "baseline_score": baseline.score, "pd_score": pd.score,
             "delta": delta, "tolerance": tol, **diff.to_dict(), "lm_eval": pd.lm_eval_version or baseline.lm_eval_version,
             "settings": s.to_dict(), "output": {"baseline": baseline.output_dir, "pd": pd.output_dir}}
    return checks, block


def _examples(baseline: EvalRun, pd: EvalRun, doc_ids: list[int], k: int = 2) -> str:
    parts = [f"doc {d}: baseline {baseline.samples[d].response[:60]!r} vs P/D {pd.samples[d].response[:60]!r}" for d in doc_ids[:k]]
    return ("; " + "; ".join(parts)) if parts else ""


def hub_dataset_reachable(env: dict[str, str], cache_root: Path | None = None, probe=None) -> bool:
    """Can lm-eval load the real GSM8K? From the local hub cache, or from the hub unless offline mode is set."""
    root = cache_root or Path(env.get("HF_HOME", Path.home() / ".cache" / "huggingface")) / "hub"
    if (root / f"datasets--{HUB_DATASET.replace('/', '--')}").is_dir():
        return True
    if env.get("HF_HUB_OFFLINE") == "1" or env.get("HF_DATASETS_OFFLINE") == "1":
        return False
    if probe is None:
        import requests

        def probe() -> bool:
            try:
                return requests.head(f"https://huggingface.co/api/datasets/{HUB_DATASET}", timeout=5).status_code == 200
            except requests.RequestException:
                return False
    return probe()


def run_lm_eval(python: str, base_url: str, model_name: str, s: AccuracySettings, out_dir: Path, log_path: Path,
                watch: list, env: dict[str, str] | None = None) -> EvalRun:
    """Run lm-eval to completion while watching the servers it talks to (anything with check()): a dead server ends the wait at once."""
    # The offline task must never touch the hub; a hub task may need to download its dataset.
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if s.task == OFFLINE_TASK else {}
    spec = ProcessSpec(name=log_path.stem, argv=lm_eval_argv(python, base_url, model_name, s, out_dir), log_path=log_path,
                       env={**offline, "TOKENIZERS_PARALLELISM": "false", **(env or {})})
    deadline = time.monotonic() + s.timeout_s
    with ManagedProcess(spec) as lm:
        while lm.returncode is None:
            for p in watch:
                p.check()
            if time.monotonic() > deadline:
                raise AccuracyFailed(f"lm-eval did not finish within {s.timeout_s:.0f} s", lm.log_tail())
            time.sleep(0.5)
        if lm.returncode != 0:
            raise AccuracyFailed(f"lm-eval exited with {lm.returncode}", lm.log_tail())
    return read_eval_output(out_dir, s)
