"""A whole wheelhouse build (build.py ``build`` and ``plan_gpu``) against a fake index, a fake pip and fake downloads:
what the manifest says, what the folder holds, and what is refused (no network, no pip)."""

from __future__ import annotations

import io
import json
import shutil
import sys
import zipfile
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import pytest

from harness.core.errors import ConfigError
from harness.wheelhouse import build
from harness.wheelhouse.build import ReleaseUnavailable, Request
from harness.wheelhouse.index import Index, IndexFile
from harness.wheelhouse.pip import Unservable
from tests.unit.wheelhouse.wheels import PLATFORM, gpu_request, make_wheel

FA2 = "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so"
TAGS = {"vllm": f"cp38-abi3-{PLATFORM}", "torch": f"cp312-cp312-{PLATFORM}"}
# name -> version -> Requires-Dist, as the index and pip's report give them
DISTS: dict[str, dict[str, list[str]]] = {
    "vllm": {"0.34.0": ["torch==2.14.0", "numpy", "tilelang"], "0.33.0": ["torch==2.13.0", "numpy"]},
    "torch": {"2.14.0": ["triton==3.6.0", "cuda-toolkit==13.0.2"]},
    "triton": {"3.6.0": []},
    "cuda-toolkit": {"13.0.2": []},
    "numpy": {"2.3.5": []},
    "tilelang": {"0.1.6": []},
    "nixl": {"1.5.1": ["nixl-cu12", "nixl-cu13"]},
    "nixl-cu13": {"1.5.1": []},
    "pytest": {"9.2.0": []},
    "pyyaml": {"6.0.4": []},
}
GPU_INSTALL = {"vllm": "0.34.0", "nixl-cu13": "1.5.1", "pytest": "9.2.0", "torch": "2.14.0"} | {
    n: next(iter(DISTS[n])) for n in ("triton", "cuda-toolkit", "numpy", "tilelang")
}
CPU_INSTALL = {"numpy": "2.3.5", "pytest": "9.2.0"}


def filename(name: str, version: str) -> str:
    return f"{name.replace('-', '_')}-{version}-{TAGS.get(name, 'py3-none-any')}.whl"


def url(name: str, version: str) -> str:
    return f"https://files.example/{filename(name, version)}"


class FakeIndex:
    def __init__(self, *_a) -> None:
        self.made = 0

    def project(self, name: str) -> list[IndexFile]:
        versions = DISTS[name]
        return [IndexFile(filename(name, v), url(name, v), 1000 + i, None, None, False) for i, v in enumerate(versions)]

    def metadata(self, f: IndexFile) -> str:
        name, version = f.filename.split("-")[:2]
        name = name.replace("_", "-")
        return f"Name: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in DISTS[name][version])

    def remote_wheel(self, f: IndexFile) -> zipfile.ZipFile:
        return zipfile.ZipFile(vllm_wheel(Path(build.WORK_DIR) / f"remote{self.made}"))


