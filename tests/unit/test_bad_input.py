"""Bad input ends at once with exit code 2 and one line naming the problem; nothing is launched or written."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.core.paths import REPO_ROOT
from harness.matrix.config import load_matrix
from harness.models.config import load_models
from tests.helpers import config_error

FAKES = REPO_ROOT / "tests" / "fakes"
BOUND_S = 30  # "does not hang": each of these takes well under a second


def harness_cli(
    *args: str, env: dict[str, str] | None = None, record: Path | None = None
) -> subprocess.CompletedProcess:
    full_env = {
        k: v
        for k, v in os.environ.items()
        if k
        not in (
            "PREFILLER_TP_SIZE",
            "DECODER_TP_SIZE",
            "PREFILL_BLOCK_SIZE",
            "DECODE_BLOCK_SIZE",
            "DECODER_KV_LAYOUT",
            "VLLM_VERSION",
        )
    }
    full_env.update(env or {})
    if record is not None:  # every launch through the stand-in interpreter leaves a line here
        full_env.update({"FAKE_VLLM_RECORD": str(record), "FAKE_VLLM_REAL_PYTHON": sys.executable})
    t0 = time.monotonic()
    cp = subprocess.run(
        [sys.executable, "-m", "harness", *args],
        cwd=REPO_ROOT,
        env=full_env,
        capture_output=True,
        text=True,
        timeout=BOUND_S * 4,
    )
    assert time.monotonic() - t0 < BOUND_S
    return cp


def one_error_line(cp: subprocess.CompletedProcess) -> str:
    assert cp.returncode == 2, (cp.returncode, cp.stdout, cp.stderr)
    lines = cp.stderr.splitlines()
    assert len(lines) == 1, cp.stderr
    assert lines[0].startswith("error: ")
    return lines[0]


def launches_nothing(tmp_path: Path, *args: str, env: dict[str, str] | None = None) -> str:
    """Run e2e with the stand-in interpreter; prove no process was launched and no run folder made."""
    run_dir, record = tmp_path / "run", tmp_path / "launches.txt"
    cp = harness_cli(
        "e2e", "--python", str(FAKES / "python-exit-at-start"), "--run-dir", str(run_dir), *args, env=env, record=record
    )
    line = one_error_line(cp)
    assert not run_dir.exists()
    assert not record.exists(), f"launched: {record.read_text()}"
    assert "run folder" not in cp.stdout
    return line


def test_tp_that_does_not_divide_the_heads(tmp_path):
    line = launches_nothing(tmp_path, "--device", "cpu", "--tp-d", "3")
    assert "decode TP 3 does not divide the model's 4 attention heads" in line


def test_the_stand_in_interpreter_does_record_launches(tmp_path):
    # The control for launches_nothing: a valid run through the same interpreter is recorded.
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 4, "num_key_value_heads": 1}')
    record = tmp_path / "launches.txt"
    cp = harness_cli(
        "e2e",
        "--device",
        "cpu",
        "--python",
        str(FAKES / "python-exit-at-start"),
        "--run-dir",
        str(tmp_path / "run"),
        "--model",
        str(model),
        record=record,
    )
    assert cp.returncode == 1
    assert "vllm.entrypoints.openai.api_server" in record.read_text()


def test_tp_above_the_cpu_cores(tmp_path):
    cores = len(os.sched_getaffinity(0))
    tp = 1
    while tp <= cores:
        tp *= 2  # a power of two divides the tiny model's 4 heads up to 4; beyond, head errors join the line
    line = launches_nothing(tmp_path, "--device", "cpu", "--tp-d", str(tp))
    assert f"cannot run on this CPU machine: decode TP {tp} needs {tp} CPU cores" in line


def test_cpu_block_size_not_a_multiple_of_32(tmp_path):
    line = launches_nothing(tmp_path, "--device", "cpu", "--block-size-p", "16", "--block-size-d", "16")
    assert "block size 16 is not a multiple of 32" in line


def test_block_sizes_that_do_not_divide(tmp_path):
    line = launches_nothing(tmp_path, "--device", "cpu", "--block-size-p", "64", "--block-size-d", "96")
    assert "64" in line and "96" in line and "divide" in line


def test_a_model_folder_with_a_shape_vllm_refuses(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text('{"num_attention_heads": 6, "num_key_value_heads": 6}')
    line = launches_nothing(tmp_path, "--device", "cpu", "--model", str(model), "--tp-p", "1", "--tp-d", "4")
    assert "decode TP 4 does not divide the model's 6 attention heads" in line


def test_rejected_by_design_pair_passes_preflight(tmp_path):
    # Regime D (K=1 < P=2 > D=1) is refused by vLLM at the handshake on purpose: preflight lets it through.
    from harness.cli import build_parser, config_from_args

    a = build_parser().parse_args(["e2e", "--device", "cpu", "--tp-p", "2", "--tp-d", "1"])
    assert config_from_args(a, env={}, preflight=True).tp_p == 2


@pytest.mark.parametrize(
    "env,var",
    [
        ({"DECODER_TP_SIZE": "x"}, "DECODER_TP_SIZE"),
        ({"DECODER_TP_SIZE": "0"}, "DECODER_TP_SIZE"),
        ({"PREFILLER_TP_SIZE": "1.5"}, "PREFILLER_TP_SIZE"),
        ({"DECODE_BLOCK_SIZE": "-32"}, "DECODE_BLOCK_SIZE"),
        ({"DECODER_KV_LAYOUT": "ABC"}, "DECODER_KV_LAYOUT"),
        ({"GPU_MEMORY_UTILIZATION": "lots"}, "GPU_MEMORY_UTILIZATION"),
        ({"GPU_MEMORY_UTILIZATION": "1.5"}, "GPU_MEMORY_UTILIZATION"),
    ],
)
def test_bad_env_values_name_the_variable(tmp_path, env, var):
    line = launches_nothing(tmp_path, "--device", "cpu", env=env)
    assert var in line


def test_bad_flag_value_is_argparse_exit_2(tmp_path):
    cp = harness_cli("e2e", "--tp-d", "three", "--run-dir", str(tmp_path / "run"))
    assert cp.returncode == 2 and "--tp-d" in cp.stderr
    # the error and where help is, not argparse's ~38 lines of usage first (harness/core/argtypes.py)
    assert cp.stderr.splitlines() == [
        "error: argument --tp-d: 'three' is not an integer",
        "(see python -m harness e2e --help)",
    ]
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- config files

MATRIX_ENTRY = """entries:
  - id: a
    model: tiny-llama
    device: cpu
    tp_p: 1
    tp_d: 2
    expected: {pre-fix: assert-45330, fixed: ok}
