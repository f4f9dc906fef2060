"""The offline wheelhouse: vLLM release choice, what the image has, harness pins, completeness, repacking, the
command's input errors. Recorded metadata only (tests/unit/envs/data/), no network."""

from __future__ import annotations

import json
import sys
import zipfile
from pathlib import Path

import pytest

from harness.core.errors import ConfigError
from harness.envs import wheelhouse as wh
from harness.envs.pypi import expand_platform, min_glibc, parse_project_page, platform_machine, releases
from harness.envs.wheel_repack import drop_files, record_without
from harness.envs.wheelhouse_build import kernel_patterns, verify, wheel_metadata
from harness.envs.wheelhouse_pip import Sources, isolated_env, stub_wheel

DATA = Path(__file__).parent / "data"
ENV = wh.marker_env("3.12", "x86_64")
HARNESS_PINS = ["pytest==9.2.0", "requests==2.34.2", "fastapi==0.136.3", "lm_eval[api]==0.4.13", "tokenizers==0.23.3"]
ROOTS = ["vllm==0.26.0", "nixl-cu13==1.5.1", *HARNESS_PINS]


def load(name: str):
    return json.loads((DATA / name).read_text())


def vllm_releases():
    return [(r["version"], r["requires_dist"]) for r in load("vllm-releases-torch-pins.json")["releases"]]


@pytest.fixture(scope="module")
def graph() -> wh.Graph:
    return wh.build_graph(wh.parse_report(load("pip-report-vllm-0.26.0-py312.json")), ENV, ROOTS + ["torch==2.11.0"])


# --- the vLLM release and CUDA -------------------------------------------------------------------------------------


def test_newest_vllm_whose_torch_pin_admits_the_image_torch():
    chosen, checked = wh.choose_vllm(vllm_releases(), "2.11.0+cu130", ENV)
    assert chosen == "0.26.0"
    # 0.27.0 and later pin torch 2.13/2.14; they were looked at, newest first, and nothing older than the choice.
    assert [c.version for c in checked][:2] == ["0.34.0", "0.33.0"] and checked[-1].version == "0.26.0"
    assert not any(c.fits for c in checked[:-1]) and checked[-1].torch == "==2.11.0"


def test_only_the_releases_down_to_the_choice_are_read():
    read = []

    def lazily():
        for v, req in vllm_releases():
            read.append(v)
            yield v, req

    wh.choose_vllm(lazily(), "2.11.0+cu130", ENV)
    assert read[-1] == "0.26.0" and "0.25.1" not in read


def test_a_forced_vllm_must_admit_the_image_torch():
    assert wh.choose_vllm(vllm_releases(), "2.11.0+cu130", ENV, forced="0.24.0")[0] == "0.24.0"
    with pytest.raises(ConfigError, match=r"vllm 0.32.0 requires torch==2.13.0, not the image's torch 2.11.0\+cu130"):
        wh.choose_vllm(vllm_releases(), "2.11.0+cu130", ENV, forced="0.32.0")
    with pytest.raises(ConfigError, match="no wheel"):
        wh.choose_vllm(vllm_releases(), "2.11.0+cu130", ENV, forced="9.9.9")


def test_no_release_for_an_unknown_torch_is_an_error_naming_what_was_seen():
    with pytest.raises(ConfigError, match=r"admits 2.12.0.*0.34.0 \(torch==2.14.0\)"):
        wh.choose_vllm(vllm_releases(), "2.12.0", ENV)


def test_cuda_major_from_local_label_or_metadata():
    assert wh.cuda_major("2.11.0+cu130") == 13
    assert wh.cuda_major("2.9.0+cu128") == 12
    assert wh.cuda_major("2.13.0+cpu") is None
    assert wh.cuda_major(None, load("torch-2.11.0-requires.json")["requires_dist"]) == 13  # cuda-toolkit==13.0.2
    assert wh.cuda_major(None, ["nvidia-cudnn-cu12==9.1.0.70; platform_system == 'Linux'"]) == 12
    assert wh.cuda_major(None, ["filelock"]) is None


# --- the image and the folder --------------------------------------------------------------------------------------


