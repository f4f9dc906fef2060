"""Two runs building the same cache at once: built once, never seen half-written, both get the same folder."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from harness.core.paths import REPO_ROOT
from harness.models.tiny import TinyModelSpec, build_cached

SMALL: dict[str, Any] = dict(kv_heads=1, heads=2, layers=1, head_dim=16)
BOUND_S = 300  # "does not hang"; a small tiny model builds in a few seconds

# Each builder waits for the go file (so both ask at the same moment), counts real builds in `builds`
# and slows its build down, so without the lock both would be building at once.
BUILDER = r"""
import hashlib, json, os, sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
go, builds = Path({go!r}), Path({builds!r})
import harness.models.tiny as tm

real_write_model = tm.write_model
def counted_write_model(spec, out, vocab_size):
    with open(builds, "a") as f:
        f.write(f"{{os.getpid()}}\n")
    time.sleep(2.0)
    real_write_model(spec, out, vocab_size)
tm.write_model = counted_write_model

while not go.exists():
    time.sleep(0.01)
path = tm.ensure_tiny_model(tm.TinyModelSpec(**{spec!r}))  # the cache root comes from PD_HARNESS_CACHE_DIR
files = {{f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(path.iterdir()) if f.is_file()}}
print(json.dumps({{"path": str(path), "files": files}}))
"""


def _digest(folder: Path) -> dict[str, str]:
    return {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(folder.iterdir()) if f.is_file()}


def test_two_processes_build_the_same_tiny_model_once(tmp_path):
    cache_root, go, builds = tmp_path / "cache", tmp_path / "go", tmp_path / "builds.txt"
    env = {**os.environ, "PD_HARNESS_CACHE_DIR": str(cache_root), "PD_HARNESS_CACHE_LOCK_DIR": str(tmp_path / "locks")}
    code = BUILDER.format(repo=str(REPO_ROOT), go=str(go), builds=str(builds), spec=SMALL)
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    target = cache_root / "models" / TinyModelSpec(**SMALL).dirname()
    half_seen = []
    try:
        time.sleep(1.0)  # both imported and waiting
        go.touch()
        deadline = time.monotonic() + BOUND_S
        # Watch the cache while they build: the folder is either absent or complete, never half-written.
        while any(p.poll() is None for p in procs):
            assert time.monotonic() < deadline, "builders did not finish"
            if target.exists() and not (target / "harness_tiny_model.json").exists():
                half_seen.append(sorted(f.name for f in target.iterdir()))
            time.sleep(0.02)
        outs = [p.communicate(timeout=30) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_out, err) in zip(procs, outs, strict=False):
        assert p.returncode == 0, err
    results = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert half_seen == []
    assert results[0]["path"] == results[1]["path"] == str(target)
    assert results[0]["files"] == results[1]["files"] == _digest(target)
    assert {"config.json", "model.safetensors", "tokenizer.json", "harness_tiny_model.json"} <= set(results[0]["files"])
    assert len(builds.read_text().splitlines()) == 1, "built twice: the second builder did not wait"
    # Nothing but the one model folder in the cache: no temporary build folder left behind.
    assert [f.name for f in (cache_root / "models").iterdir()] == [target.name]


def test_the_cache_root_follows_the_environment(tmp_path):
    code = (
        "import harness.models.tiny as t, harness.tasks.gsm8k_offline as g; "
        "print(t.DEFAULT_CACHE); print(g.DEFAULT_CACHE)"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        env={**os.environ, "PD_HARNESS_CACHE_DIR": str(tmp_path)},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    ).stdout.split()
    assert out == [str(tmp_path / "models"), str(tmp_path / "tasks")]


def test_threads_build_once_and_a_failed_build_leaves_nothing(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("PD_HARNESS_CACHE_LOCK_DIR", str(tmp_path / "locks"))
    calls = []

    def build(tmp: Path) -> None:
        calls.append(tmp)
        time.sleep(0.5)
        (tmp / "part1").write_text("a")
        (tmp / "done").write_text("b")

    def complete(folder: Path) -> bool:
        return (folder / "done").exists()

    target = tmp_path / "cache" / "thing"
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda _: build_cached(target, complete, build), range(4)))
    assert got == [target] * 4 and len(calls) == 1
    assert sorted(f.name for f in target.iterdir()) == ["done", "part1"]

    def crash(tmp: Path) -> None:
        (tmp / "part1").write_text("a")
        raise RuntimeError("killed mid-build")

    other = tmp_path / "cache" / "other"
    with pytest.raises(RuntimeError):
        build_cached(other, complete, crash)
    assert sorted(f.name for f in (tmp_path / "cache").iterdir()) == ["thing"]  # no half-built folder, no temp left


def test_two_processes_write_the_offline_task_once(tmp_path):
    code = r"""
import sys, time
from pathlib import Path
sys.path.insert(0, {repo!r})
import harness.tasks.gsm8k_offline as g
real = g.write_task
def counted(spec, out):
    with open({builds!r}, "a") as f:
        f.write("x\n")
    time.sleep(1.0)
    return real(spec, out)
g.write_task = counted
while not Path({go!r}).exists():
    time.sleep(0.01)
print(g.ensure_task(g.TaskSpec(n_train=20, n_test=10, num_fewshot=2), Path({cache!r})))
"""
    go, builds, cache = tmp_path / "go", tmp_path / "builds.txt", tmp_path / "tasks"
    src = code.format(repo=str(REPO_ROOT), builds=str(builds), go=str(go), cache=str(cache))
    env = {**os.environ, "PD_HARNESS_CACHE_LOCK_DIR": str(tmp_path / "locks")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", src], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    try:
        time.sleep(0.5)
        go.touch()
        outs = [p.communicate(timeout=BOUND_S) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], [e for _, e in outs]
    paths = {o.strip() for o, _ in outs}
    assert len(paths) == 1
    folder = Path(paths.pop())
    assert sorted(f.name for f in folder.iterdir()) == ["gsm8k_offline.yaml", "test.jsonl", "train.jsonl"]
    assert str(folder / "train.jsonl") in (folder / "gsm8k_offline.yaml").read_text()
    assert len(builds.read_text().splitlines()) == 1
