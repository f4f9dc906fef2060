"""What a wheelhouse holds (plan.py, pure): vLLM release choice, what the image has, harness pins, completeness.
Recorded metadata only (tests/unit/wheelhouse/data/), no network."""

from __future__ import annotations

import pytest

from harness.core.errors import ConfigError
from harness.wheelhouse import plan as wh
from tests.unit.wheelhouse.wheels import DATA, load

ENV = wh.marker_env("3.12", "x86_64")
HARNESS_PINS = ["pytest==9.2.0", "requests==2.34.2", "fastapi==0.136.3", "lm_eval[api]==0.4.13", "tokenizers==0.23.3"]
ROOTS = ["vllm==0.26.0", "nixl-cu13==1.5.1", *HARNESS_PINS]


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
    freeze = wh.parse_freeze(
        "torch==2.11.0+cu130\ntyping_extensions==4.9.0\nnumpy=="
        + graph.dists["numpy"].version
        + "\nsympy==1.13.3\nsomething-else==1.0\n"
    )
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
    got = wh.parse_freeze(
        "# comment\nTorch==2.11.0+cu130\nmy_pkg @ file:///build/my_pkg-1.0-py3-none-any.whl\n"
        "-e git+https://x/y#egg=y\nzipp===3.20\nnumba\n"
    )
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
    dists = [
        wh.Dist("transformers", "5.5.3", ("tokenizers<0.23,>=0.22",)),
        wh.Dist("tokenizers", "0.22.2", ()),
        wh.Dist("requests", "2.34.2", ()),
        wh.Dist("vllm", "0.26.0", ("transformers>=5.5.3", "requests>=2.26")),
    ]
    g = wh.build_graph(dists, ENV, ["vllm==0.26.0", "tokenizers", "requests"])
    got = wh.pin_conflicts(["tokenizers==0.23.3", "requests==2.34.2"], g)
    assert [(c.pin, c.resolved, c.needed_by) for c in got] == [
        ("tokenizers==0.23.3", "0.22.2", ("transformers: tokenizers<0.23,>=0.22",))
    ]
    assert wh.unpin("lm_eval[api]==0.4.13") == "lm_eval[api]"


def test_extras_switch_on_requirements(graph):
    # fastapi[standard] (from vLLM) brings uvicorn[standard] and so uvloop; cuda-toolkit's extras the nvidia libraries.
    assert "standard" in graph.extras["fastapi"]
    assert {"cublas", "cudart"} <= graph.extras["cuda-toolkit"]
    assert any(e.src == "cuda-toolkit" and e.dst == "nvidia-cublas" for e in graph.edges)


def test_closure_check_finds_what_the_folder_and_image_lack():
    wheels = {
        "app": ("1.0", ["lib>=2", "torch==2.11.0", "extra-only; extra == 'x'", "win-only; sys_platform == 'win32'"]),
        "lib": ("2.1", ["six; python_version > '3.11'"]),
        "six": ("1.17.0", []),
    }
    image: dict[str, str | None] = {"torch": "2.11.0+cu130"}
    assert wh.check_closure(["app==1.0"], wheels, image, ENV) == []
    assert wh.check_closure(["app==1.0"], {k: v for k, v in wheels.items() if k != "six"}, image, ENV) == [
        "lib 2.1 needs six: not in the folder, not in the image"
    ]
    assert wh.check_closure(["app==1.0"], wheels, {"torch": "2.13.0"}, ENV) == [
        "app 1.0 needs torch==2.11.0, the image has torch 2.13.0"
    ]
    assert "extra-only" in wh.check_closure(["app[x]==1.0"], wheels, image, ENV)[0]
    # A dist installed with --no-deps: its requirements are not followed (nixl's on both CUDA backends).
    assert wh.check_closure(["app==1.0"], {"app": wheels["app"]}, image, ENV, no_deps={"app"}) == []


def test_recorded_report_is_what_the_graph_reads():
    r = load("pip-report-vllm-0.26.0-py312.json")
    names = {d.name for d in wh.parse_report(r)}
    assert {"vllm", "torch", "nixl-cu13", "sqlitedict"} <= names
    sql = next(d for d in wh.parse_report(r) if d.name == "sqlitedict")
    assert sql.url.startswith("file://")  # built here from its sdist (PyPI has no wheel)


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


# --- the newest release cannot be installed: an older one that can ------------------------------------------------

V = wh.Version
# What the index served for python 3.12 manylinux_2_31_x86_64 (2026-12): vllm 0.34.0 pins flashinfer-python 0.7.3,
# which it does not serve (0.7.2.post1 and 0.7.4 are there).
SERVED = {
    "torch": [V("2.14.0"), V("2.13.0"), V("2.11.0")],
    "torchaudio": [V("2.11.0")],
    "torchvision": [V("0.29.0"), V("0.28.0")],
    "flashinfer-python": [V("0.7.4"), V("0.7.2.post1"), V("0.7.2"), V("0.7.2rc6"), V("0.7.0.post1")],
    "llguidance": [V("1.6.1")],  # on manylinux_2_28: 1.7 and 1.8 ship manylinux_2_31 wheels only
    "pre-only": [V("2.0rc1")],
}
RELEASES = [
    ("0.34.0", ["torch==2.14.0", "torchaudio==2.11.0", "torchvision==0.29.0", "flashinfer-python==0.7.3"]),
    ("0.33.1", ["torch==2.14.0", "torchaudio==2.11.0", "torchvision==0.29.0", "flashinfer-python==0.7.3"]),
    ("0.33.0", ["torch==2.14.0", "torchaudio==2.11.0", "torchvision==0.29.0", "flashinfer-python==0.7.2.post1"]),
    ("0.32.0", ["torch==2.13.0", "torchaudio==2.11.0", "torchvision==0.28.0", "flashinfer-python==0.7.0.post1"]),
]