def test_torch_image_leaves_out_torch_what_it_pins_and_what_only_it_needs(graph):
    pins = wh.torch_pins(graph)
    assert pins["triton"] == "3.6.0" and pins["nvidia-cudnn-cu13"] == "9.19.0.56" and pins["cuda-toolkit"] == "13.0.2"
    assert pins["nvidia-cublas"] == "13.1.0.3"  # through cuda-toolkit[cublas]==13.0.2 -> nvidia-cublas==13.1.0.3.*
    assert "filelock" not in pins and "cuda-bindings" not in pins  # torch's ranges, not pins
    kept, left = wh.split_by_image(graph, {"torch": "2.11.0+cu130", **pins}, ROOTS, {"torch": "the image's torch"})
    left_by = {x.name: x for x in left}
    assert left_by["torch"].version == "2.11.0+cu130" and left_by["torch"].provided
    assert set(pins) <= set(left_by)
    assert {"sympy", "mpmath", "networkx"} <= set(left_by) and not left_by["sympy"].provided  # torch's alone
    kept_by = {k.name: k for k in kept}
    assert {"vllm", "nixl-cu13", "lm-eval", "torchvision", "torchaudio", "torchcodec"} <= set(kept_by)
    assert "nixl-cu12" not in kept_by and "torch" not in kept_by
    # torch needs these too, but so does vLLM's side, and the image's version is unknown: shipped, with a note.
    for name in ("filelock", "typing-extensions", "setuptools", "jinja2", "fsspec", "cuda-bindings"):
        assert "the image's torch needs it too" in kept_by[name].note
    assert len(kept) + len(left) == len(graph.dists)


def test_freeze_image_leaves_out_what_satisfies_every_requirement(graph):
    freeze = wh.parse_freeze("torch==2.11.0+cu130\ntyping_extensions==4.9.0\nnumpy==" + graph.dists["numpy"].version +
                             "\nsympy==1.13.3\nsomething-else==1.0\n")
    kept, left = wh.split_by_image(graph, freeze, ROOTS, {})
    left_names = {x.name for x in left}
    kept_by = {k.name: k for k in kept}
    assert {"torch", "numpy", "sympy"} <= left_names
    # vLLM needs typing_extensions>=4.10: the image's 4.9.0 does not do, the folder ships a newer one.
    assert "typing-extensions" in kept_by and "the image has 4.9.0" in kept_by["typing-extensions"].note
    # With a freeze, torch's exact pins are not assumed: what only torch needs is left out; triton, which the freeze
    # does not list and xgrammar needs too, is shipped.
    assert "nvidia-cudnn-cu13" in left_names and "triton" in kept_by


def test_parse_freeze():
    got = wh.parse_freeze("# comment\nTorch==2.11.0+cu130\nmy_pkg @ file:///build/my_pkg-1.0-py3-none-any.whl\n"
                          "-e git+https://x/y#egg=y\nzipp===3.20\nnumba\n")
    assert got == {"torch": "2.11.0+cu130", "my-pkg": None, "zipp": "3.20", "numba": None}
    with pytest.raises(ConfigError, match="not a `name==version` line"):
        wh.parse_freeze("numpy>=1\n")


def test_an_image_package_of_unknown_version_does_only_where_no_version_is_asked(graph):
    # ninja: whoever needs it takes any version; llvmlite: numba asks for a range, which an unknown version may miss.
    kept, left = wh.split_by_image(graph, {"torch": "2.11.0+cu130", "ninja": None, "llvmlite": None}, ROOTS, {})
    left_by, kept_by = {x.name: x for x in left}, {k.name: k for k in kept}
    assert left_by["ninja"].provided
    assert "the image has it at a version not known here, and numba needs llvmlite" in kept_by["llvmlite"].note


def test_harness_pins_that_vllm_excludes_are_reported():
    dists = [wh.Dist("transformers", "5.5.3", ("tokenizers<0.23,>=0.22",)), wh.Dist("tokenizers", "0.22.2", ()),
             wh.Dist("requests", "2.34.2", ()), wh.Dist("vllm", "0.26.0", ("transformers>=5.5.3", "requests>=2.26"))]
    g = wh.build_graph(dists, ENV, ["vllm==0.26.0", "tokenizers", "requests"])
    got = wh.pin_conflicts(["tokenizers==0.23.3", "requests==2.34.2"], g)
    assert [(c.pin, c.resolved, c.needed_by) for c in got] == [("tokenizers==0.23.3", "0.22.2", ("transformers: tokenizers<0.23,>=0.22",))]
    assert wh.unpin("lm_eval[api]==0.4.13") == "lm_eval[api]"


def test_extras_switch_on_requirements(graph):
    # fastapi[standard] (from vLLM) brings uvicorn[standard] and so uvloop; cuda-toolkit's extras the nvidia libraries.
    assert "standard" in graph.extras["fastapi"]
    assert {"cublas", "cudart"} <= graph.extras["cuda-toolkit"]
    assert any(e.src == "cuda-toolkit" and e.dst == "nvidia-cublas" for e in graph.edges)


