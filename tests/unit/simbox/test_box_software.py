"""A simulated box's software (harness/simbox/box.py): the torch build its environments hold (torch=) and where
lm-eval is missing (no-lm-eval=), beside its GPUs and driver; what the doctor reads of them is in
tests/unit/doctor/test_simulated_boxes.py."""

from __future__ import annotations

import pytest

from harness.simbox.box import DRIVER, TORCH_CUDA, parse_box, torch_cuda


def test_the_options_join_with_the_gpu_options_and_reach_a_child():
    box = parse_box("8x80:driver=570.86.15:torch=2.11.0+cu130:no-lm-eval=0.21.0,0.26.0:visible=4,5")
    assert (box.driver, box.torch, box.no_lm_eval, box.visible) == (
        "570.86.15",
        "2.11.0+cu130",
        ("0.21.0", "0.26.0"),
        "4,5",
    )
    # a night's step reads the same box through its own CUDA_VISIBLE_DEVICES
    child = parse_box(box.for_child())
    assert (child.torch, child.no_lm_eval, child.driver, child.visible) == (box.torch, box.no_lm_eval, box.driver, None)
    plain = parse_box("8x80")
    assert (plain.driver, plain.torch, plain.no_lm_eval) == (DRIVER, None, ())


def test_the_torch_an_environment_on_the_box_holds():
    assert torch_cuda("2.11.0+cu130") == "13.0" and torch_cuda("2.13.0+cu128") == "12.8"
    assert torch_cuda("2.7.1+cu118") == "11.8" and torch_cuda("2.13.0+cpu") is None
    given = parse_box("8x80:torch=2.13.0+cu128")
    assert given.env_torch("2.13.0+cpu") == ("2.13.0+cu128", "12.8") and given.env_torch(None) == (
        "2.13.0+cu128",
        "12.8",
    )
    assert parse_box("8x80:torch=2.13.0+cpu").env_torch("2.13.0+cu130") == ("2.13.0+cpu", None)
    # by default each environment's own torch version, built for the CUDA the default driver runs
    assert TORCH_CUDA == "13.0" and parse_box("8x40").env_torch("2.13.0+cpu") == ("2.13.0+cu130", "13.0")
    assert parse_box("8x40").env_torch(None) == (None, None)  # no torch there: the box gives it none


def test_lm_eval_is_missing_only_where_the_box_says_and_where_it_was_there():
    box = parse_box("8x80:no-lm-eval=0.21.0")
    assert not box.has_lm_eval("0.21.0", True) and box.has_lm_eval("0.32.0", True)
    assert not parse_box("8x80").has_lm_eval("0.32.0", False)  # the box removes lm-eval, never installs it


@pytest.mark.parametrize(
    "spec",
    [
        "8x80:torch=2.13",  # no local tag: which build, not said
        "8x80:torch=2.13.0+rocm6.2",
        "8x80:torch=2.13.0+cu1",
        "8x80:torch=",
        "8x80:no-lm-eval=",
        "8x80:no-lm-eval=latest",
        "8x80:no-lm-eval=0.21.0,,0.26.0",
    ],
)
def test_a_value_that_describes_no_software_is_refused_saying_what_is_allowed(spec):
    with pytest.raises(ValueError) as e:
        parse_box(spec)
    assert str(e.value).startswith(f"PD_HARNESS_SIMULATED_GPUS={spec!r}: ")
    assert "torch=VERSION+cuNNN|+cpu (e.g. 2.11.0+cu130) or no-lm-eval=VLLM_VERSIONS" in str(e.value)


def test_a_nights_steps_read_the_same_box_software_included(tmp_path):
    """Each GPU step of a night on the box gets its value less visible= (its own CUDA_VISIBLE_DEVICES applies), so a
    step's run, and a doctor run beside it, read the torch and lm-eval the night was given."""
    import sys

    from harness.gpu.plan import uniform_gpus
    from harness.nightly import build_steps
    from harness.simbox.box import SIMULATED_ENV

    spec = "8x80:visible=0,1,2,3,4,5,6,7:driver=570.86.15:torch=2.11.0+cu130:no-lm-eval=0.21.0"
    steps = build_steps(uniform_gpus(8, 80.0), sys.executable, tmp_path, ["0.21.0"], simulated=spec)
    gpu = [s for s in steps if s.gpu_plan is not None]
    assert gpu and {dict(s.env)[SIMULATED_ENV] for s in gpu} == {
        "8x80:driver=570.86.15:torch=2.11.0+cu130:no-lm-eval=0.21.0"
    }
