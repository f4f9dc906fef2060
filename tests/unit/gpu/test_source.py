"""Discovery's one seam (harness/gpu/source.py): the real NVML unless a source installed in its place answers; the
simulated box (harness/simbox) is such a source, and real discovery never imports it."""

from __future__ import annotations

import pytest

from harness.gpu import detect, source
from harness.gpu.nvml import discover
from harness.gpu.source import NvmlSource
from harness.simbox.box import SIMULATED_ENV
from tests.unit.gpu.fake_nvml import FakeNvml, gpus
from tests.unit.test_layout import graph

DISCOVERY = ("harness.gpu.nvml", "harness.gpu.detect", "harness.gpu.source")


@pytest.fixture
def no_source():
    """This process with nothing installed in NVML's place (the test session installs the simulated box)."""
    before = source.use_source(None)
    yield
    source.use_source(before)


def reached(g: dict[str, set[str]], start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        m = todo.pop()
        if m not in seen:
            seen.add(m)
            todo.extend(g.get(m, ()))
    return seen


def test_real_discovery_imports_nothing_of_the_simulated_box():
    g = graph()
    for module in DISCOVERY:
        sim = sorted(m for m in reached(g, module) if m.startswith("harness.simbox"))
        assert not sim, f"{module} reaches {sim}"
    assert "harness.gpu.source" in g["harness.simbox.box"]  # the box plugs in from above, through the seam


def test_without_a_source_the_switch_means_nothing_to_discovery(no_source, monkeypatch, tmp_path):
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: FakeNvml([gpus(3)]))
    d = discover(env={SIMULATED_ENV: "8x80"})
    assert d.available and d.count == 3 and d.simulated is None and "simulated" not in d.describe()
    for i in range(2):  # two GPUs in /proc/driver/nvidia/gpus
        (tmp_path / f"0000:0{i}:00.0").mkdir()
    monkeypatch.setattr(detect, "PROC_GPUS", tmp_path)
    assert detect.count_gpus({SIMULATED_ENV: "8x80"}) == 2


def box(env) -> NvmlSource | None:
    """A source of this test's: a four-GPU module where SEAM=on, GPUs 2 and 3 being the caller's."""
    if env.get("SEAM") == "on":
        return NvmlSource("SEAM=on", "on", FakeNvml([gpus(4)]), visible="2,3")
    if env.get("SEAM") == "bad":
        return NvmlSource("SEAM=bad", "bad", problem="SEAM=bad describes no GPUs")
    return None


def test_an_installed_source_answers_where_it_finds_its_setting(no_source, monkeypatch):
    monkeypatch.setattr("harness.gpu.nvml._real_nvml", lambda: FakeNvml([gpus(1)]))
    source.use_source(box)
    d = discover(env={"SEAM": "on"})
    assert [g.index for g in d.gpus] == [2, 3] and d.host_count == 4 and d.simulated == "on"
    assert d.describe().endswith("[simulated: SEAM=on]")
    assert detect.count_gpus({"SEAM": "on"}) == 2 and detect.has_nvidia_gpu({"SEAM": "on"})
    bad = discover(env={"SEAM": "bad"})
    assert not bad.available and bad.reason == "SEAM=bad describes no GPUs"
    assert bad.simulated == "bad" and bad.describe().endswith("[simulated: SEAM=bad]")
    assert discover(env={}).count == 1  # no setting: the real NVML (here a stand-in)


def test_a_source_whose_nvml_cannot_be_read_is_a_gpu_box_with_none_usable(no_source):
    source.use_source(lambda env: NvmlSource("SEAM=x", "x", FakeNvml(init_error="Driver Not Loaded")))
    assert detect.has_nvidia_gpu({}) and detect.count_gpus({}) == 0
    assert discover(env={}).reason == "no NVIDIA driver: Driver Not Loaded"
