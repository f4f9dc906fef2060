"""python -m harness wheelhouse (cli.py): bad input is one line on stderr and exit 2."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--out", "X"], "--torch VERSION"),
        (["--out", "X", "--torch", "2.11.0+cu130"], "--python"),
        (["--out", "X", "--device", "cpu", "--torch", "2.11.0"], "--device cpu takes no --torch"),
        (["--out", "X", "--torch", "2.11.0", "--python", "3", "--platform", "manylinux_2_31_x86_64"], "--python '3'"),
        (["--torch", "2.11.0"], "--out DIR"),
        (["--dry-run", "--torch", "2.11.0+cu130"], "--python"),  # a dry run needs no --out: the next problem is named
    ],
)
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
    assert (
        main(
            [
                "wheelhouse",
                "--out",
                str(tmp_path / "o"),
                "--image-freeze",
                str(freeze),
                "--python",
                "3.12",
                "--platform",
                "manylinux_2_31_x86_64",
            ]
        )
        == 2
    )
    assert "lists no torch" in capsys.readouterr().err
