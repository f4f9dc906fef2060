"""Preemption on D (the axis kv_pool_blocks_d): D alone gets the small pool, the run is refused where vLLM could not
start or nothing would preempt, and d_preempted fails unless D's own counter shows preemptions."""

import pytest

from harness.checks.load import PREEMPTIONS, check_d_preempted
from harness.core.errors import ConfigError
from harness.run.config import E2EConfig
from harness.serve.axes import ServerAxes
from harness.serve.prometheus import parse_metrics
from harness.workload.load import LoadSettings


def counter(n: float) -> list:
    return parse_metrics(f'{PREEMPTIONS}{{engine="0",model_name="m"}} {n}\n')


def test_preemptions_that_grew_over_the_run_pass_and_none_fail():
    assert check_d_preempted(counter(2), counter(5)).detail == f"D preempted 3 times over the run ({PREEMPTIONS})"
    assert check_d_preempted(counter(2), counter(5)).passed
    assert not check_d_preempted(counter(4), counter(4)).passed  # a pool that never filled tested nothing


def test_no_counter_is_unknown_never_a_pass():
    check = check_d_preempted([], [])
    assert not check.passed and "unknown" in check.detail and check.data == {"preemptions": None}


def test_only_d_gets_the_small_pool(tmp_path):
    from harness.run.context import RunContext
    from harness.run.report import Report
    from harness.workload.client import GenerationSettings

    cfg = E2EConfig(axes=ServerAxes(kv_pool_blocks_d=17))
    ctx = RunContext(cfg, tmp_path / "run", Report(config={}), [], GenerationSettings())
    assert ctx.server_pool("decode", 32) == 17
    assert ctx.server_pool("prefill", 32) == ctx.server_pool("baseline", 32) == cfg.pool_blocks(32) != 17


@pytest.mark.parametrize(
    "settings, words",
    [
        (dict(axes=ServerAxes(kv_pool_blocks_d=20), load=LoadSettings(requests=0)), "needs the load phase"),
        (dict(axes=ServerAxes(kv_pool_blocks_d=15)), "holds 480 tokens in blocks of 32, fewer than one request"),
    ],
)
def test_a_pool_that_cannot_start_or_cannot_fill_is_refused_when_built(settings, words):
    with pytest.raises(ConfigError, match=words):
        E2EConfig(**settings)
