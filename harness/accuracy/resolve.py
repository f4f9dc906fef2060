"""Fill in what the served model decides about an accuracy run: the task, its include path, the bars."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

from harness.accuracy.lm_eval import hub_dataset_reachable
from harness.accuracy.settings import HUB_TASK, OFFLINE_MAX_GEN_TOKS, OFFLINE_TASK, AccuracySettings
from harness.models.config import load_models
from harness.models.trained import TRAINED_NAME, TrainedModelSpec
from harness.tasks.gsm8k_offline import ensure_task

# The trained tiny model scores well above this on its task; below it, a broken transfer could not show.
TRAINED_MIN_SCORE = 0.8


def resolve_accuracy(s: AccuracySettings, model: str, served_name: str, hub_reachable=None) -> AccuracySettings:
    """The settings with the task (the real gsm8k for a hub model whose dataset loads, else the offline task),
    the offline task's include path, and the score the baseline must reach or the published one."""
    hub_reachable = hub_reachable or (lambda: hub_dataset_reachable(dict(os.environ)))
    trained = served_name == TRAINED_NAME
    task = s.task
    if task is None:
        hub = not trained and not Path(model).exists() and hub_reachable()
        task = HUB_TASK if hub else OFFLINE_TASK
    out = replace(s, task=task)
    if task == OFFLINE_TASK and s.include_path is None:
        out = replace(out, include_path=str(ensure_task(TrainedModelSpec().task)))
    if task == OFFLINE_TASK and s.max_gen_toks is None:  # a hub task keeps its own (lm-eval's) generation settings
        out = replace(out, max_gen_toks=OFFLINE_MAX_GEN_TOKS)
    if trained and s.min_baseline_score is None:
        out = replace(out, min_baseline_score=TRAINED_MIN_SCORE)
    entry = load_models().find(model)
    full_gsm8k = task == HUB_TASK and s.limit is None and s.num_fewshot is None
    if full_gsm8k and s.expected_score is None and entry is not None and entry.gsm8k_expected is not None:
        out = replace(out, expected_score=entry.gsm8k_expected)
    return out
