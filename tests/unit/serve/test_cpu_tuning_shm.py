"""The shared-memory queue tuning on both vLLM generations, against stand-ins for vLLM's module."""

import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

SITE = Path(__file__).resolve().parents[3] / "harness" / "serve" / "cpu_tuning" / "sitecustomize.py"


@pytest.fixture
def tuning(monkeypatch):
    monkeypatch.setenv("PD_HARNESS_SHM_BUSY_LOOP_S", "0.0")
    monkeypatch.setenv("PD_HARNESS_SHM_RECHECK_MS", "20")
    spec = importlib.util.spec_from_file_location("pd_tuning_under_test", SITE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(mod)
    yield mod
    sys.meta_path[:] = before  # drop the import hook it installed


def fake_shm(with_recheck: bool):
    class SpinCondition:
        def __init__(self, is_reader):
            self.is_reader, self.busy_loop_s, self.waits = is_reader, 1, []

        def wait(self, timeout_ms=None):
            self.waits.append(timeout_ms)

    m: Any = types.ModuleType("vllm.distributed.device_communicators.shm_broadcast")  # a stand-in, set below
    m.SpinCondition = SpinCondition
    if with_recheck:
        m.SHM_READER_RECHECK_INTERVAL_MS = 5000
    return m


def test_new_vllm_gets_its_recheck_interval_set_and_readers_sleep(tuning, capsys):
    m = fake_shm(with_recheck=True)
    tuning._patch(m)
    reader, writer = m.SpinCondition(True), m.SpinCondition(False)
    assert (reader.busy_loop_s, writer.busy_loop_s) == (0.0, 1)
    assert m.SHM_READER_RECHECK_INTERVAL_MS == 20
    reader.wait(None)
    assert reader.waits == [None]  # vLLM rechecks by itself
    assert "recheck interval set to 20 ms" in capsys.readouterr().err


def test_old_vllm_without_a_recheck_never_waits_unbounded(tuning, capsys):
    # vLLM 0.21 waits forever when a reader's notification is dropped; the tuning bounds each wait instead.
    m = fake_shm(with_recheck=False)
    tuning._patch(m)
    reader = m.SpinCondition(True)
    reader.wait(None)
    reader.wait(5)
    reader.wait(60000)
    assert reader.waits == [20, 5, 20]
    assert "recheck interval set to 20 ms (wait capped)" in capsys.readouterr().err


def test_engine_idle_steps_sleep_longer_and_nothing_else_changes(monkeypatch, capsys):
    monkeypatch.setenv("PD_HARNESS_ENGINE_IDLE_SLEEP_MS", "10")
    spec = importlib.util.spec_from_file_location("pd_tuning_idle_under_test", SITE)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    try:
        spec.loader.exec_module(mod)
        core: Any = types.ModuleType("vllm.v1.engine.core")  # a stand-in, set below
        import time

        core.time = time
        slept: list[float] = []
        monkeypatch.setattr(time, "sleep", slept.append)
        mod._patch(core)
        core.time.sleep(0.001)
        core.time.sleep(0.5)
        assert slept == [0.01, 0.5]
        assert core.time.perf_counter is time.perf_counter
        assert "engine idle sleep set to 10 ms" in capsys.readouterr().err
    finally:
        sys.meta_path[:] = before
