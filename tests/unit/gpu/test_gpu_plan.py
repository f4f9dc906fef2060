import itertools

import pytest

from harness.gpu.plan import (
    GIB,
    HEADROOM_GIB,
    MAX_UTIL,
    Gpu,
    ModelMemory,
    PlanError,
    model_memory,
    plan_gpus,
    render_plan,
    uniform_gpus,
)
from harness.models.config import load_models

TINYLLAMA = "TinyLlama/TinyLlama-1.1B-Chat-v1.0"


def per_gpu_sums(plan, phase="pd"):
    sums: dict[int, float] = {}
    for s in plan.phase(phase):
        for g in s.gpus:
            sums[g] = sums.get(g, 0.0) + s.gpu_memory_utilization
    return sums


def assert_sound(plan):
    """What any plan must satisfy: one GPU per rank, shares within budget and covering each rank's need."""
    mem = {g.id: g.total_gib for g in plan.gpus}
    for s in plan.servers:
        assert len(s.gpus) == s.tp and len(set(s.gpus)) == s.tp, s
        assert all(g in mem for g in s.gpus)
        assert all(s.gpu_memory_utilization * mem[g] >= s.need_gib_per_gpu for g in s.gpus), s
    for phase in plan.order:
        assert all(v <= plan.max_util + 1e-9 for v in per_gpu_sums(plan, phase).values())


def test_disjoint_when_ranks_fit():
    plan = plan_gpus(uniform_gpus(8, 80), 2, 4, model_memory(TINYLLAMA))
    p, d = plan.server("prefill"), plan.server("decode")
    assert not plan.colocated and not plan.stagger_start
    assert p.gpus == (0, 1) and d.gpus == (2, 3, 4, 5)
    assert p.gpu_memory_utilization == d.gpu_memory_utilization == MAX_UTIL
    assert_sound(plan)


def test_p2_d8_on_8_gpus_is_colocated_with_a_memory_budget():
    plan = plan_gpus(uniform_gpus(8, 80), 2, 8, model_memory(TINYLLAMA))
    p, d = plan.server("prefill"), plan.server("decode")
    assert plan.colocated and plan.stagger_start
    assert sorted(d.gpus) == list(range(8))  # decode gets all 8
    assert set(p.gpus) <= set(d.gpus) and len(p.gpus) == 2  # prefill shares 2 of them
    sums = per_gpu_sums(plan)
    assert all(sums[g] <= 0.9 + 1e-9 for g in range(8))
    assert max(sums.values()) > 0.85  # the shared GPUs' budget is used, not wasted
    assert_sound(plan)
    assert p.cuda_visible_devices == ",".join(map(str, p.gpus))


def test_baseline_runs_alone_at_d_tp_on_d_gpus():
    plan = plan_gpus(uniform_gpus(8, 80), 2, 8, model_memory(TINYLLAMA))
    b, d = plan.server("baseline"), plan.server("decode")
    assert plan.baseline_alone and plan.order == ("baseline", "pd")
    assert b.tp == 8 and b.gpus == d.gpus and b.phase == "baseline"
    assert plan.servers[0] is b
    later = plan_gpus(uniform_gpus(8, 80), 2, 8, model_memory(TINYLLAMA), baseline_first=False)
    assert later.order == ("pd", "baseline") and later.servers[-1].role == "baseline"


def test_tp_larger_than_gpus_is_refused_with_what_fits():
    with pytest.raises(PlanError, match=r"decode TP 16 needs 16 GPUs.*8 present.*largest TP here is 8"):
        plan_gpus(uniform_gpus(8, 80), 8, 16, model_memory(TINYLLAMA))


def test_n_by_m_instances_disjoint():
    plan = plan_gpus(uniform_gpus(8, 80), 2, 4, model_memory(TINYLLAMA), num_p=2, num_d=1)
    pd = plan.phase("pd")
    assert [s.name for s in pd] == ["prefill0", "prefill1", "decode0"]
    assert not plan.colocated
    used = [g for s in pd for g in s.gpus]
    assert sorted(used) == list(range(8))  # pairwise disjoint and every GPU used
    assert_sound(plan)