def _wheel(folder: Path, name: str, version: str, requires: list[str] = (), files: dict[str, bytes] | None = None) -> Path:
    dist = name.replace("-", "_")
    info = f"{dist}-{version}.dist-info"
    path = folder / f"{dist}-{version}-py3-none-any.whl"
    files = dict(files or {f"{dist}/__init__.py": b""})
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
    with zipfile.ZipFile(path, "w", zipfile.ZIP_DEFLATED) as z:
        for n, data in files.items():
            z.writestr(n, data)
        z.writestr(f"{info}/METADATA", meta)
        z.writestr(f"{info}/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr(f"{info}/RECORD", "".join(f"{n},sha256=x,{len(d)}\n" for n, d in files.items()) +
                   f"{info}/METADATA,,\n{info}/WHEEL,,\n{info}/RECORD,,\n")
    return path


def test_closure_check_finds_what_the_folder_and_image_lack():
    wheels = {"app": ("1.0", ["lib>=2", "torch==2.11.0", "extra-only; extra == 'x'", "win-only; sys_platform == 'win32'"]),
              "lib": ("2.1", ["six; python_version > '3.11'"]), "six": ("1.17.0", [])}
    image = {"torch": "2.11.0+cu130"}
    assert wh.check_closure(["app==1.0"], wheels, image, ENV) == []
    assert wh.check_closure(["app==1.0"], {k: v for k, v in wheels.items() if k != "six"}, image, ENV) == \
        ["lib 2.1 needs six: not in the folder, not in the image"]
    assert wh.check_closure(["app==1.0"], wheels, {"torch": "2.13.0"}, ENV) == \
        ["app 1.0 needs torch==2.11.0, the image has torch 2.13.0"]
    assert "extra-only" in wh.check_closure(["app[x]==1.0"], wheels, image, ENV)[0]
    # A dist installed with --no-deps: its requirements are not followed (nixl's on both CUDA backends).
    assert wh.check_closure(["app==1.0"], {"app": wheels["app"]}, image, ENV, no_deps={"app"}) == []


def _manifest(folder: Path, wheels: list[Path], roots: list[str], left_out: list[dict], no_deps=()) -> None:
    from harness.envs.wheelhouse_pip import sha256_of

    entries = []
    for p in wheels:
        name, version, _ = wheel_metadata(p)
        entries.append({"name": name, "version": version, "file": p.name, "sha256": sha256_of(p), "size": p.stat().st_size})
    py = "%d.%d" % sys.version_info[:2]
    (folder / "manifest.json").write_text(json.dumps({
        "format": 1, "device": "gpu", "target": {"python": py, "platform": "manylinux_2_31_x86_64"},
        "wheels": entries, "left_out": left_out, "no_deps": list(no_deps)}))
    (folder / "requirements.txt").write_text("".join(r + "\n" for r in roots))


def test_verify_passes_a_complete_folder_and_names_what_is_missing(tmp_path, monkeypatch):
    monkeypatch.setattr("harness.envs.wheelhouse_build.WORK_DIR", tmp_path / "work")
    folder = tmp_path / "wh"
    folder.mkdir()
    ws = [_wheel(folder, "app", "1.0", ["lib>=2", "torch==2.11.0"]), _wheel(folder, "lib", "2.1")]
    left = [{"name": "torch", "version": "2.11.0+cu130", "why": "the image's torch", "provided": True}]
    _manifest(folder, ws, ["app==1.0"], left)
    got = verify(folder, sys.executable)
    assert got["ok"] and got["closure_problems"] == [] and got["pip"] == "ok", got
    (folder / ws[1].name).unlink()
    got = verify(folder, sys.executable)
    assert not got["ok"]
    assert any("lib-2.1-py3-none-any.whl is missing" in p for p in got["closure_problems"])
    assert got["pip"] != "ok"  # pip, from the folder alone, cannot find lib either


def test_stub_wheels_stand_for_the_image(tmp_path):
    p = stub_wheel(tmp_path, "torch", "2.11.0+cu130")
    assert p.name == "torch-2.11.0+cu130-py3-none-any.whl"
    assert wheel_metadata(p) == ("torch", "2.11.0+cu130", [])


# --- repacking, tags, pip's environment ------------------------------------------------------------------------------


