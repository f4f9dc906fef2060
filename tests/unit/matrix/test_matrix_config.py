"""The GQA-replication matrix file: valid, and every expectation agrees with the topology math."""

import pytest

from harness.matrix.config import load_matrix, shape_of
from harness.models.topology import predict
from tests.helpers import config_error

MATRIX, MODELS = load_matrix()
REQUIRED = {
    "tinyllama-p2-d8",
    "tinyllama-p4-d8",
    "tinyllama-p1-d8",
    "tinyllama-p2-d4",
    "llama32-1b-p8-d16",
    "qwen25-3b-p1-d4",
    "qwen25-3b-p2-d4",
    "qwen25-3b-p4-d2",
    "tiny-k1-p1-d1",
    "tiny-k1-p1-d2",
    "tiny-k1-p2-d2",
    "tiny-k1-p2-d1",
    "tiny-k2-p2-d1",
}


def test_every_required_entry_is_present():
    assert {e.id for e in MATRIX.entries} >= REQUIRED


@pytest.mark.parametrize("entry", MATRIX.entries, ids=[e.id for e in MATRIX.entries])
def test_expectations_equal_the_topology_prediction(entry):
    shape = shape_of(entry, MODELS[entry.model])
    assert predict(shape, entry.tp_p, entry.tp_d, vllm_version="0.21.0").expected == entry.expected.pre_fix
    assert predict(shape, entry.tp_p, entry.tp_d, vllm_version="0.32.0").expected == entry.expected.fixed


def test_cpu_entries_cover_every_regime():
    regimes = {
        predict(shape_of(e, MODELS[e.model]), e.tp_p, e.tp_d).regime for e in MATRIX.entries if e.device == "cpu"
    }
    assert regimes == {"A", "B", "C", "D", "E"}


GOOD = (
    "entries:\n  - id: x-p1-d2\n    model: tiny-llama\n    device: cpu\n    tp_p: 1\n    tp_d: 2\n"
    "    expected: {pre-fix: assert-45330, fixed: ok}\n"
)


@pytest.mark.parametrize(
    "text,field",
    [
        (GOOD.replace("tp_p: 1", "tp_p: 0"), "entries.0.tp_p"),
        (GOOD.replace("tp_d: 2", "tp_d: two"), "entries.0.tp_d"),
        (GOOD.replace("    device: cpu\n", ""), "entries.0.device"),
        (GOOD.replace("fixed: ok", "fixed: maybe"), "entries.0.expected.fixed"),
        (GOOD + "    colour: red\n", "entries.0.colour"),
        (GOOD.replace("tiny-llama", "no-such-model"), "entries.0.model"),
        (GOOD.replace("device: cpu", "device: gpu"), "gpus"),
        (GOOD.replace("model: tiny-llama", "model: qwen3-0.6b\n    kv_heads: 2"), "kv_heads"),
        (GOOD + GOOD.replace("entries:\n", ""), "duplicate"),
        (
            GOOD + "    known_failure: {family: fixed, class: slow-ish, evidence: seen once}\n",
            "entries.0.known_failure",
        ),
        ("entries: [\n", "gqa.yaml"),
    ],
)
def test_bad_entry_is_one_line_naming_file_and_field(tmp_path, text, field):
    p = tmp_path / "gqa.yaml"
    msg = config_error(load_matrix, p, text)
    assert field in msg and str(p) in msg and "\n" not in msg.strip()


def test_good_minimal_file_loads(tmp_path):
    p = tmp_path / "gqa.yaml"
    p.write_text(GOOD)
    m, _ = load_matrix(p)
    e = m.get("x-p1-d2")
    assert e is not None and e.expected_for("pre-fix") == "assert-45330"


def test_known_failures_steady_or_intermittent(tmp_path):
    p = tmp_path / "gqa.yaml"
    p.write_text(GOOD + "    known_failure: {family: fixed, class: kv-lease-expired, evidence: seen twice}\n")
    e = load_matrix(p)[0].get("x-p1-d2")
    assert e is not None
    assert (e.expected_for("fixed"), e.tolerated_for("fixed"), e.expected_for("pre-fix")) == (
        "kv-lease-expired",
        None,
        "assert-45330",
    )
    p.write_text(
        GOOD + "    known_failure: {family: fixed, class: kv-lease-expired, intermittent: true, evidence: 1 in 3}\n"
    )
    e = load_matrix(p)[0].get("x-p1-d2")
    assert e is not None
    assert (e.expected_for("fixed"), e.tolerated_for("fixed"), e.tolerated_for("pre-fix")) == (
        "ok",
        "kv-lease-expired",
        None,
    )
