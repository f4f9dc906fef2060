"""The KV fault injected into a decode server: against a stand-in for vLLM's NIXL worker module, it scales exactly
the received blocks of the first layer, logs each time it fires, and leaves failed receives alone."""

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

INJECT = Path(__file__).resolve().parents[3] / "harness" / "serve" / "inject"
FAULTS = INJECT / "pd_kv_fault.py"
SITE = INJECT / "sitecustomize.py"


@dataclass
class Results:
    finished_recving: set = field(default_factory=set)
    failed_recving: set = field(default_factory=set)


@dataclass
class Meta:
    local_block_ids: tuple


def fake_worker_module():
    m: Any = types.ModuleType("vllm.distributed.kv_transfer.kv_connector.v1.nixl.base_worker")  # a stand-in

    class NixlBaseConnectorWorker:
        num_blocks = 6

        def __init__(self):
            self._recving_metadata = {}
            self.next_results = Results()

        def register_kv_caches(self, kv_caches):
            self.registered = kv_caches

        def get_transfer_results(self):
            for r in self.next_results.finished_recving:
                self._recving_metadata.pop(r, None)  # as vLLM does: the metadata is gone after the call
            return self.next_results

    m.NixlBaseConnectorWorker = NixlBaseConnectorWorker
    return m


@pytest.fixture
def fault(monkeypatch, tmp_path):
    monkeypatch.setenv("PD_HARNESS_FAULT_KV_SCALE", "2.0")
    monkeypatch.setattr(sys, "path", [str(FAULTS.parent), str(tmp_path)])  # no other sitecustomize to chain to
    spec = importlib.util.spec_from_file_location("pd_fault_under_test", FAULTS)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    before = list(sys.meta_path)
    spec.loader.exec_module(mod)
    yield mod
    sys.meta_path[:] = before


def test_received_blocks_of_the_first_layer_are_scaled_and_logged(fault, capsys):
    m = fake_worker_module()
    fault._patch_worker(m.NixlBaseConnectorWorker, 2.0)
    w = m.NixlBaseConnectorWorker()
    caches = {"layers.0": torch.ones(2, 6, 4, 8), "layers.1": torch.ones(2, 6, 4, 8)}  # (K/V, blocks, tokens, dim)
    w.register_kv_caches(caches)
    assert w.registered is caches
    w._recving_metadata = {"r1": Meta(([1, 3],)), "r2": Meta(([5],))}
    w.next_results = Results({"r1", "r2"}, {"r2"})
    w.get_transfer_results()
    first = caches["layers.0"]
    assert torch.all(first[:, [1, 3]] == 2.0) and torch.all(first[:, [0, 2, 4, 5]] == 1.0), (
        "only r1's blocks, both K and V"
    )
    assert torch.all(caches["layers.1"] == 1.0), "the other layers are untouched"
    err = capsys.readouterr().err
    assert "scaled the received KV of layer layers.0 by 2.0: 2 blocks of request r1" in err and "r2" not in err


def test_it_does_nothing_without_its_variable(monkeypatch, tmp_path):
    for name in ("PD_HARNESS_FAULT_KV_SCALE", "PD_HARNESS_FAULT_SWAP_HEADS", "PD_HARNESS_KV_DIGEST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(sys, "path", [str(INJECT), str(tmp_path)])
    before = list(sys.meta_path)
    spec = importlib.util.spec_from_file_location("pd_fault_off", SITE)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    assert sys.meta_path == before


def test_it_chains_to_the_next_sitecustomize(monkeypatch, tmp_path):
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['PD_CHAINED'] = 'yes'\n")
    monkeypatch.delenv("PD_HARNESS_FAULT_KV_SCALE", raising=False)
    monkeypatch.delenv("PD_CHAINED", raising=False)
    monkeypatch.setattr(sys, "path", [str(INJECT), str(tmp_path)])
    spec = importlib.util.spec_from_file_location("pd_fault_chain", SITE)
    assert spec is not None and spec.loader is not None
    spec.loader.exec_module(importlib.util.module_from_spec(spec))
    import os

    assert os.environ.get("PD_CHAINED") == "yes"


def test_older_vllm_reports_finished_receives_from_get_finished(fault, capsys):
    """vLLM 0.26 has no get_transfer_results: get_finished() -> (sending, receiving) is wrapped instead."""
    m = fake_worker_module()
    cls = m.NixlBaseConnectorWorker
    del cls.get_transfer_results

    def get_finished(self):
        recving = set(self.next_results.finished_recving)
        for r in recving:
            self._recving_metadata.pop(r, None)
        return {"s1"}, recving

    cls.get_finished = get_finished
    fault._patch_worker(cls, 3.0)
    w = cls()
    caches = {"layers.0": torch.ones(2, 6, 4, 8)}
    w.register_kv_caches(caches)
    w._recving_metadata = {"r1": Meta(([2],))}
    w.next_results = Results({"r1"})
    assert w.get_finished() == ({"s1"}, {"r1"})
    assert torch.all(caches["layers.0"][:, 2] == 3.0) and torch.all(caches["layers.0"][:, [0, 1, 3, 4, 5]] == 1.0)
    assert "1 blocks of request r1" in capsys.readouterr().err


def test_a_worker_it_cannot_patch_is_left_alone(fault, capsys):
    m = fake_worker_module()
    del m.NixlBaseConnectorWorker.get_transfer_results
    fault._patch_worker(m.NixlBaseConnectorWorker, 2.0)
    assert "nothing changed" in capsys.readouterr().err
    assert not hasattr(m.NixlBaseConnectorWorker, "get_finished")