"""

MATRIX_CASES = {
    "unknown key": (MATRIX_ENTRY + "    colour: red\n", "entries.0.colour"),
    "wrong type": (MATRIX_ENTRY.replace("tp_d: 2", "tp_d: two"), "entries.0.tp_d"),
    "missing field": (MATRIX_ENTRY.replace("    device: cpu\n", ""), "entries.0.device"),
    "unknown outcome": (MATRIX_ENTRY.replace("fixed: ok", "fixed: great"), "entries.0.expected.fixed"),
    "unknown model": (MATRIX_ENTRY.replace("tiny-llama", "nope"), "entries.0.model"),
    "broken yaml": ("entries: [\n", "line 2"),
    "not a mapping": ("- 1\n- 2\n", "<top>"),
}


def test_the_shipped_matrix_lists_fine():
    cp = harness_cli("matrix", "--list", "--device", "cpu", "--vllm-version", "0.32.0")
    assert cp.returncode == 0, cp.stderr


@pytest.mark.parametrize("case", list(MATRIX_CASES))
def test_bad_matrix_file_is_one_line_naming_file_and_field(tmp_path, case):
    text, field = MATRIX_CASES[case]
    path = tmp_path / "matrix.yaml"
    path.write_text(text)
    line = one_error_line(harness_cli("matrix", str(path), "--list", "--device", "cpu", "--vllm-version", "0.32.0"))
    assert line.startswith(f"error: {path}:"), line
    assert field in line, line
    assert config_error(load_matrix, path, text) == line[len("error: ") :]


MODELS_ENTRY = """models:
  - id: m
    hub_id: org/m
    attention_heads: 8
    kv_heads: 2