def test_drop_kernels_repacks_the_wheel_and_its_record(tmp_path):
    files = {"vllm/__init__.py": b"x = 1\n", "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so": b"\0" * 5000,
             "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so": b"\1" * 3000}
    w = _wheel(tmp_path, "vllm", "0.26.0", files=files)
    dropped = drop_files(w, kernel_patterns(("fa2",)))
    assert [(d.path, d.size) for d in dropped] == [("vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so", 5000)]
    with zipfile.ZipFile(w) as z:
        names = z.namelist()
        record = z.read("vllm-0.26.0.dist-info/RECORD").decode()
        assert z.read("vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so") == b"\1" * 3000
    assert "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so" not in names and "_vllm_fa2_C" not in record
    assert "vllm/vllm_flash_attn/_vllm_fa3_C.abi3.so" in record
    assert drop_files(w, kernel_patterns(("fa2",))) == []  # nothing left to drop
    with pytest.raises(ConfigError, match="--drop-kernels 'fa9'"):
        kernel_patterns(("fa9",))


def test_record_without_handles_quoted_paths():
    rec = 'a/b.py,sha256=1,2\n"a/c,d.so",sha256=3,4\na/e.so,sha256=5,6\n'
    assert record_without(rec, {"a/c,d.so", "a/e.so"}) == "a/b.py,sha256=1,2\n"


def test_platform_expansion_and_release_choice():
    plats = expand_platform("manylinux_2_31_x86_64")
    assert plats[0] == "manylinux_2_31_x86_64" and "manylinux_2_17_x86_64" in plats and "manylinux2014_x86_64" in plats
    assert "manylinux_2_32_x86_64" not in plats and "manylinux2014_x86_64" in expand_platform("manylinux_2_17_x86_64")
    assert "manylinux2014_x86_64" not in expand_platform("manylinux_2_12_x86_64")
    assert platform_machine("manylinux_2_31_x86_64") == "x86_64" and platform_machine("manylinux2014_aarch64") == "aarch64"
    page = parse_project_page(load("llguidance-page.json"))
    on_228 = releases(page, "3.12", expand_platform("manylinux_2_28_x86_64"))
    assert [str(v) for v in on_228] == ["1.6.1"]  # 1.7.6 and 1.8.0 ship manylinux_2_31 wheels only
    assert [str(v) for v in releases(page, "3.12", expand_platform("manylinux_2_31_x86_64"))] == ["1.8.0", "1.7.6", "1.6.1"]
    assert min_glibc(page, "3.12", "x86_64", "<1.8.0,>=1.7.0") == (2, 31)
    assert min_glibc(page, "3.12", "x86_64", "<1.7") == (2, 28)


def test_pip_runs_without_this_machines_config():
    env = isolated_env({"PIP_FIND_LINKS": "/opt/wheels", "PIP_INDEX_URL": "file:///x", "PIP_CERT": "/ca.pem", "HOME": "/root"})
    assert env["PIP_CONFIG_FILE"] == __import__("os").devnull
    assert "PIP_FIND_LINKS" not in env and "PIP_INDEX_URL" not in env
    assert env["PIP_CERT"] == "/ca.pem" and env["HOME"] == "/root"
    assert Sources(None, find_links=("/w",)).args() == ["--no-index", "--find-links", "/w"]


