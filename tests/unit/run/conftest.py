"""Every test here sees a Hugging Face hub cache of its own, holding the hub models these tests name (TinyLlama, the
GPU default, and Qwen3-0.6B): the preflight refuses a model this machine does not have, and the machine's own cache
must not decide a unit test."""

import pytest

from tests.unit.models.hub_cache import QWEN3_06B, TINYLLAMA, add_model


@pytest.fixture(scope="session")
def _hub_cache(tmp_path_factory):
    cache = tmp_path_factory.mktemp("hf") / "hub"
    add_model(cache, "TinyLlama/TinyLlama-1.1B-Chat-v1.0", TINYLLAMA)
    add_model(cache, "Qwen/Qwen3-0.6B", QWEN3_06B)
    return cache


@pytest.fixture(autouse=True)
def hub_cache(_hub_cache, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(_hub_cache))
    return _hub_cache
