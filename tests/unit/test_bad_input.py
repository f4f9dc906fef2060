"""Bad input ends at once with exit code 2 and one line naming the problem; nothing is launched or written.

The rows of docs/faults.md's bad-input table are declared here (ROWS), each with the cases its tests run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest

from harness.core.paths import REPO_ROOT
from harness.matrix.config import load_matrix
from harness.models.config import load_models
from tests.helpers import config_error
from tests.unit.bad_input_table import Case, Row, fill, says_pattern

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


# ---------------------------------------------------------------- docs/faults.md's bad-input table
# Each row of the table is declared here with the cases the tests below run (tests/unit/bad_input_table.py renders
# the table from ROWS; `python -m tests.unit.bad_input_table --write` puts it in the doc). A case's `says` is the
# whole error line a test matches, in the doc's notation: <name> is a value the test fills in, ... any text.

BROKEN_REPORT = Row(
    tried="`repro` / `shrink` on a `report.json` that is {tried}",
    says="{says}; exit 2",
    last=", or ",
    cases=(
        Case(
            "not JSON", (), "error: <run>/report.json: not a report (not JSON: ...)", files={"report.json": "{not json"}
        ),
        Case(
            "a JSON list",
            (),
            "error: <run>/report.json: not a report (a JSON list, not an object)",
            shown="(a JSON list, not an object)",
            files={"report.json": "[1, 2, 3]"},
        ),
        Case(
            "a folder",
            (),
            "error: <run>/report.json: a folder, not a report",
            shown="a folder, not a report",
            files={"report.json/": ""},
        ),
        Case(
            "binary",
            (),
            "error: <run>/report.json: not a report (binary, not UTF-8 text)",
            shown="(binary, not UTF-8 text)",
            files={"report.json": b"\x89PNG\r\n\x1a\n\x00\xff\xfe"},
        ),
    ),
)


def make_files(root: Path, files: Mapping[str, str | bytes]) -> None:
    """A case's files under ``root`` (a name ending in / is a folder)."""
    root.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        path = root / name
        if name.endswith("/"):
            path.mkdir(parents=True)
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(content if isinstance(content, bytes) else content.encode())


def says(line: str, case: Case, **bound: str) -> None:
    """The harness's line is the one the case (and so the table) says, in full."""
    assert says_pattern(case.says, **bound).fullmatch(line), f"\n got: {line}\nwant: {case.says} ({bound})"


