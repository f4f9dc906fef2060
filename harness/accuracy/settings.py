"""What an accuracy run is: the task, its size, concurrency and the scores it is judged against."""

from __future__ import annotations

from dataclasses import asdict, dataclass

OFFLINE_TASK = "gsm8k_offline"


HUB_TASK = "gsm8k"


OFFLINE_MAX_GEN_TOKS = 64  # the offline task's answers are short (one count, then `#### N`)


HUB_DATASET = "openai/gsm8k"  # what lm-eval's builtin gsm8k loads


@dataclass(frozen=True)
class AccuracySettings:
    task: str | None = None  # None: the offline task for the local model, gsm8k for a hub model
    include_path: str | None = None  # folder with the task YAML (the offline task); None for builtin tasks
    num_fewshot: int | None = None  # None: the task's default
    limit: int | None = None  # None: the whole test split
    num_concurrent: int = 2
    # None: the task's own generation settings (a hub task such as gsm8k: lm-eval's, as upstream's published scores
    # were measured); the offline task sets its own (OFFLINE_MAX_GEN_TOKS, resolve.py)
    max_gen_toks: int | None = None
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