def test_n_by_m_instances_colocated_keep_every_gpu_within_budget():
    plan = plan_gpus(uniform_gpus(6, 80), 2, 4, model_memory(TINYLLAMA), num_p=2, num_d=1)
    assert plan.colocated
    assert_sound(plan)
    assert plan.server("prefill", 1).gpu_memory_utilization == MAX_UTIL  # its GPUs are not shared


def test_memory_too_small_even_alone_says_what_gpu_would_do():
    with pytest.raises(
        PlanError,
        match=r"prefill0 \(TP 2\) needs 15\.0 GiB.*10 GPUs of >= 17 GiB \(P and D apart\), "
        r"or colocated on 8 GPUs of >= 34 GiB, or a larger TP",
    ):
        plan_gpus(uniform_gpus(8, 8), 2, 8, ModelMemory(20.0, "given"))
    with pytest.raises(
        PlanError, match=r"prefill0 \(TP 2\) needs 15\.0 GiB.*: it needs GPUs of >= 17 GiB, or a larger "
    ):
        plan_gpus(uniform_gpus(10, 8), 2, 8, ModelMemory(20.0, "given"))  # P and D apart: no sharing to mention


@pytest.mark.parametrize("mem", [80, 85])
def test_the_refusals_advice_is_a_box_that_plans(mem):
    """Issue 35 item 8: P2+D8 of a 131 GiB model on 8 x 80 GiB said "needs GPUs of >= 85 GiB", and at 85 it said
    ">= 170": GPUs of 85 GiB are still shared by P and D. Each size the refusal names must plan."""
    import re

    memory = ModelMemory(131.0, "given")
    with pytest.raises(PlanError) as e:
        plan_gpus(uniform_gpus(8, mem), 2, 8, memory)
    msg = str(e.value)
    apart = re.search(r"(\d+) GPUs(?: of >= (\d+) GiB)? \(P and D apart\)", msg)
    shared = re.search(r"colocated on (\d+) GPUs of >= (\d+) GiB", msg)
    assert apart and shared, msg
    plan_gpus(uniform_gpus(int(apart[1]), float(apart[2] or mem)), 2, 8, memory)  # P and D apart: it plans
    assert not plan_gpus(uniform_gpus(int(apart[1]), float(apart[2] or mem)), 2, 8, memory).colocated
    plan_gpus(uniform_gpus(int(shared[1]), float(shared[2])), 2, 8, memory)  # colocated: it plans
    with pytest.raises(PlanError):
        plan_gpus(uniform_gpus(int(shared[1]), float(shared[2]) - 1), 2, 8, memory)  # and it is the least


def test_memory_too_small_colocated_but_fits_apart_says_how_many_gpus():
    # 10 GiB weights at TP 2: 9.5 GiB per rank; 0.45 x 16 GiB = 7.2 shared, 0.9 x 16 = 14.4 alone.
    with pytest.raises(PlanError, match=r"fits with 10 GPUs \(P and D apart\)"):
        plan_gpus(uniform_gpus(8, 16), 2, 8, ModelMemory(10.0, "given"))
    plan_gpus(uniform_gpus(10, 16), 2, 8, ModelMemory(10.0, "given"))  # and it does


def test_gpu_ids_come_from_the_list_given():
    plan = plan_gpus((Gpu(4, 80), Gpu(5, 80), Gpu(6, 80), Gpu(7, 80)), 1, 2, ModelMemory(1.0, "given"))
    assert plan.server("prefill").gpus == (4,) and plan.server("decode").gpus == (5, 6)


def test_smaller_gpu_in_a_mixed_set_limits_the_share():
    gpus = (Gpu(0, 80), Gpu(1, 10))
    # D (TP 2) spans both GPUs and shares GPU 0 with P: 0.45 of the 10 GiB GPU is 4.5 GiB, a rank needs 4.55.
    with pytest.raises(PlanError, match=r"decode0 \(TP 2\) needs 4\.5.*0\.45 x 10 GiB"):
        plan_gpus(gpus, 1, 2, ModelMemory(1.0, "given"))
    plan_gpus(gpus, 1, 2, ModelMemory(0.5, "given"))  # 4.275 GiB fits


