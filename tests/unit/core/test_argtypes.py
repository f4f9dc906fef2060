"""The harness's argparse: a bad flag is one error line and one line pointing at --help; --help is argparse's own."""

from __future__ import annotations

import argparse
import re

import pytest

from harness.cli import build_parser, main
from harness.core.argtypes import HarnessArgumentParser, positive_int
from harness.core.paths import REPO_ROOT

# Parsers the harness does not own: vLLM's (serve/headless.py), and the bundle's client, copied as text into repro
# bundles where no harness is importable.
NOT_OURS = {"harness/serve/headless.py", "harness/repro/client_template.py"}


def subcommands() -> list[str]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return list(sub.choices)


def two_lines(capsys, argv: list[str]) -> list[str]:
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert err[0].startswith("error: ")
    return err


@pytest.mark.parametrize("cmd", subcommands())
def test_a_bad_flag_is_one_error_line_and_the_way_to_help(capsys, cmd):
    err = two_lines(capsys, [cmd, "--no-such-flag"])
    assert err[1] == f"(see python -m harness {cmd} --help)"


@pytest.mark.parametrize(
    "argv,said,help_of",
    [
        (["e2e", "--tp-d", "three"], "error: argument --tp-d: 'three' is not an integer", "e2e"),
        (["topology", "--tp-p", "1"], "error: the following arguments are required: --tp-d", "topology"),
        (["model", "tiny", "--heads", "0"], "error: argument --heads: '0' must be >= 1", "model tiny"),
        (["no-such-command"], "error: argument cmd: invalid choice: 'no-such-command'", ""),
        ([], "error: the following arguments are required: cmd", ""),
    ],
)
def test_the_error_names_the_problem_and_the_innermost_command(capsys, argv, said, help_of):
    err = two_lines(capsys, argv)
    assert err[0].startswith(said)
    assert err[1] == f"(see python -m harness{' ' + help_of if help_of else ''} --help)"


def build(cls: type[argparse.ArgumentParser]) -> tuple[argparse.ArgumentParser, argparse.ArgumentParser]:
    top = cls(prog="prog", description="the top")
    top.add_argument("--n", type=positive_int, required=True, help="a number")
    sub = top.add_subparsers(dest="cmd").add_parser("run", help="a subcommand")
    sub.add_argument("--m", choices=["a", "b"])
    return top, sub


def test_help_is_argparses_own():
    (ours, our_sub), (theirs, their_sub) = build(HarnessArgumentParser), build(argparse.ArgumentParser)
    assert ours.format_help() == theirs.format_help() and our_sub.format_help() == their_sub.format_help()
    assert type(our_sub) is HarnessArgumentParser


def test_every_parser_the_harness_builds_is_the_harness_one():
    files = [*sorted((REPO_ROOT / "harness").rglob("*.py")), REPO_ROOT / "toy_proxy_server.py"]
    plain = [
        str(f.relative_to(REPO_ROOT))
        for f in files
        if str(f.relative_to(REPO_ROOT)) not in NOT_OURS and re.search(r"\bArgumentParser\(", f.read_text())
    ]
    assert plain == []