# --- the command ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("argv, message", [
    (["--out", "X"], "--torch VERSION"),
    (["--out", "X", "--torch", "2.11.0+cu130"], "--python"),
    (["--out", "X", "--device", "cpu", "--torch", "2.11.0"], "--device cpu takes no --torch"),
    (["--out", "X", "--torch", "2.11.0", "--python", "3", "--platform", "manylinux_2_31_x86_64"], "--python '3'"),
    (["--torch", "2.11.0"], "--out DIR"),
    (["--dry-run", "--torch", "2.11.0+cu130"], "--python"),  # a dry run needs no --out: the next problem is named
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    from harness.cli import main

    assert main(["wheelhouse", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1


def test_verify_of_a_folder_without_manifest_is_exit_2(tmp_path, capsys):
    from harness.cli import main

    assert main(["wheelhouse", "--verify", str(tmp_path)]) == 2
    assert "not a wheelhouse" in capsys.readouterr().err


def test_image_freeze_without_torch_is_exit_2(tmp_path, capsys):
    from harness.cli import main

    freeze = tmp_path / "freeze.txt"
    freeze.write_text("numpy==2.3.5\n")
    assert main(["wheelhouse", "--out", str(tmp_path / "o"), "--image-freeze", str(freeze), "--python", "3.12",
                 "--platform", "manylinux_2_31_x86_64"]) == 2
    assert "lists no torch" in capsys.readouterr().err


def test_fa2_drop_is_the_fa2_library_only():
    assert kernel_patterns(("fa2",)) == ["vllm/vllm_flash_attn/_vllm_fa2_C*.so"]
    assert kernel_patterns(("vllm/foo/*.so",)) == ["vllm/foo/*.so"]


def test_recorded_report_is_what_the_graph_reads():
    r = load("pip-report-vllm-0.26.0-py312.json")
    names = {d.name for d in wh.parse_report(r)}
    assert {"vllm", "torch", "nixl-cu13", "sqlitedict"} <= names
    sql = next(d for d in wh.parse_report(r) if d.name == "sqlitedict")
    assert sql.url.startswith("file://")  # built here from its sdist (PyPI has no wheel)



def test_pack_splits_into_parts_that_reassemble_into_a_complete_folder(tmp_path, monkeypatch):
    import io
    import tarfile

    from harness.envs.wheelhouse_pack import pack

    monkeypatch.setattr("harness.envs.wheelhouse_build.WORK_DIR", tmp_path / "work")
    folder = tmp_path / "wh"
    folder.mkdir()
    noise = bytes(range(256)) * 4000  # ~1 MB that deflate and xz both squeeze
    ws = [_wheel(folder, "app", "1.0", ["lib>=2"], files={"app/__init__.py": b"", "app/blob.bin": noise}),
          _wheel(folder, "lib", "2.1", files={"lib/__init__.py": b"", "lib/data.bin": __import__("os").urandom(300_000)})]
    _manifest(folder, ws, ["app==1.0"], [])
    got = pack(folder, tmp_path / "parts", part_mib=1)
    assert len(got.parts) >= 1 and all(p.stat().st_size <= 1 << 20 for p in got.parts)
    assert "filter='data'" in got.unpack and (tmp_path / "parts" / "UNPACK.txt").exists()
    data = b"".join(p.read_bytes() for p in sorted(got.parts))
    dest = tmp_path / "node"
    tarfile.open(fileobj=io.BytesIO(data), mode="r|xz").extractall(dest, filter="data")
    back = dest / "wh"
    with zipfile.ZipFile(back / ws[0].name) as z:
        assert all(i.compress_type == zipfile.ZIP_STORED for i in z.infolist())
        assert z.read("app/blob.bin") == noise
    result = verify(back, sys.executable)
    assert result["ok"], result  # sha256 of the stored wheels in the packed manifest, closure, pip


def test_the_real_h200_image_freeze(graph):
    """`pip freeze` of the H200 image the one-GPU run used (python 3.12.3, torch 2.11.0+cu130, 196 packages):
    what it already has stays out of the folder; what vLLM or the harness pins beyond it ships."""
    freeze = wh.parse_freeze((DATA / "h200-torch2.11-cu130-freeze.txt").read_text())
    assert len(freeze) == 196 and freeze["torch"] == "2.11.0"
    kept, left = wh.split_by_image(graph, freeze, ROOTS, {})
    kept_by, left_names = {k.name: k for k in kept}, {x.name for x in left}
    assert {"torch", "triton", "nvidia-cudnn-cu13", "safetensors"} <= left_names
    assert {"vllm", "nixl-cu13"} <= set(kept_by)
    assert "tokenizers" in kept_by, "the harness pins 0.23.3; the image has 0.23.2"


def test_file_names_are_read_by_packaging():
    from packaging.version import Version

    from harness.envs.wheelhouse_pip import _already_built, _file_version

    assert _file_version("flashinfer_python-0.7.3.tar.gz") == Version("0.7.3")
    assert _file_version("Foo.Bar-1.0rc1.zip") == Version("1.0rc1")
    assert _file_version("torch-2.11.0+cu130-cp312-cp312-manylinux_2_28_x86_64.whl") == Version("2.11.0+cu130")
    assert _file_version("not-a-dist.txt") is None and _file_version("x-1.0-bad.whl") is None
    # built wheels are found by canonical name and exact version, never by a prefix
    assert not _already_built(Path("/nonexistent"), "x", "1.0")


def test_a_built_wheel_is_matched_by_name_and_version(tmp_path):
    from harness.envs.wheelhouse_pip import _already_built

    (tmp_path / "flash_attn-2.8.3-cp312-cp312-linux_x86_64.whl").write_bytes(b"")
    assert _already_built(tmp_path, "Flash.Attn", "2.8.3") and not _already_built(tmp_path, "flash-attn", "2.8")