@pytest.mark.parametrize("bad", [dict(tp_p=0), dict(num_d=0), dict(max_util=0), dict(max_util=1.5)])
def test_bad_inputs_are_plan_errors(bad):
    kw = dict(tp_p=1, tp_d=1, num_p=1, num_d=1, max_util=0.9) | bad
    with pytest.raises(PlanError):
        plan_gpus(
            uniform_gpus(2, 80),
            kw["tp_p"],
            kw["tp_d"],
            ModelMemory(1, "given"),
            kw["num_p"],
            kw["num_d"],
            kw["max_util"],
        )


def test_no_gpus_and_repeated_ids_are_refused():
    with pytest.raises(PlanError, match="no GPUs"):
        plan_gpus((), 1, 1, ModelMemory(1, "given"))
    with pytest.raises(PlanError, match="repeat"):
        plan_gpus((Gpu(0, 80), Gpu(0, 80)), 1, 1, ModelMemory(1, "given"))


@pytest.mark.parametrize(
    "n,tp_p,tp_d,num_p,num_d",
    [
        (n, tp_p, tp_d, num_p, num_d)
        for n, tp_p, tp_d, num_p, num_d in itertools.product([1, 2, 4, 8], [1, 2, 4, 8], [1, 2, 4, 8], [1, 2], [1, 2])
        if tp_p <= n and tp_d <= n
    ],
)
def test_every_feasible_layout_is_sound(n, tp_p, tp_d, num_p, num_d):
    assert_sound(plan_gpus(uniform_gpus(n, 80), tp_p, tp_d, model_memory(TINYLLAMA), num_p, num_d))


def test_required_free_is_the_busier_phase_per_gpu():
    plan = plan_gpus(uniform_gpus(8, 80), 2, 8, model_memory(TINYLLAMA))
    free = plan.required_free_gib()
    assert free == {g: pytest.approx(72.0) for g in range(8)}  # 0.45 + 0.45 on GPUs 0, 1; 0.9 baseline everywhere
    assert plan.required_free_gib("pd")[2] == pytest.approx(36.0)


def test_model_memory_from_models_yaml_scales_with_dtype():
    bf16 = model_memory(TINYLLAMA)
    assert bf16.weights_gib == pytest.approx(1.10e9 * 2 / GIB)
    assert "configs/models.yaml" in bf16.source
    assert model_memory(TINYLLAMA, "float32").weights_gib == pytest.approx(2 * bf16.weights_gib)


def test_model_memory_of_a_local_folder_is_its_weight_files(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\0" * 3000)
    (tmp_path / "config.json").write_text("{}")
    assert model_memory(str(tmp_path)).weights_gib == pytest.approx(3000 / GIB)


def test_model_memory_unknown_or_given():
    with pytest.raises(PlanError, match="params_b"):
        model_memory("someone/unknown-model")
    assert model_memory("someone/unknown-model", weights_gib=3.0).weights_gib == 3.0
    assert model_memory(None).weights_gib == 0
    assert ModelMemory(0, "x").need_per_rank_gib(4) == HEADROOM_GIB
    with pytest.raises(PlanError, match="dtype"):
        model_memory(TINYLLAMA, "int3")


def test_every_hub_model_has_a_size():
    for m in load_models().models:
        assert (m.params_b is not None) == (m.hub_id is not None), m.id


def test_render_shows_cuda_visible_devices_per_server():
    text = render_plan(plan_gpus(uniform_gpus(8, 80), 2, 8, model_memory(TINYLLAMA)))
    assert "colocated" in text and "CUDA_VISIBLE_DEVICES" in text
    assert "prefill0     2  0,1 " in text
    assert "GPU 0: prefill0 0.45 + decode0 0.45 = 0.90" in text


def test_to_dict_is_json_ready():
    import json

    d = json.loads(json.dumps(plan_gpus(uniform_gpus(8, 80), 2, 8, model_memory(TINYLLAMA)).to_dict()))
    assert d["colocated"] is True and d["baseline_alone"] is True and d["order"] == ["baseline", "pd"]
    assert {(s["role"], s["index"]) for s in d["servers"]} == {("baseline", 0), ("prefill", 0), ("decode", 0)}