def files_under(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("cmd", ["repro", "shrink"])
@pytest.mark.parametrize("case", BROKEN_REPORT.cases, ids=lambda c: c.id)
def test_a_broken_report_is_one_line(tmp_path, cmd, case):
    run = tmp_path / "run"
    make_files(run, case.files)
    line = one_error_line(harness_cli(cmd, str(run), "--out", str(tmp_path / "out")))
    says(line, case, run=str(run))
    assert not (tmp_path / "out").exists()


def a_pair(**fields: object) -> str:
    """A matrix report of two pairs, the second with ``fields``: all or nothing, the first is not stored either."""
    good = {"id": "tinyllama-p2-d8", "vllm_version": "0.32.0", "observed": "ok"}
    return json.dumps({"pairs": [good, {**good, "id": "second", **fields}]})


def import_case(tried: str, report: str, said: str, shown: str | None = "") -> Case:
    args = ("history", "--versions", "0.21.0..0.32.0", "--device", "cpu", "--import-runs", "<runs>", "--out", "<out>")
    return Case(tried, args, said, shown=shown, files={"m/report.json": report})


HISTORY_IMPORT = Row(
    tried="`history --import-runs` on a folder with a list-valued or non-JSON `report.json`, or a pair whose "
    "`id`/`vllm_version` holds `../` or `/` (or a field of another type)",
    says="{says}; exit 2 before anything runs, **nothing of the folder is imported** (all or nothing: a maintainer "
    "re-imports once the folder is fixed)",
    cases=(
        import_case("list-valued", "[1, 2]", "error: <report>: not a report (a JSON list, not an object)"),
        import_case("non-JSON", "{not json", "error: <report>: not a report (not JSON: ...)"),
        import_case(
            "`id`",
            a_pair(id="../../x"),
            "error: <report>: pairs[<i>].id '../../x' is not a safe name (...)",
            shown=None,
        ),
        import_case(
            "`vllm_version` holds `../`",
            a_pair(vllm_version="0.32.0/../../y"),
            "error: <report>: pairs[<i>].vllm_version '0.32.0/../../y' is not a safe name (...)",
        ),
        import_case(
            "or `/`", a_pair(id="/tmp/abs"), "error: <report>: pairs[<i>].id '/tmp/abs' is not a safe name (...)"
        ),
        import_case(
            "a field of another type",
            a_pair(observed=["ok"]),
            "error: <report>: pairs[<i>].observed ['ok'] is not a string",
        ),
    ),
    owners=(
        "tests/unit/releases/test_history.py::test_an_imported_pair_that_would_leave_the_store_is_refused_and_nothing_is_stored",
    ),
)


@pytest.mark.parametrize("case", HISTORY_IMPORT.cases, ids=lambda c: c.id)
def test_history_import_of_a_bad_report_is_one_line_and_stores_nothing(tmp_path, case):
    runs, store = tmp_path / "runs", tmp_path / "store"
    make_files(runs, case.files)
    args = fill(case.args, runs=str(runs), out=str(tmp_path / "out"))
    line = one_error_line(harness_cli(*args, env={"PD_HARNESS_RESULTS_DIR": str(store)}))
    says(line, case, report=str(runs / "m" / "report.json"), i="1")
    assert not store.exists() and not (tmp_path / "out").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]  # ../ wrote nothing beside it either


def e2e_case(tried: str, flags: tuple[str, ...], said: str, shown: str | None = "") -> Case:
    return Case(tried, ("e2e", "--device", "cpu", *flags), said, shown=shown)


FLAG_OUT_OF_RANGE = Row(
    tried="{tried}",
    says="{says} (each range declared on its field: `run/config.py` `bounded`); exit 2, no server started",
    cases=(
        e2e_case(
            "`e2e --request-timeout -5`",
            ("--request-timeout", "-5"),
            "error: --request-timeout (request_timeout_s) must be > 0, got -5.0",
            shown=None,
        ),
        e2e_case(
            "`--ready-timeout 0`",
            ("--ready-timeout", "0"),
            "error: --ready-timeout (ready_timeout_s) must be > 0, got 0.0",
        ),
        e2e_case(
            "`--logprob-threshold -1`",
            ("--logprob-threshold", "-1"),
            "error: --logprob-threshold (logprob_threshold) must be > 0, got -1.0",
        ),
        e2e_case(
            "`--nixl-progress-delay-us -100`",
            ("--nixl-progress-delay-us", "-100"),
            "error: --nixl-progress-delay-us must be >= 0, got -100",
        ),
        e2e_case(
            "`--decode-kv-fault=-1e9` (or `nan`)",
            ("--decode-kv-fault=-1e9",),
            "error: --decode-kv-fault (decode_kv_fault) must be > 0 and <= 100, got -1000000000.0",
        ),
        e2e_case(
            "",
            ("--decode-kv-fault=nan",),
            "error: --decode-kv-fault (decode_kv_fault) must be a finite number, got nan",
        ),
        e2e_case(
            "`--gpu-memory-utilization 5`",
            ("--gpu-memory-utilization", "5"),
            "error: --gpu-memory-utilization (gpu_memory_utilization) must be > 0 and <= 1, got 5.0",
        ),
    ),
    owners=("tests/unit/test_cli_config.py::test_the_same_bounds_hold_for_a_config_built_in_code_or_from_yaml",),
)

NO_SUCH_PYTHON = Row(
    tried="{tried}",
    says="{says}; exit 2",
    cases=(
        e2e_case(
            "`e2e --python /nonexistent`",
            ("--python", "/nonexistent"),
            "error: --python /nonexistent: no such executable (the interpreter that has vLLM)",
            shown=None,
        ),
    ),
)


