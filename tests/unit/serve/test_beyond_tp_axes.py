"""The axes beyond TP (issue: spec decode, chunked prefill on P): each reaches the servers it is for, the baseline
included where the comparison needs it, and a value that cannot work is refused where it is declared."""

from __future__ import annotations

import json

import pytest

from harness.cli import build_parser, config_from_args
from harness.core.errors import ConfigError
from harness.matrix.config import EDGE_YAML as EDGE
from harness.matrix.config import load_matrix
from harness.run.config import E2EConfig
from harness.run.launch import WantedServer, make_server
from harness.serve.axes import ServerAxes
from harness.serve.ports import PortAllocator

NGRAM = '{"method":"ngram","num_speculative_tokens":2,"prompt_lookup_max":3}'


def argv_of(cfg: E2EConfig, role: str, tmp_path) -> list[str]:
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        want = WantedServer(role=role, tp=1, model="/m", served_name="m", block_size=None, cpu_bind=None)
        srv = make_server(cfg, alloc, want, tmp_path)
    return list(srv.proc.spec.argv)


def value(argv: list[str], flag: str) -> str | None:
    return argv[argv.index(flag) + 1] if flag in argv else None


def test_spec_decode_reaches_every_server_and_chunked_prefill_only_p(tmp_path):
    cfg = E2EConfig(python="python3", axes=ServerAxes(speculative_config=NGRAM, max_num_batched_tokens_p=64))
    argv = {role: argv_of(cfg, role, tmp_path / role) for role in ("prefill", "decode", "baseline")}
    assert all(value(a, "--speculative-config") == NGRAM for a in argv.values())  # the baseline decodes alike
    assert value(argv["prefill"], "--max-num-batched-tokens") == "64"
    assert value(argv["decode"], "--max-num-batched-tokens") is None
    assert value(argv["baseline"], "--max-num-batched-tokens") is None
    plain = argv_of(E2EConfig(python="python3"), "decode", tmp_path / "plain")
    assert "--speculative-config" not in plain and "--max-num-batched-tokens" not in plain


def cli(*args: str) -> E2EConfig:
    return config_from_args(build_parser().parse_args(["e2e", "--device", "cpu", *args]), env={}, preflight=False)


def test_the_flags_build_the_axes_and_bad_values_are_one_line_errors():
    a = cli("--speculative-config", NGRAM, "--max-num-batched-tokens-p", "48").axes
    assert (a.speculative_config, a.max_num_batched_tokens_p) == (NGRAM, 48)
    assert a.set() == {"speculative_config": NGRAM, "max_num_batched_tokens_p": 48}
    for bad, says in (("{not json", "not JSON"), ('{"num_speculative_tokens": 2}', '"method"'), ("[1]", '"method"')):
        with pytest.raises(ConfigError, match=says):
            cli("--speculative-config", bad)


def test_a_matrix_entry_takes_the_axes_and_refuses_a_config_without_a_method(tmp_path):
    head = "entries:\n  - id: x\n    model: tiny-llama\n    device: cpu\n    tp_p: 1\n    tp_d: 2\n"
    tail = "    expected: {pre-fix: assert-45330, fixed: ok}\n"
    good = tmp_path / "good.yaml"
    good.write_text(head + f"    axes: {{speculative_config: '{NGRAM}', max_num_batched_tokens_p: 64}}\n" + tail)
    entry = load_matrix(good)[0].entries[0]
    assert entry.settings() == {"speculative_config": NGRAM, "max_num_batched_tokens_p": 64}
    bad = tmp_path / "bad.yaml"
    bad.write_text(head + "    axes: {speculative_config: '{\"k\": 1}'}\n" + tail)
    with pytest.raises(ConfigError, match="method"):
        load_matrix(bad)


def test_model_in_a_speculative_config_is_the_runs_own_model(tmp_path):
    draft = '{"method":"draft_model","model":"{model}","num_speculative_tokens":2}'
    cfg = E2EConfig(python="python3", axes=ServerAxes(speculative_config=draft))
    assert value(argv_of(cfg, "decode", tmp_path), "--speculative-config") == (
        '{"method":"draft_model","model":"/m","num_speculative_tokens":2}'
    )


NOROPE = '{"custom_ops":["-rotary_embedding"]}'


def test_a_compilation_config_reaches_every_server_the_baseline_included(tmp_path):
    cfg = E2EConfig(python="python3", axes=ServerAxes(compilation_config=NOROPE))
    for role in ("prefill", "decode", "baseline"):  # the baseline computes alike, so the comparison tests P/D only
        assert value(argv_of(cfg, role, tmp_path / role), "--compilation-config") == NOROPE
    assert "--compilation-config" not in argv_of(E2EConfig(python="python3"), "decode", tmp_path / "plain")


