"""What the night needs of a box: its accuracy runs, the models its steps serve, the GPUs it wants (pure apart from
reading the configs). harness/nightly/ builds its steps from the same runs and hands step 0 its exact list."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.gpu.plan import Gpu, PlanError, model_memory, plan_gpus

# (hub id, P TP, D TP): TinyLlama P2->D8 is the #45330 case (colocated on 8 GPUs); Qwen3-0.6B has a
# published GSM8K score (0.41), so its full run is also checked against that value.
ACCURACY_RUNS: tuple[tuple[str, int, int], ...] = (
    ("TinyLlama/TinyLlama-1.1B-Chat-v1.0", 2, 8),
    ("Qwen/Qwen3-0.6B", 2, 4),
)
NIGHT_GPUS = 8  # the nightly runner's box


@dataclass(frozen=True)
class NightNeeds:
    models: tuple[str, ...]  # hub ids the night's steps serve
    versions: tuple[str | None, ...] = (None,)  # vLLM versions its matrix and accuracy steps run (None: the pinned)
    gpus: int = NIGHT_GPUS
    pairs: tuple[tuple[str, int, int], ...] = ACCURACY_RUNS  # the accuracy runs: (model, P TP, D TP)
    accuracy: bool = True  # its accuracy steps run (lm-eval needed in every version's environment)
    before_prefetch: bool = False  # the night's step 0: what is not cached yet, its prefetch steps fetch


def _fits(gpus: Sequence[Gpu], model: str, tp_p: int, tp_d: int, baseline_first: bool) -> bool:
    try:
        plan_gpus(gpus, tp_p, tp_d, model_memory(model), baseline_first=baseline_first)
    except PlanError:
        return False
    return True


def night_models(gpus: Sequence[Gpu]) -> list[str]:
    """The hub models the night serves on ``gpus`` (what its prefetch fetches): every GPU entry of the matrices that
    has a place there, then the accuracy runs'."""
    from harness.matrix.config import EDGE_YAML, MATRIX_YAML, load_matrix
    from harness.matrix.plan import plan as matrix_plan

    out: list[str] = []
    for file in (MATRIX_YAML, EDGE_YAML):
        matrix, models = load_matrix(file)
        for p in matrix_plan(matrix, models, None, "gpu", len(gpus)):
            model = models[p.model].hub_id or p.model
            runs = p.device == "gpu" and p.skip_reason is None and model not in out
            if runs and _fits(gpus, model, p.tp_p, p.tp_d, baseline_first=False):
                out.append(model)
    out += [m for m, tp_p, tp_d in ACCURACY_RUNS if m not in out and _fits(gpus, m, tp_p, tp_d, True)]
    return out