"""

MODELS_CASES = {
    "unknown key": (MODELS_ENTRY + "    colour: red\n", "models.0.colour"),
    "wrong type": (MODELS_ENTRY.replace("kv_heads: 2", "kv_heads: [2]"), "models.0.kv_heads"),
    "missing field": (MODELS_ENTRY.replace("    attention_heads: 8\n", ""), "models.0.attention_heads"),
    "out of range": (MODELS_ENTRY + "    gsm8k_expected: 2\n", "models.0.gsm8k_expected"),
    "broken yaml": ("models:\n  - id: [\n", "line 3"),
}


@pytest.mark.parametrize("case", list(MODELS_CASES))
def test_bad_models_file_is_one_line_naming_file_and_field(tmp_path, case):
    text, field = MODELS_CASES[case]
    path = tmp_path / "models.yaml"
    msg = config_error(load_models, path, text)
    assert "\n" not in msg, msg
    assert msg.startswith(f"{path}:"), msg
    assert field in msg, msg


def test_a_file_that_cannot_be_read_is_one_line(tmp_path):
    path = tmp_path / "missing.yaml"
    line = one_error_line(harness_cli("matrix", str(path), "--list", "--device", "cpu", "--vllm-version", "0.32.0"))
    assert str(path) in line


# ---------------------------------------------------------------- hostile and broken files handed to the harness

BROKEN_REPORTS = {
    "not JSON": (lambda p: p.write_text("{not json"), "not JSON"),
    "a JSON list": (lambda p: p.write_text("[1, 2, 3]"), "a JSON list, not an object"),
    "a folder": (lambda p: p.mkdir(), "a folder"),
    "binary": (lambda p: p.write_bytes(b"\x89PNG\r\n\x1a\n\x00\xff\xfe"), "binary"),
}


@pytest.mark.parametrize("cmd", ["repro", "shrink"])
@pytest.mark.parametrize("case", list(BROKEN_REPORTS))
def test_a_broken_report_is_one_line(tmp_path, cmd, case):
    make, said = BROKEN_REPORTS[case]
    run = tmp_path / "run"
    run.mkdir()
    make(run / "report.json")
    line = one_error_line(harness_cli(cmd, str(run), "--out", str(tmp_path / "out")))
    assert str(run / "report.json") in line and said in line, line
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "text,said",
    [
        ("[1, 2]", "a JSON list"),
        (
            '{"pairs": [{"id": "../../x", "vllm_version": "0.32.0", "observed": "ok"}]}',
            "pairs[0].id '../../x' is not a safe name",
        ),
    ],
)
def test_history_import_of_a_bad_report_is_one_line_and_stores_nothing(tmp_path, text, said):
    (tmp_path / "runs" / "m").mkdir(parents=True)
    (tmp_path / "runs" / "m" / "report.json").write_text(text)
    store = tmp_path / "store"
    line = one_error_line(
        harness_cli(
            "history",
            "--versions",
            "0.21.0..0.32.0",
            "--device",
            "cpu",
            "--import-runs",
            str(tmp_path / "runs"),
            "--out",
            str(tmp_path / "out"),
            env={"PD_HARNESS_RESULTS_DIR": str(store)},
        )
    )
    assert said in line, line
    assert not store.exists() and not (tmp_path / "out").exists() and not (tmp_path / "x").exists()


def test_topology_on_a_broken_models_yaml_is_one_line(tmp_path, monkeypatch, capsys):
    """As matrix and plan say it: the file, the line, the problem."""
    import harness.models.heads as heads
    from harness.cli import main

    broken = tmp_path / "models.yaml"
    broken.write_text(MODELS_CASES["broken yaml"][0])
    monkeypatch.setattr(heads, "load_models", lambda: load_models(broken))
    assert main(["topology", "--model", "no-such-model-here", "--tp-p", "1", "--tp-d", "2"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0] == f"error: {config_error(load_models, broken, MODELS_CASES['broken yaml'][0])}"


@pytest.mark.parametrize(
    "args,said",
    [
        (["--kv-heads", "3", "--heads", "4"], "error: 4 attention heads are not a multiple of K=3 KV heads"),
        (
            ["--kv-heads", "2", "--heads", "4", "--vllm-version", "banana"],
            "error: --vllm-version 'banana' is not a version number such as 0.21.0",
        ),  # what e2e says (check_version)
    ],
)
def test_topology_refuses_what_is_no_model_or_no_version(capsys, args, said):
    from harness.cli import main

    assert main(["topology", "--tp-p", "1", "--tp-d", "2", *args]) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and err[0].startswith(said) and captured.out == ""