def test_the_compilation_config_flag_and_entry_axis_are_validated_where_declared(tmp_path):
    assert cli("--compilation-config", NOROPE).axes.set() == {"compilation_config": NOROPE}
    for bad, says in (("{oops", "compilation_config is not JSON"), ('["-rotary_embedding"]', "JSON object")):
        with pytest.raises(ConfigError, match=says):
            cli("--compilation-config", bad)
    head = "entries:\n  - id: x\n    model: tiny-llama\n    device: cpu\n    tp_p: 1\n    tp_d: 2\n"
    tail = "    expected: {pre-fix: assert-45330, fixed: ok}\n"
    bad = tmp_path / "bad.yaml"
    bad.write_text(head + "    axes: {compilation_config: 'custom_ops'}\n" + tail)
    with pytest.raises(ConfigError, match=r"entries\.0 \(x\): compilation_config is not JSON"):
        load_matrix(bad)


def ports_of(cfg: E2EConfig, role: str, tmp_path) -> tuple[list[str], dict[str, str]]:
    with PortAllocator(lock_dir=tmp_path / "locks") as alloc:
        want = WantedServer(role=role, tp=1, model="/m", served_name="m", block_size=None, cpu_bind=None)
        srv = make_server(cfg, alloc, want, tmp_path)
    return list(srv.proc.spec.argv), dict(srv.proc.spec.env)


def test_data_parallel_d_reaches_d_and_the_baseline_with_a_port_of_the_harness_and_not_p(tmp_path):
    cfg = E2EConfig(python="python3", axes=ServerAxes(data_parallel_size_d=2))
    for role in ("decode", "baseline"):  # the baseline serves D's settings, DP included
        argv, _ = ports_of(cfg, role, tmp_path / role)
        assert value(argv, "--data-parallel-size") == "2"
        rpc = value(argv, "--data-parallel-rpc-port")  # vLLM's default (29550) would clash between two runs
        assert rpc is not None and int(rpc) != int(value(argv, "--port") or 0)
    argv, _ = ports_of(cfg, "prefill", tmp_path / "prefill")
    assert "--data-parallel-size" not in argv and "--data-parallel-rpc-port" not in argv
    assert "--data-parallel-size" not in ports_of(E2EConfig(python="python3"), "decode", tmp_path / "plain")[0]


def test_data_parallel_d_is_a_flag_and_an_entry_axis():
    assert cli("--data-parallel-size-d", "2").axes.set() == {"data_parallel_size_d": 2}
    entry = next(e for e in load_matrix(EDGE)[0].entries if e.id == "edge-dp2-d-k1-p1-d1")
    assert entry.settings() == {"data_parallel_size_d": 2}
    with pytest.raises(SystemExit):
        cli("--data-parallel-size-d", "0")


def test_pipeline_stages_reach_p_only_and_dcp_d_and_the_baseline(tmp_path):
    cfg = E2EConfig(
        python="python3", tp_d=2, axes=ServerAxes(pipeline_parallel_size_p=2, decode_context_parallel_size_d=2)
    )
    argv = {role: argv_of(cfg, role, tmp_path / role) for role in ("prefill", "decode", "baseline")}
    assert value(argv["prefill"], "--pipeline-parallel-size") == "2"
    assert value(argv["prefill"], "--decode-context-parallel-size") is None
    for role in ("decode", "baseline"):  # the baseline runs D's DCP too: the same feature without P/D
        assert value(argv[role], "--decode-context-parallel-size") == "2"
        assert value(argv[role], "--pipeline-parallel-size") is None
    assert cfg.ranks("prefill") == 2  # P's CPU binding and ports count both stages
    with pytest.raises(ConfigError, match="decode context parallel size 2 must divide D's TP size 1"):
        E2EConfig(axes=ServerAxes(decode_context_parallel_size_d=2))


def test_kv_offload_wraps_nixl_in_a_multiconnector_on_p_and_d_not_the_baseline(tmp_path):
    import json

    cfg = E2EConfig(python="python3", axes=ServerAxes(kv_offload_bytes=1 << 30))
    kv = {role: value(argv_of(cfg, role, tmp_path / role), "--kv-transfer-config") for role in ("prefill", "decode")}
    for text in kv.values():
        assert text is not None
        multi = json.loads(text)
        nixl, offload = multi["kv_connector_extra_config"]["connectors"]
        assert multi["kv_connector"] == "MultiConnector" and multi["kv_role"] == nixl["kv_role"] == offload["kv_role"]
        assert nixl["kv_connector"] == "NixlConnector" and nixl["kv_load_failure_policy"] == "fail"
        assert offload == {
            "kv_connector": "OffloadingConnector",
            "kv_role": multi["kv_role"],
            "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30},
        }
    assert "--kv-transfer-config" not in argv_of(cfg, "baseline", tmp_path / "baseline")
    plain = json.loads(
        value(argv_of(E2EConfig(python="python3"), "decode", tmp_path / "plain"), "--kv-transfer-config") or ""
    )
    assert plain["kv_connector"] == "NixlConnector"


