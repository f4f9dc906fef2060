"""What an accuracy run is: the task, its size, concurrency and the scores it is judged against."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from harness.core.errors import ConfigError

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

    def __post_init__(self) -> None:
        """Refused when built, one line naming the flag: a value that no lm-eval run can take."""
        for value, least, flag in (
            (self.num_fewshot, 0, "--num-fewshot"),
            (self.limit, 1, "--accuracy-limit"),
            (self.num_concurrent, 1, "--lm-eval-concurrency"),
            (self.max_gen_toks, 1, "max_gen_toks"),
        ):
            if value is not None and value < least:
                raise ConfigError(f"{flag} must be >= {least}, got {value!r}")
        for seconds, flag in ((self.timeout_s, "the accuracy timeout"), (self.request_timeout_s, "--request-timeout")):
            if not seconds > 0:
                raise ConfigError(f"{flag} must be > 0 seconds, got {seconds!r}")
        for score, name in ((self.min_baseline_score, "min_baseline_score"), (self.expected_score, "expected_score")):
            if score is not None and not 0 <= score <= 1:
                raise ConfigError(f"{name} is a score in [0, 1], got {score!r}")

    @property
    def metric_key(self) -> str:
        return f"{self.metric},{self.filter}"

    def to_dict(self) -> dict:
        return asdict(self)
