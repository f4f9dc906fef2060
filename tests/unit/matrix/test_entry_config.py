"""A matrix file is judged as its runs will be: each entry's run config is built the way the matrix run builds it and
refused at load by E2EConfig.validate, in e2e's words, naming the file and the entry; what only the machine decides
(a GPU entry on this CPU box) is left to the plan."""

from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from harness.core.errors import ConfigError
from harness.core.paths import REPO_ROOT
from harness.e2e.args import config_from_args, e2e_parser
from harness.matrix.cli import base_config
from harness.matrix.config import entry_config, load_matrix
from harness.matrix.plan import plan
from harness.matrix.run import config_for
from tests.helpers import config_error

HEAD = "entries:\n  - id: odd-blocks\n    model: tiny-llama\n    device: cpu\n    tp_p: 1\n    tp_d: 2\n"
TAIL = "    expected: {pre-fix: assert-45330, fixed: ok}\n"


def refusal(*flags: str) -> str:
    """What e2e says of these flags (its own refusal, from E2EConfig.validate)."""
    with pytest.raises(ConfigError) as e:
        config_from_args(e2e_parser().parse_args(["e2e", "--device", "cpu", *flags]), env={})
    return str(e.value)


def test_block_sizes_that_do_not_divide_are_refused_at_load_naming_the_entry(tmp_path):
    p = tmp_path / "m.yaml"
    msg = config_error(load_matrix, p, HEAD + "    block_size_p: 64\n    block_size_d: 96\n" + TAIL)
    assert msg == f"{p}: entries.0 (odd-blocks): {refusal('--block-size-p', '64', '--block-size-d', '96')}"
    assert "prefill block size 64 does not divide decode block size 96" in msg


def test_an_axis_value_the_run_refuses_is_refused_at_load_in_e2es_words(tmp_path):
    p = tmp_path / "m.yaml"
    msg = config_error(load_matrix, p, HEAD + "    axes: {speculative_config: '[1]'}\n" + TAIL)
    assert msg == f"{p}: entries.0 (odd-blocks): {refusal('--speculative-config', '[1]')}"


def test_the_refusal_names_the_failing_entry_among_good_ones(tmp_path):
    good = HEAD.replace("entries:\n", "").replace("odd-blocks", "fine") + TAIL
    bad = HEAD.replace("entries:\n", "") + "    block_size_p: 64\n    block_size_d: 96\n" + TAIL
    msg = config_error(load_matrix, tmp_path / "m.yaml", "entries:\n" + good + bad)
    assert "entries.1 (odd-blocks)" in msg and "fine" not in msg and "\n" not in msg


def test_what_only_the_machine_decides_is_left_to_the_plan(tmp_path):
    """A GPU entry with a GPU-only backend loads on any box; this CPU-only plan skips it with the reason."""
    p = tmp_path / "m.yaml"
    p.write_text(
        "entries:\n  - id: big\n    model: tinyllama-1.1b-chat\n    device: gpu\n    gpus: 16\n"
        "    tp_p: 8\n    tp_d: 8\n"
        "    axes: {attention_backend: FLASH_ATTN, kv_buffer_device: cuda}\n" + TAIL.replace("assert-45330", "ok")
    )
    matrix, models = load_matrix(p)
    (pair,) = plan(matrix, models, "0.32.0", "cpu", 0)
    assert not pair.run and "a gpu entry; this run is on cpu" in (pair.skip_reason or "")


def matrix_files() -> list[Path]:
    """Every shipped YAML under configs/ that is a matrix file (a mapping with entries)."""
    out = []
    for f in sorted((REPO_ROOT / "configs").glob("*.yaml")):
        data = yaml.safe_load(f.read_text())
        if isinstance(data, dict) and "entries" in data:
            out.append(f)
    return out


def test_the_shipped_matrix_files_are_found():
    assert {f.name for f in matrix_files()} >= {"edge_cases.yaml", "gqa_replication.yaml"}


@pytest.mark.parametrize("path", matrix_files(), ids=lambda f: f.name)
def test_every_shipped_matrix_file_loads_and_each_pair_runs_the_config_load_judged(path):
    matrix, models = load_matrix(path)
    for device in ("cpu", "gpu"):
        base = base_config(device, env={})
        pairs = {p.id: p for p in plan(matrix, models, "0.32.0", device, 64)}
        for e in matrix.entries:
            if e.device != device:
                continue
            model = models[e.model]
            cfg = config_for(base, pairs[e.id], model.hub_id or model.id, base.python, Path("run"))
            cfg.validate()  # what the pair's run checks first
            assert cfg == entry_config(e, model, replace(base, run_dir=Path("run"))), e.id
