"""harness/core/safe.py: the allow-lists, the containment check, the quoting helpers and the JSON-object reader."""

import json
import shlex

import pytest

from harness.core.errors import ConfigError
from harness.core.safe import (
    comment,
    file_stem,
    load_json_object,
    safe_name,
    shell_line,
    under,
    version,
)


@pytest.mark.parametrize("name", ["0.21.0", "tiny-k1-p1-d2", "2.11.0+cpu", "a", "X_1.y"])
def test_safe_names_pass(name):
    assert safe_name(name, "id") == name


@pytest.mark.parametrize(
    "name", ["", ".", "..", "../x", "a/b", "/abs", ".hidden", "-flag", "a b", "a\nb", "é", None, 3, "x" * 129]
)
def test_unsafe_names_are_one_line_errors(name):
    with pytest.raises(ConfigError) as e:
        safe_name(name, "matrix entry id")
    assert "\n" not in str(e.value) and str(e.value).startswith("matrix entry id ")


@pytest.mark.parametrize("v", ["0.21.0", "0.11.0rc1", "2.11.0+cpu", "1.0.post1.dev3+g1a2b", "3.12"])
def test_versions_pass(v):
    assert version(v, "v") == v


@pytest.mark.parametrize("v", ["", "latest", "0.21.0\n", "1.0 ; x", "$(id)", "1.0/../x", "1" * 65])
def test_non_versions_are_refused(v):
    with pytest.raises(ConfigError):
        version(v, "versions.vllm")


@pytest.mark.parametrize("value", ["../x/y", "/etc/passwd", "..", ".", "", "a" * 500, "a\x00b", "é/ü", "x+y"])
def test_file_stem_is_one_safe_component(tmp_path, value):
    stem = file_stem(value)
    assert "/" not in stem and not stem.startswith(".") and len(stem) <= 64
    assert safe_name(stem, "stem") == stem
    assert (tmp_path / f"{stem}.held").parent == tmp_path


def test_file_stem_keeps_a_safe_id_and_tells_apart_values_that_read_alike():
    assert file_stem("req-7") == "req-7"
    assert file_stem("a/b") != file_stem("a_b") and file_stem("a/b") != file_stem("a?b")


def test_under_refuses_paths_outside_the_root(tmp_path):
    root = tmp_path / "store"
    root.mkdir()
    assert under(root, root / "a" / "b.json") == (root / "a" / "b.json").resolve()
    for bad in (root / ".." / "x", tmp_path / "elsewhere", root / "a" / ".." / ".." / "x"):
        with pytest.raises(ConfigError, match="outside"):
            under(root, bad)
    (root / "link").symlink_to(tmp_path)  # a link out of the root is outside too
    with pytest.raises(ConfigError):
        under(root, root / "link" / "x")


@pytest.mark.parametrize("value", ["a b", "$(touch x)", "`id`", "it's", 'say "hi"', "a\nb", "", "-", "*", "~"])
def test_shell_line_round_trips_every_word(value):
    line = shell_line(["python", value], {"K": value})
    assert shlex.split(line) == [f"K={value}", "python", value]


def test_shell_line_refuses_an_environment_name_that_is_not_one():
    with pytest.raises(ConfigError):
        shell_line(["x"], {"A;touch x;B": "1"})


def test_comment_stays_on_one_line():
    assert "\n" not in comment("a\nb\rc\u2028d") and len(comment("x" * 1000)) == 300


@pytest.mark.parametrize(
    "content,said",
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "a JSON list"),
        (b"\x89PNG\r\n\x1a\n\x00\x00", "binary"),
        (b'"text"', "a JSON string"),
        (b"null", "a JSON null"),
        (b"[" * 100000, "not JSON"),
    ],
)
def test_load_json_object_says_what_the_file_is_instead(tmp_path, content, said):
    p = tmp_path / "report.json"
    p.write_bytes(content)
    with pytest.raises(ConfigError) as e:
        load_json_object(p, "report")
    assert said in str(e.value) and "\n" not in str(e.value) and str(p) in str(e.value)


def test_load_json_object_on_a_folder_and_a_missing_file(tmp_path):
    (tmp_path / "report.json").mkdir()
    with pytest.raises(ConfigError, match="a folder"):
        load_json_object(tmp_path / "report.json")
    with pytest.raises(ConfigError, match="cannot read"):
        load_json_object(tmp_path / "missing.json")
    (tmp_path / "ok.json").write_text(json.dumps({"a": 1}))
    assert load_json_object(tmp_path / "ok.json") == {"a": 1}
