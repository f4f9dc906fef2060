"""Reading a package index (index.py): platform tags, which releases install on a target, the glibc a release's
wheels need. Recorded project pages only, no network."""

from __future__ import annotations

from harness.wheelhouse.index import expand_platform, min_glibc, parse_project_page, platform_machine, releases
from tests.unit.wheelhouse.wheels import load


def test_platform_expansion_and_release_choice():
    plats = expand_platform("manylinux_2_31_x86_64")
    assert plats[0] == "manylinux_2_31_x86_64" and "manylinux_2_17_x86_64" in plats and "manylinux2014_x86_64" in plats
    assert "manylinux_2_32_x86_64" not in plats and "manylinux2014_x86_64" in expand_platform("manylinux_2_17_x86_64")
    assert "manylinux2014_x86_64" not in expand_platform("manylinux_2_12_x86_64")
    assert platform_machine("manylinux_2_31_x86_64") == "x86_64"
    assert platform_machine("manylinux2014_aarch64") == "aarch64"
    page = parse_project_page(load("llguidance-page.json"))
    on_228 = releases(page, "3.12", expand_platform("manylinux_2_28_x86_64"))
    assert [str(v) for v in on_228] == ["1.6.1"]  # 1.7.6 and 1.8.0 ship manylinux_2_31 wheels only
    on_231 = releases(page, "3.12", expand_platform("manylinux_2_31_x86_64"))
    assert [str(v) for v in on_231] == ["1.8.0", "1.7.6", "1.6.1"]
    assert min_glibc(page, "3.12", "x86_64", "<1.8.0,>=1.7.0") == (2, 31)
    assert min_glibc(page, "3.12", "x86_64", "<1.7") == (2, 28)