@pytest.mark.parametrize(
    "line",
    [
        "AssertionError: Decode Context Parallelism (DCP) requires attention implementations to return the softmax LSE "
        "during decode, but CPUMLAImpl does not. Try a different backend by setting --attention-backend or disable "
        "DCP.",
        "Exception: CPU Offloading is currently only supported on CUDA-alike and XPU GPUs",
        # vLLM's VllmConfig (config/vllm.py), on any device: DCP through P/D on a model without MLA
        "pydantic_core._pydantic_core.ValidationError: 1 validation error for VllmConfig\n  Assertion failed, PD with "
        "decode_context_parallel_size > 1 is only supported for MLA models. [type=assertion_error, input_value=...]",
    ],
)
def test_vllm_cpus_refusals_of_dcp_and_offloading_are_unsupported(line):
    from harness.checks.classify import classify

    assert classify({"decode": f"INFO starting\n{line}\n"}).cls == "unsupported"
    assert classify({"decode": "INFO starting\nException: the engine core died\n"}).cls != "unsupported"


def test_expert_parallel_reaches_d_and_the_baseline_not_p_and_needs_more_than_one_rank(tmp_path):
    cfg = E2EConfig(python="python3", tp_d=2, axes=ServerAxes(expert_parallel_d=True))
    argv = {role: argv_of(cfg, role, tmp_path / role) for role in ("prefill", "decode", "baseline")}
    assert "--enable-expert-parallel" not in argv["prefill"]  # P keeps its experts whole, as upstream's P/D EP runs
    assert all("--enable-expert-parallel" in argv[r] for r in ("decode", "baseline"))  # the same feature without P/D
    assert "--enable-expert-parallel" not in argv_of(E2EConfig(python="python3"), "decode", tmp_path / "plain")
    assert cli("--tp-d", "2", "--expert-parallel-d").axes.set() == {"expert_parallel_d": True}
    with pytest.raises(ConfigError, match="--expert-parallel-d needs D on more than one rank"):
        cli("--expert-parallel-d")  # D at TP 1, DP 1: every expert local
    assert E2EConfig(axes=ServerAxes(expert_parallel_d=True, data_parallel_size_d=2)).ranks("decode") == 2


def test_the_expert_parallel_check_wants_an_ep_group_of_all_d_ranks_each_holding_a_share():
    from harness.checks.expert_parallel import check_d_expert_parallel

    def line(rank: int, size: int, local: int) -> str:  # vLLM 0.32.0's wording (fused_moe/layer.py)
        return (
            f"(Worker_TP{rank} pid=1) INFO [layer.py:251] [EP Rank {rank}/{size}] Expert parallelism is enabled. "
            f"Expert placement strategy: linear. Local/global number of experts: {local}/4. Experts local to "
            "global index map: 0->0, 1->1.\n"
        )

    # vLLM logs it from each node's first rank only (info_once, scope "local"): on one host, rank 0's line
    ok = check_d_expert_parallel({"decode": line(0, 2, 2)}, 2)
    assert ok.passed and ok.data == {"0": {"ep_size": 2, "local": 2, "global": 4}}
    assert check_d_expert_parallel({"decode": line(0, 2, 2) + line(1, 2, 2)}, 2).passed  # both, where both log
    assert not check_d_expert_parallel({"decode": line(0, 2, 4)}, 2).passed  # every expert on the rank
    small = check_d_expert_parallel({"decode": line(0, 2, 2)}, 4)  # EP over 2 of D's 4 ranks
    assert not small.passed and "not over its 4 ranks" in small.detail
    none = check_d_expert_parallel({"decode": "INFO Starting vLLM API server\n"}, 2)
    assert not none.passed and "did not take effect" in none.detail


def test_shrink_carries_expert_parallel():
    from harness.shrink.cli import start_of

    cfg = {"tp_p": 1, "tp_d": 2, "device": "cpu", "seed": 0, "axes": {"expert_parallel_d": True}}
    carried = start_of({"verdict": "fail", "failure": {"class": "decode-died"}, "config": cfg})[2]
    assert "--expert-parallel-d" in carried  # every probe keeps EP; the search moves TP, blocks and prompts


def test_p_can_draft_fewer_tokens_than_d_as_upstreams_spec_decode_test_runs_it(tmp_path):
    # upstream's P/D acceptance test: P at num_speculative_tokens 1, D at 3; the baseline decodes as D does
    cfg = cli(
        "--speculative-config",
        '{"method":"draft_model","model":"{model}","num_speculative_tokens":2}',
        "--speculative-tokens-p",
        "1",
    )
    argv = {role: argv_of(cfg, role, tmp_path / role) for role in ("prefill", "decode", "baseline")}
    got = {role: json.loads(value(a, "--speculative-config") or "{}") for role, a in argv.items()}
    assert got["prefill"] == {"method": "draft_model", "model": "/m", "num_speculative_tokens": 1}
    assert got["decode"]["num_speculative_tokens"] == got["baseline"]["num_speculative_tokens"] == 2
    assert cfg.axes.spec_tokens == 2  # D's placeholder drafts are counted with D's tokens
    with pytest.raises(ConfigError, match="needs speculative_config"):
        cli("--speculative-tokens-p", "1")
    from harness.shrink.cli import start_of

    carried = start_of({"verdict": "fail", "failure": {"class": "x"}, "config": {"axes": cfg.axes.to_dict()}})[2]
    assert carried[carried.index("--speculative-tokens-p") + 1] == "1"
