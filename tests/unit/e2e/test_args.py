"""The e2e flags in their package: `python -m harness` parses them as before, the e2e-only parser (what the nightly's
dry run uses) parses them as the full command line does, and harness/cli.py still offers config_from_args."""

from dataclasses import replace

import pytest

import harness.cli
import harness.e2e.args
from harness.nightly.servers import e2e_config

ARGVS = [
    ["e2e", "--device", "cpu"],
    ["e2e", "--device", "gpu", "--tp-p", "2", "--tp-d", "8", "--block-size-d", "64", "--kv-cache-dtype", "fp8"],
    ["e2e", "--device", "cpu", "--accuracy", "--accuracy-limit", "5", "--load-requests", "0", "--no-kv-digest"],
    ["e2e", "--device", "cpu", "--proxy-fault", "corrupt-block-ids", "--proxy-fault-every", "3", "--async-scheduling"],
]


@pytest.mark.parametrize("argv", ARGVS, ids=lambda a: " ".join(a[1:4]))
def test_the_e2e_parser_parses_as_the_full_command_line(argv):
    assert vars(harness.e2e.args.e2e_parser().parse_args(argv)) == vars(harness.cli.build_parser().parse_args(argv))


def test_harness_cli_offers_the_moved_config_builder():
    assert harness.cli.config_from_args is harness.e2e.args.config_from_args


def test_a_bad_flag_is_the_same_one_line_error_from_either_parser(capsys):
    errors = []
    for parser in (harness.e2e.args.e2e_parser(), harness.cli.build_parser()):
        with pytest.raises(SystemExit) as e:
            parser.parse_args(["e2e", "--tp-d", "three"])
        assert e.value.code == 2
        errors.append(capsys.readouterr().err)
    assert (
        errors[0]
        == errors[1]
        == "error: argument --tp-d: 'three' is not an integer\n(see python -m harness e2e --help)\n"
    )


def test_the_nightly_builds_a_steps_config_as_e2e_does(tmp_path, monkeypatch):
    monkeypatch.delenv("VLLM_VERSION", raising=False)
    argv = ["e2e", "--device", "gpu", "--model", "org/m", "--tp-d", "2", "--run-dir", str(tmp_path / "r")]
    want = harness.cli.config_from_args(harness.cli.build_parser().parse_args(argv))
    assert e2e_config(argv, "/envs/py") == replace(want, python="/envs/py")
