"""Accuracy through lm-eval: one task against the P/D proxy and against the baseline, scored and diffed per sample.

lm-eval runs as a subprocess of the serving interpreter (``local-completions`` against
``/v1/completions``; the server tokenizes), with per-sample logging into the run folder and no
request cache, so the two runs never share answers. Reading its output is a pure function; the
checks on two runs are in ``accuracy/checks.py``.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

from harness.accuracy.settings import HUB_DATASET, OFFLINE_TASK, AccuracySettings
from harness.core import progress
from harness.core.notrack import with_no_track
from harness.serve.procs import ManagedProcess, ProcessSpec


class AccuracyFailed(RuntimeError):
    """lm-eval did not produce a result (it exited non-zero, timed out, or wrote no output)."""

    def __init__(self, reason: str, log_tail: str = ""):
        super().__init__(reason)
        self.reason, self.log_tail = reason, log_tail


def lm_eval_argv(python: str, base_url: str, model_name: str, s: AccuracySettings, out_dir: Path) -> list[str]:
    """The lm-eval command line: the same for P/D and baseline except ``base_url`` and ``out_dir``."""
    model_args = ",".join(
        [
            f"model={model_name}",
            f"base_url={base_url}/v1/completions",
            "tokenizer_backend=None",
            "tokenized_requests=False",
            f"num_concurrent={s.num_concurrent}",
            "max_retries=3",
            f"timeout={int(s.request_timeout_s)}",
        ]
    )
    if s.task is None:
        raise ValueError("resolve the accuracy task before building the lm-eval command")
    argv = [
        python,
        "-m",
        "lm_eval",
        "--model",
        "local-completions",
        "--model_args",
        model_args,
        "--tasks",
        s.task,
        "--seed",
        str(s.seed),
        "--output_path",
        str(out_dir),
        "--log_samples",
    ]
    if s.max_gen_toks is not None:  # else the task's own generation settings (a hub task's, as published)
        argv += ["--gen_kwargs", f"max_gen_toks={s.max_gen_toks},temperature=0,do_sample=False"]
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
    if s.task is None:
        raise ValueError("resolve the accuracy task before reading lm-eval's output")
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
        samples[int(row["doc_id"])] = Sample(
            int(row["doc_id"]),
            str(row.get("prompt_hash", "")),
            _first(row.get("resps")),
            _first(row.get("filtered_resps")),
            float(row.get(s.metric, 0)) >= 1.0,
        )
    version = data.get("lm_eval_version") or (data.get("versions") or {}).get(s.task)
    return EvalRun(
        s.task, float(task_results[s.metric_key]), samples, None if version is None else str(version), str(out_dir)
    )


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


def _latest(tail: str) -> str:
    line = progress.last_line(tail, 140)
    return "starting" if not line or line.startswith("# ") else line  # "# name: argv" is the harness's own header


def run_lm_eval(
    python: str,
    base_url: str,
    model_name: str,
    s: AccuracySettings,
    out_dir: Path,
    log_path: Path,
    watch: list,
    env: dict[str, str] | None = None,
) -> EvalRun:
    """Run lm-eval to completion while watching the servers it talks to (anything with check()): a dead server ends the
    wait at once."""
    # The offline task must never touch the hub; a hub task may need to download its dataset.
    offline = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"} if s.task == OFFLINE_TASK else {}
    spec = ProcessSpec(
        name=log_path.stem,
        argv=lm_eval_argv(python, base_url, model_name, s, out_dir),
        log_path=log_path,
        env=with_no_track({**offline, "TOKENIZERS_PARALLELISM": "false", **(env or {})}),
    )
    deadline = time.monotonic() + s.timeout_s
    name = log_path.stem.replace("_", " ").replace("lm eval", "lm-eval")
    rep = progress.current()
    with (
        rep.step(name, "evaluation", announce=f"{name}: task {s.task} against {base_url} (log {log_path})"),
        ManagedProcess(spec) as lm,
    ):
        # lm-eval reports its progress only in its log (a bar redrawn with carriage returns): show its last line
        rep.status(lambda: f"{name}: {_latest(lm.log_tail(3))}")
        while lm.returncode is None:
            for p in watch:
                p.check()
            if time.monotonic() > deadline:
                raise AccuracyFailed(f"lm-eval did not finish within {s.timeout_s:.0f} s", lm.log_tail())
            time.sleep(0.5)
        if lm.returncode != 0:
            raise AccuracyFailed(f"lm-eval exited with {lm.returncode}", lm.log_tail())
    return read_eval_output(out_dir, s)
