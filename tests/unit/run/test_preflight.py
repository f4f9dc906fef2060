import itertools
from typing import Any

import pytest

from harness.core.errors import ConfigError
from harness.models.topology import ModelShape, predict
from harness.run.config import E2EConfig
from harness.run.preflight import (
    check_config,
    config_heads,
    preflight,
    preflight_config,
)

GPU: dict[str, Any] = dict(device="gpu")


def problems_of(*args, **kw) -> list[str]:
    return list(preflight(*args, **kw).problems)


CPU8 = dict(device="cpu", cpu_cores=8)


def one(problems: list[str], *words: str) -> str:
    """The single problem that contains every word."""
    hits = [p for p in problems if all(w in p for w in words)]
    assert len(hits) == 1, problems
    assert "\n" not in hits[0]
    return hits[0]


def test_a_valid_pair_has_no_problem_and_a_prediction():
    pf = preflight(4, 1, 1, 2, device="cpu", cpu_cores=2, vllm_version="0.21.0")
    assert pf.ok and pf.problems == () and pf.topology is not None
    assert (pf.topology.regime, pf.topology.expected) == ("B", "assert-45330")
    t = preflight(4, 1, 1, 2, device="cpu", cpu_cores=2, vllm_version="0.32.0").topology
    assert t is not None and t.expected == "ok"


def test_tp_must_divide_the_attention_heads():
    msg = one(problems_of(4, 4, 1, 3, **GPU), "decode TP 3", "4 attention heads")
    assert "does not divide" in msg
    one(problems_of(32, 8, 6, 12, **GPU), "prefill TP 6")


def test_tp_above_k_must_be_a_multiple_of_k():
    # 12 heads, K=4: TP 6 divides the heads but 6 % 4 != 0.
    msg = one(problems_of(12, 4, 6, 6, **GPU), "prefill TP 6", "4 KV heads")
    assert "multiple" in msg
    assert problems_of(12, 4, 4, 12, **GPU) == []  # 12 > K=4 and 12 % 4 == 0


def test_larger_tp_must_be_a_multiple_of_the_smaller():
    # 12 heads, K=12: TP 4 and 6 each divide the heads, 6 % 4 != 0.
    one(problems_of(12, 12, 4, 6, **GPU), "larger must be a multiple of the smaller")


def test_prefill_block_size_must_divide_decode():
    one(problems_of(4, 1, 1, 1, 32, 48, **GPU), "prefill block size 32", "decode block size 48")
    assert problems_of(4, 1, 1, 1, 16, 32, **GPU) == []  # GPU: 16 is fine
    assert problems_of(4, 1, 1, 1, 32, 64, **CPU8) == []


def test_cpu_block_sizes_must_be_multiples_of_32():
    msg = one(problems_of(4, 1, 1, 1, 16, 16, **CPU8), "prefill block size 16", "32")
    assert msg.startswith("cannot run on this CPU machine:")
    one(problems_of(4, 1, 1, 1, 16, 16, **CPU8), "decode block size 16")
    assert problems_of(4, 1, 1, 1, None, None, **CPU8) == []  # the harness default (32)


def test_cpu_tp_above_the_cores_cannot_run_here():
    msg = one(problems_of(4, 1, 1, 4, device="cpu", cpu_cores=2), "decode TP 4")
    assert msg == "cannot run on this CPU machine: decode TP 4 needs 4 CPU cores, this machine has 2"
    assert problems_of(4, 1, 1, 4, device="gpu", cpu_cores=2) == []  # cores do not bound GPU ranks
    assert problems_of(4, 1, 2, 2, device="cpu", cpu_cores=2) == []


def test_rejected_by_design_is_not_a_problem():
    # Regime D (K < P, P > D): vLLM refuses it at the handshake on purpose; the matrix runs it to see that.
    pf = preflight(4, 1, 2, 1, device="cpu", cpu_cores=2)
    assert pf.ok and pf.topology is not None
    assert (pf.topology.regime, pf.topology.expected) == ("D", "rejected")


def test_unknown_heads_skip_head_checks_but_not_the_rest():
    assert problems_of(None, None, 3, 3, **GPU) == []
    assert preflight(None, None, 1, 1, **GPU).topology is None
    one(problems_of(None, None, 2, 3, **GPU), "larger must be a multiple")
    one(problems_of(None, None, 1, 4, device="cpu", cpu_cores=2), "cannot run on this CPU machine")


def test_bad_tp_values_are_problems_not_crashes():
    one(problems_of(4, 1, 0, 1, **GPU), "prefill TP must be a positive integer")


@pytest.mark.parametrize("heads,k", [(4, 1), (8, 2), (12, 4), (32, 8), (16, 16)])
def test_head_and_ratio_problems_agree_with_the_topology_math(heads, k):
    # Independent of the preflight wording: a pair is refused iff harness/models/topology.py calls it invalid.
    for p, d in itertools.product(range(1, 17), repeat=2):
        problems = problems_of(heads, k, p, d, **GPU)
        valid = predict(ModelShape(heads, k), p, d).valid
        assert (problems == []) == valid, (heads, k, p, d, problems)


def test_preflight_message_is_one_line():
    msg = preflight(4, 1, 1, 3, device="cpu", cpu_cores=2).message()
    assert "\n" not in msg and "decode TP 3" in msg and "cannot run on this CPU machine" in msg
    assert preflight(4, 1, 1, 2, device="cpu", cpu_cores=2).ok


def test_config_heads_without_building_anything(tmp_path, monkeypatch):
    import harness.models.tiny as tm

    def no_build(*a, **k):
        raise AssertionError("preflight must not build a model")

    monkeypatch.setattr(tm, "ensure_tiny_model", no_build)
    assert config_heads(E2EConfig(device="cpu")) == (4, 1)  # the tiny model's shape, from its spec
    from harness.accuracy.settings import AccuracySettings

    assert config_heads(E2EConfig(device="cpu", accuracy=AccuracySettings())) == (4, 1)  # the trained one's
    (tmp_path / "config.json").write_text('{"num_attention_heads": 12, "num_key_value_heads": 4}')
    assert config_heads(E2EConfig(device="gpu", model=str(tmp_path))) == (12, 4)
    assert config_heads(E2EConfig(device="gpu", model="TinyLlama/TinyLlama-1.1B-Chat-v1.0")) == (32, 4)
    assert config_heads(E2EConfig(device="gpu", model="nobody/unknown-model")) == (None, None)


def test_check_config_for_a_run():
    with pytest.raises(ConfigError, match="decode TP 3 does not divide"):
        check_config(E2EConfig(device="cpu", tp_d=3), cpu_cores=4)
    t = preflight_config(E2EConfig(device="cpu", tp_p=2, tp_d=1), cpu_cores=2).topology
    assert t is not None and t.expected == "rejected"


def test_the_predicted_topology_carries_ps_stages_and_ds_dcp_and_refuses_a_dcp_short_of_ds_tp():
    t = preflight(4, 1, 1, 2, cpu_cores=8, pp_p=2, dcp_d=2).topology
    assert t is not None and (t.pp_p, t.dcp_d) == (2, 2) and t.d_sources[1] == ((0, 0), (1, 0))
    bad = preflight(4, 1, 1, 4, cpu_cores=8, dcp_d=2).topology
    assert bad is not None and bad.expected == "invalid"