@pytest.mark.parametrize("case", FLAG_OUT_OF_RANGE.cases + NO_SUCH_PYTHON.cases, ids=lambda c: c.id)
def test_a_flag_value_that_cannot_work_launches_nothing(tmp_path, case):
    assert case.args[:3] == ("e2e", "--device", "cpu")
    says(launches_nothing(tmp_path, *case.args[1:]), case)  # a --python of the case's comes last: it wins


EARLIER_RUN = {"report.json": "{}", "logs/decode.log": "ERROR old run's fatal line\n"}
REUSED = (
    "error: <dir> holds an earlier run: a run folder is never reused (a new folder, or --overwrite-run-dir to empty it)"
)
E2E_IN = ("e2e", "--device", "cpu", "--python", str(FAKES / "python-exit-at-start"), "--run-dir", "<dir>")

RUN_FOLDER_REUSED = Row(
    tried="`e2e` / `matrix --run-dir` on a folder an earlier run left (`report.json`, `logs/`, `vllm-*/`)",
    says="{says}; exit 2, the old logs untouched",
    cases=(
        Case("`e2e`", E2E_IN, REUSED, files=EARLIER_RUN),
        Case(
            "`matrix --run-dir`",
            ("matrix", "--device", "cpu", "--only", "tiny-k1-p1-d2", "--run-dir", "<dir>"),
            REUSED,
            shown="",
            files=EARLIER_RUN,
        ),
        Case("`vllm-*/`", E2E_IN, REUSED, shown="", files={"vllm-0.32.0/logs/decode.log": "ERROR old\n"}),
    ),
)

OVERWRITE_NOT_A_RUN = Row(
    tried="`--overwrite-run-dir` on a folder with no `report.json` or `logs/` (not a run's)",
    says="{says}; exit 2, nothing deleted",
    cases=(
        Case(
            "`--overwrite-run-dir`",
            (*E2E_IN, "--overwrite-run-dir"),
            "error: <dir> does not look like a run folder (no report.json or logs or vllm-*): --overwrite-run-dir "
            "empties only those",
            files={"thesis.tex": "years of work"},
        ),
    ),
)


@pytest.mark.parametrize("case", RUN_FOLDER_REUSED.cases + OVERWRITE_NOT_A_RUN.cases, ids=lambda c: c.id)
def test_a_folder_that_is_not_a_new_runs_is_refused_and_left_as_it_was(tmp_path, case):
    folder, record = tmp_path / "folder", tmp_path / "launches.txt"
    make_files(folder, case.files)
    before = files_under(folder)
    line = one_error_line(harness_cli(*fill(case.args, dir=str(folder)), record=record))
    says(line, case, dir=str(folder))
    assert files_under(folder) == before and not record.exists()


TOPOLOGY_BROKEN_MODELS = Row(
    tried="`topology --model M` with a broken `configs/models.yaml`",
    says="`error: configs/models.yaml: line N, column M: <problem>` (as `matrix` and `plan` say it); exit 2",
    owners=(
        "tests/unit/test_bad_input.py::test_topology_on_a_broken_models_yaml_is_one_line",
        "tests/unit/test_bad_input.py::test_bad_matrix_file_is_one_line_naming_file_and_field",
    ),
)


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


def topology_case(tried: str, flags: tuple[str, ...], said: str) -> Case:
    return Case(tried, ("topology", "--tp-p", "1", "--tp-d", "2", *flags), said)


NOT_A_MULTIPLE_OF_K = Row(
    tried="{tried} (attention heads not a multiple of K)",
    says="{says}; exit 2 (`models/topology.py` `shape_problem`; `predict` calls such a shape `invalid`, never `ok`)",
    cases=(
        topology_case(
            "`topology --kv-heads 3 --heads 4`",
            ("--kv-heads", "3", "--heads", "4"),
            "error: 4 attention heads are not a multiple of K=3 KV heads (GQA groups): not a model vLLM loads",
        ),
    ),
    owners=("tests/unit/models/test_topology.py::test_heads_not_a_multiple_of_k_is_no_model",),
)