def vllm_wheel(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    return make_wheel(folder, "vllm", "0.34.0", files={"vllm/__init__.py": b"", FA2: b"x" * 5000})


def report(install: dict[str, str], requested: set[str]) -> dict:
    return {
        "install": [
            {
                "metadata": {"name": n, "version": v, "requires_dist": DISTS[n][v]},
                "download_info": {"url": url(n, v), "archive_info": {"hashes": {"sha256": f"sha-{n}"}}},
                "requested": n in requested,
            }
            for n, v in install.items()
        ]
    }


@pytest.fixture
def world(tmp_path, monkeypatch):
    """The build's world: requirement files, the index, pip's resolution and the downloads, each faked and recorded."""
    reqs = tmp_path / "repo" / "requirements"
    reqs.mkdir(parents=True)
    (reqs / "harness.txt").write_text("pytest==9.2.0\n")
    (reqs / "gpu.txt").write_text("-r harness.txt\nvllm==0.34.0\nnixl==1.5.1\n")
    (reqs / "cpu.txt").write_text("-r harness.txt\nnumpy\n")
    (reqs / "cpu.lock").write_text("numpy==2.3.5\npyyaml==6.0.4\npytest==9.2.0\n")
    monkeypatch.setattr(build, "REPO_ROOT", tmp_path / "repo")
    monkeypatch.setattr(build, "WORK_DIR", tmp_path / "work")
    monkeypatch.setattr(build, "Index", FakeIndex)
    w = SimpleNamespace(resolved=[], fetched=[], verified=[], install=GPU_INSTALL, fail=None, tmp=tmp_path)

    def resolve(target, sources, lines, constraints, work, built, log, index):
        w.resolved.append((lines, constraints))
        if w.fail is not None:
            raise w.fail
        path = work / "report.json"
        path.write_text(json.dumps(report(w.install, {x.split("==")[0].split("[")[0] for x in lines})))
        return SimpleNamespace(report=path)

    def fetch_all(items):
        out = []
        for i, (u, _sha, dest) in enumerate(items):
            name, version = dest.name.split("-")[:2]
            (tmp_path / f"dl{i}").mkdir(exist_ok=True)
            made = vllm_wheel(tmp_path / f"dl{i}") if name == "vllm" else make_wheel(tmp_path / f"dl{i}", name, version)
            shutil.move(made, dest)
            w.fetched.append(u)
            out.append(dest)
        return out

    def verify(folder, resolver_python, err):
        w.verified.append((folder, resolver_python))
        return {"ok": True}

    monkeypatch.setattr(build, "resolve", resolve)
    monkeypatch.setattr(build, "fetch_all", fetch_all)
    monkeypatch.setattr(build, "verify", verify)
    return w


def run(req: Request, said: list[str] | None = None) -> dict:
    err = io.StringIO()
    try:
        return build.build(req, err=err)
    finally:
        (said if said is not None else []).extend(err.getvalue().splitlines())


def test_a_gpu_dry_run_lists_what_the_folder_would_hold(world):
    said: list[str] = []
    m = run(gpu_request(stubs=("tilelang",), drop_kernels=("fa2",)), said)
    said_text = "\n".join(said)
    assert "wheelhouse: vllm 0.34.0: newest release whose torch pin admits the image's torch 2.14.0+cu130" in said_text
    assert world.resolved == [(["vllm==0.34.0", "nixl-cu13==1.5.1", "pytest==9.2.0", "torch==2.14.0"], [])]
    assert m["vllm"]["version"] == "0.34.0" and not m["vllm"]["forced"]
    assert m["torch"] == {"image": "2.14.0+cu130", "cuda_major": 13, "index_torch_cuda_major": 13}
    assert m["nixl"]["backend"] == "nixl-cu13" and m["no_deps"] == ["nixl==1.5.1"]
    assert m["requirements"] == ["vllm==0.34.0", "nixl-cu13==1.5.1", "pytest==9.2.0"]
    assert m["target"]["image"] == "torch 2.14.0+cu130" and m["system_site_packages"]
    assert {x["name"] for x in m["left_out"]} == {"torch", "triton", "cuda-toolkit"}  # the image has them
    assert [s["name"] for s in m["stubs"]] == ["tilelang"]
    wheels = {w["name"]: w for w in m["wheels"]}
    assert set(wheels) == {"vllm", "nixl-cu13", "pytest", "numpy", "nixl", "tilelang"}
    assert wheels["vllm"]["size"] == 1000 and wheels["vllm"]["file"] == filename("vllm", "0.34.0")
    assert wheels["tilelang"] == {"name": "tilelang", "version": "0.1.6", "file": wheels["tilelang"]["file"]} | {
        "size": 0,
        "stub": True,
    }
    [drop] = m["dropped_kernels"]
    assert drop["wheel"] == filename("vllm", "0.34.0") and [f["path"] for f in drop["files"]] == [FA2]
    assert m["totals"]["wheels"] == 6 and "verify" not in m
    assert world.fetched == []  # a dry run downloads nothing
    assert sorted(p.name for p in (world.tmp / "work").iterdir()) == ["dry-run.log", "remote0"]


def test_a_gpu_build_writes_the_folder_checks_it_and_removes_stale_wheels(world):
    out = world.tmp / "wh"
    out.mkdir()
    (out / "manifest.json").write_text("{}")  # an earlier build's folder may be built again
    (out / "old-1.0-py3-none-any.whl").write_text("stale")
    (out / "notes.txt").write_text("mine")
    m = run(gpu_request(out=out, dry_run=False, stubs=("tilelang",), drop_kernels=("fa2",)))
    assert len(world.fetched) == 5 and world.verified == [(out, sys.executable)]
    files = sorted(p.name for p in out.iterdir())
    assert "old-1.0-py3-none-any.whl" not in files and "notes.txt" in files and "wheelhouse.log" in files
    assert "tilelang-0.1.6-py3-none-any.whl" in files  # the stub stand-in
    assert (out / "requirements.txt").read_text() == "vllm==0.34.0\nnixl-cu13==1.5.1\npytest==9.2.0\n"
    assert (out / "requirements-nodeps.txt").read_text() == "nixl==1.5.1\n"
    assert json.loads((out / "pip-report.json").read_text())["install"][0]["metadata"]["name"] == "vllm"
    assert json.loads((out / "manifest.json").read_text()) == json.loads(json.dumps(m))  # the final one, verified
    assert m["verify"] == {"ok": True} and isinstance(m["build_s"], float)
    vllm = next(w for w in m["wheels"] if w["name"] == "vllm")
    assert vllm["index_sha256"] == "sha-vllm"  # repacked without FA2
    with zipfile.ZipFile(out / vllm["file"]) as z:
        assert FA2 not in z.namelist()
    assert m["dropped_kernels"][0]["files"][0]["path"] == FA2
    assert next(w for w in m["wheels"] if w["name"] == "tilelang")["stub"] is True


def test_a_cpu_dry_run_ships_everything_under_the_lock(world):
    world.install = CPU_INSTALL
    m = run(gpu_request(device="cpu", torch=None))
    assert world.resolved == [(["pytest==9.2.0", "numpy"], ["numpy==2.3.5", "pyyaml==6.0.4", "pytest==9.2.0"])]
    assert m["constraints"] and not m["system_site_packages"] and m["left_out"] == [] and m["no_deps"] == []
    assert m["target"]["image"] is None and m["requirements"] == ["pytest==9.2.0", "numpy==2.3.5"]
    assert sorted(w["name"] for w in m["wheels"]) == ["numpy", "pytest"]


def test_what_a_build_refuses(world):
    with pytest.raises(ConfigError, match=r"needs an output folder \(--out DIR\)"):
        run(gpu_request(dry_run=False))
    full = world.tmp / "full"
    full.mkdir()
    (full / "x").write_text("")
    with pytest.raises(ConfigError, match="is not empty and holds no manifest.json"):
        run(gpu_request(out=full, dry_run=False))
    with pytest.raises(ConfigError, match="--stub absent: not in the resolution"):
        run(gpu_request(stubs=("absent",)))
    with pytest.raises(ConfigError, match="--drop-kernels 'nope'"):
        run(gpu_request(drop_kernels=("nope",)))
    assert world.resolved == [(["vllm==0.34.0", "nixl-cu13==1.5.1", "pytest==9.2.0", "torch==2.14.0"], [])]


def test_a_release_pip_cannot_install_is_explained_on_gpu_and_left_as_it_is_on_cpu(world, monkeypatch):
    world.fail = Unservable("no distribution of x==1", "x==1")
    asked = []

    def older(e, plan, req, target, index, log, say):
        asked.append((e, plan.roots[0]))
        return ReleaseUnavailable("vllm 0.34.0 cannot be installed", "0.33.0")

    monkeypatch.setattr(build, "older_release_error", older)
    with pytest.raises(ReleaseUnavailable, match="cannot be installed") as got:
        run(gpu_request())
    assert got.value.__cause__ is None and asked == [(world.fail, "vllm==0.34.0")]
    with pytest.raises(Unservable) as same:
        run(gpu_request(device="cpu", torch=None))
    assert same.value is world.fail and len(asked) == 1
    assert sorted(p.name for p in (world.tmp / "work").iterdir()) == ["dry-run.log"]  # the resolve folders went


def test_the_gpu_plan_takes_cuda_and_nixl_from_the_image_the_index_or_the_flags(world):
    say: list[str] = []
    index = cast(Index, FakeIndex())
    plan = build.plan_gpu(gpu_request(torch="2.14.0"), index, say.append)  # no +cuXYZ: the index's torch says
    assert plan.info["torch"]["cuda_major"] == 13 and plan.roots[1] == "nixl-cu13==1.5.1"
    plan = build.plan_gpu(gpu_request(vllm="0.34.0", nixl="1.6.0"), index, say.append)
    assert (
        plan.info["vllm"]["forced"]
        and plan.no_deps == ["nixl==1.6.0"]
        and plan.vllm_requires == DISTS["vllm"]["0.34.0"]
    )
    assert "asked for (--vllm)" in say[-1]
    with pytest.raises(ConfigError, match="built for CUDA 12, but the index's torch 2.14.0 .* for CUDA 13"):
        build.plan_gpu(gpu_request(cuda=12), index, say.append)
    (world.tmp / "repo" / "requirements" / "gpu.txt").write_text("vllm==0.34.0\n")
    with pytest.raises(ConfigError, match="no nixl version: give --nixl"):
        build.plan_gpu(gpu_request(), index, say.append)
    with pytest.raises(ConfigError, match="the index has no vllm wheel for python 3.12 manylinux_2_31_aarch64"):
        build.plan_gpu(gpu_request(platform="manylinux_2_31_aarch64"), index, say.append)