def served(name: str) -> list:
    return SERVED.get(name, [])


def test_unserved_names_the_requirement_and_what_the_index_has_near_it():
    got = wh.unserved(RELEASES[0][1], ENV, served)
    assert got == wh.Unserved("flashinfer-python==0.7.3", ("0.7.2.post1", "0.7.4"))
    assert got.why() == (
        "it needs flashinfer-python==0.7.3, which the index does not serve for that target "
        "(nearest there: 0.7.2.post1, 0.7.4)"
    )
    assert wh.unserved(RELEASES[2][1], ENV, served) is None
    # Requirements that do not apply on the target are not looked at; a project the index lacks has no near versions.
    assert wh.unserved(["win-only; sys_platform == 'win32'", "flashinfer-python[x]>=0.7"], ENV, served) is None
    missing = wh.unserved(["nowhere>=1"], ENV, served)
    assert missing == wh.Unserved("nowhere>=1") and "the index serves no nowhere for that target" in missing.why()
    near = wh.unserved(["llguidance<1.8,>=1.7"], ENV, served)
    assert near is not None and near.nearest == ("1.6.1",)


def test_a_pre_release_counts_as_pip_counts_it():
    assert wh.unserved(["pre-only>=1"], ENV, served) is None  # nothing final meets it: pip takes the pre-release
    assert wh.unserved(["flashinfer-python>0.7.4"], ENV, served) is not None
    assert wh.unserved(["flashinfer-python==0.7.2rc6"], ENV, served) is None  # named: allowed


def test_the_newest_older_release_that_the_index_serves_everything_for():
    chosen, checked = wh.installable_release(RELEASES[1:], "2.14.0+cu130", ENV, served)
    assert chosen == "0.33.0"
    assert [(c.version, c.blocker is None) for c in checked] == [("0.33.1", False), ("0.33.0", True)]
    assert "flashinfer-python==0.7.3" in (checked[0].blocker or "")


def test_releases_whose_torch_pin_misses_the_image_torch_do_not_count():
    chosen, checked = wh.installable_release(RELEASES[1:2] + RELEASES[3:], "2.14.0+cu130", ENV, served)
    assert chosen is None
    assert checked[-1] == wh.ReleaseCheck("0.32.0", "==2.13.0", "it needs torch==2.13.0, not 2.14.0+cu130")


def test_the_search_is_bounded_and_lazy():
    read = []

    def lazily():
        for v in range(100):
            read.append(v)
            yield f"0.{100 - v}.0", ["torch==2.14.0", "flashinfer-python==0.7.3"]

    chosen, checked = wh.installable_release(lazily(), "2.14.0", ENV, served, limit=3)
    assert chosen is None and len(checked) == 3 and read == [0, 1, 2]  # no metadata read beyond the limit
    found = iter(RELEASES[1:])
    assert next(wh.older_releases(found, "2.14.0", ENV, served)).version == "0.33.1"
    assert next(found)[0] == "0.33.0"  # nothing read beyond what the caller took


def test_the_advice_says_why_and_which_release_can_with_the_command():
    checked = [
        wh.ReleaseCheck("0.33.1", "==2.14.0", "it needs flashinfer-python==0.7.3, which ..."),
        wh.ReleaseCheck("0.33.0", "==2.14.0", None),
    ]
    why = wh.Unserved("flashinfer-python==0.7.3", ("0.7.2.post1", "0.7.4")).why()
    cmd = "python -m harness wheelhouse --dry-run --torch 2.14.0+cu130 --vllm 0.33.0"
    msg = wh.release_advice("0.34.0", "2.14.0+cu130", "python 3.12 manylinux_2_31_x86_64", why, checked, "0.33.0", cmd)
    assert msg == (
        "vllm 0.34.0 cannot be installed for torch 2.14.0+cu130 on python 3.12 manylinux_2_31_x86_64: it needs "
        "flashinfer-python==0.7.3, which the index does not serve for that target (nearest there: 0.7.2.post1, "
        "0.7.4); vllm 0.33.0 can (0.33.1: it needs flashinfer-python==0.7.3, which ...): " + cmd
    )
    none = wh.release_advice("0.34.0", "2.14.0", "py", why, checked[:1], None, "")
    assert "no older release can (looked at 1, at most 8: 0.33.1: it needs flashinfer" in none
    assert "--vllm VERSION" in none
    assert "the index has no older vllm release" in wh.release_advice("0.5.2", "2.14.0", "py", why, [], None, "")