NOT_A_VERSION = Row(
    tried="{tried}",
    says="{says} (e2e's check, `envs/vllm_env.py` `check_version`); exit 2",
    cases=(
        topology_case(
            "`topology --vllm-version banana`",
            ("--kv-heads", "2", "--heads", "4", "--vllm-version", "banana"),
            "error: --vllm-version 'banana' is not a version number such as 0.21.0",
        ),
    ),
    owners=("tests/unit/test_cli_config.py::test_vllm_version_selects_an_environment_and_conflicts_with_python",),
)


@pytest.mark.parametrize("case", NOT_A_MULTIPLE_OF_K.cases + NOT_A_VERSION.cases, ids=lambda c: c.id)
def test_topology_refuses_what_is_no_model_or_no_version(capsys, case):
    from harness.cli import main

    assert main(list(case.args)) == 2
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert len(err) == 1 and captured.out == ""
    says(err[0], case)


SEE_E2E_HELP = "(see python -m harness e2e --help)"  # the second line: where help is, not argparse's usage

FLAG_ARGPARSE_REFUSES = Row(
    tried="a flag argparse refuses, on any subcommand ({tried}, `e2e --no-such-flag`, a required flag missing, an "
    "unknown subcommand)",
    says=f"two lines, no usage: {{says}} and `{SEE_E2E_HELP}`, naming the innermost subcommand; exit 2 "
    "(`core/argtypes.py` `HarnessArgumentParser`, every parser the harness builds; `--help` unchanged)",
    cases=(
        Case(
            "`e2e --tp-d three`",
            ("e2e", "--tp-d", "three", "--run-dir", "<dir>"),
            "error: argument --tp-d: 'three' is not an integer",
        ),
    ),
    owners=(
        "tests/unit/core/test_argtypes.py::test_a_bad_flag_is_one_error_line_and_the_way_to_help",
        "tests/unit/core/test_argtypes.py::test_the_error_names_the_problem_and_the_innermost_command",
        "tests/unit/core/test_argtypes.py::test_help_is_argparses_own",
        "tests/unit/core/test_argtypes.py::test_every_parser_the_harness_builds_is_the_harness_one",
    ),
)


@pytest.mark.parametrize("case", FLAG_ARGPARSE_REFUSES.cases, ids=lambda c: c.id)
def test_a_bad_flag_value_is_two_lines_and_exit_2(tmp_path, case):
    cp = harness_cli(*fill(case.args, dir=str(tmp_path / "run")))
    assert cp.returncode == 2, cp.stderr
    lines = cp.stderr.splitlines()  # the error and where help is, not argparse's ~38 lines of usage first
    assert len(lines) == 2 and lines[1] == SEE_E2E_HELP, cp.stderr
    says(lines[0], case)
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------- rows whose tests live elsewhere

HOSTILE = "tests/unit/repro/test_hostile_report.py::"
FUZZ_REPORT = (
    "tests/unit/test_fuzz_hostile.py::test_a_hostile_report_never_makes_repro_sh_run_or_write_what_it_did_not_mean"
)

REPRO_NOT_A_VERSION = Row(
    tried="`repro` on a report whose `versions.vllm`/`nixl`/`torch`/`python` is not a version (a newline, `$(...)`, "
    "`--extra-index-url ...`) or whose `vllm_distribution` is not a package name",
    says="`error: <report>: versions.<field> '...' is not a version (e.g. 0.21.0, 2.11.0+cpu)`; exit 2, no bundle",
    owners=(
        HOSTILE + "test_a_version_that_is_not_one_is_refused_in_one_line",
        HOSTILE + "test_real_versions_pass_the_allow_list",
        FUZZ_REPORT,
    ),
)
REPRO_QUOTED = Row(
    tried='`repro` on a report whose model id, flag values, environment values or title fields hold `"`, `$`, '
    "backquotes, `;` or newlines",
    says="a working bundle: each value one quoted word in `repro.sh` (the hub model as `HUB_MODEL='...'`, a "
    "non-numeric `--block-size` literal), one line in its comments; `ISSUE.md`'s commands quoted word by word",
    owners=(
        HOSTILE + "test_a_model_id_with_quotes_and_dollars_gives_a_working_script",
        HOSTILE + "test_a_block_size_word_is_not_expanded_by_the_shell",
        HOSTILE + "test_a_title_value_with_a_newline_stays_in_its_comment",
        HOSTILE + "test_issue_md_quotes_the_commands_a_maintainer_copies",
        FUZZ_REPORT,
    ),
)
REPRO_NOT_A_SERVER = Row(
    tried="`repro` on a report whose server command is not `<python> -m vllm.<module>`, sets `LD_PRELOAD`, "
    "`PYTHONPATH` (other than the harness's hooks': CPU tuning, KV digest), `BASH_ENV` or another code-loading "
    "variable, or holds a NUL",
    says="`error: the report's <role> command does not start a vLLM server ...` / `sets <NAME> (a variable that makes "
    "a process load other code): not replayed`; exit 2",
    owners=(
        HOSTILE + "test_a_command_that_is_not_a_vllm_server_is_not_replayed",
        HOSTILE + "test_a_variable_that_loads_code_is_not_replayed",
        "tests/unit/repro/test_bundle_digest.py::test_a_gpu_run_with_the_digest_is_bundled_with_the_hooks_alone_on_its_path",
        FUZZ_REPORT,
    ),
)
REPRO_OTHER_INTERPRETER = Row(
    tried="`repro` on a report naming an interpreter that is not this harness's (`.venv/`, `.venvs/`, the running one)",
    says="the interpreter is never run; `requirements.lock` holds the report's versions and says why",
    owners=(HOSTILE + "test_an_interpreter_the_harness_did_not_make_is_not_run",),
)
REPRO_FIELD_TYPE = Row(
    tried='`repro` on a report field of another type (`"max_tokens": "many"`)',
    says="`error: <report>: a field is not what a run writes (ValueError: ...)`; exit 2",
    owners=(HOSTILE + "test_a_field_of_another_type_is_one_line",),
)
STORE_OUTSIDE_ITS_ROOT = Row(
    tried="the results store asked for an entry or version that would leave its root",
    says="`ConfigError` (`put`); `get` finds nothing",
    owners=(
        "tests/unit/releases/test_store.py::test_a_name_that_would_leave_the_store_is_refused",
        "tests/unit/test_fuzz_hostile.py::test_the_results_store_never_writes_outside_its_root",
    ),
)
HOSTILE_REQUEST_ID = Row(
    tried="a client's `X-Request-Id: ../x/y` with `--fault hold-between-hops`",
    says="the held file is `<hold-dir>/<file_stem(id)>.held` (`x_y-<hash>.held`), never outside `--hold-dir`; the "
    "cutter answers with the `.go` of the same name",
    owners=(
        "tests/unit/proxy/test_hold_dir.py::test_a_request_id_never_leaves_the_hold_folder",
        "tests/unit/proxy/test_hold_dir.py::test_the_hold_is_released_by_the_go_file_of_the_same_name",
        "tests/unit/proxy/test_hold_dir.py::test_a_hostile_request_id_through_the_proxy",
        "tests/unit/test_fuzz_hostile.py::test_a_request_id_marks_one_file_in_the_hold_folder",
    ),
)

# The table, in the doc's order.
ROWS = (
    BROKEN_REPORT,
    REPRO_NOT_A_VERSION,
    REPRO_QUOTED,
    REPRO_NOT_A_SERVER,
    REPRO_OTHER_INTERPRETER,
    REPRO_FIELD_TYPE,
    HISTORY_IMPORT,
    STORE_OUTSIDE_ITS_ROOT,
    HOSTILE_REQUEST_ID,
    TOPOLOGY_BROKEN_MODELS,
    FLAG_OUT_OF_RANGE,
    NO_SUCH_PYTHON,
    RUN_FOLDER_REUSED,
    OVERWRITE_NOT_A_RUN,
    NOT_A_MULTIPLE_OF_K,
    NOT_A_VERSION,
    FLAG_ARGPARSE_REFUSES,
)
