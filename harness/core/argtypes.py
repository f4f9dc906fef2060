"""argparse value types shared by every subcommand."""

from __future__ import annotations

import argparse
import contextvars
from typing import NoReturn


def positive(kind):
    """A parser for values of ``kind`` (int, float) that must be > 0."""

    def parse(s: str):
        try:
            v = kind(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not {'an integer' if kind is int else 'a number'}") from None
        if v <= 0:
            raise argparse.ArgumentTypeError(f"{s!r} must be >= 1" if kind is int else f"{s!r} must be > 0")
        return v

    return parse


positive_int = positive(int)


def non_negative_int(s: str) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"{s!r} must be >= 0")
    return v


# The innermost (sub)command being parsed: "unrecognized arguments" is raised by the top parser after its
# subcommand's parser has run, and the hint should name that subcommand's --help.
_parsing: contextvars.ContextVar[str] = contextvars.ContextVar("_parsing", default="")


class HarnessArgumentParser(argparse.ArgumentParser):
    """argparse as the harness uses it: a bad flag is ``error: <message>`` and one line pointing at ``--help``
    (not the whole usage first), exit 2. Subparsers take this class too (argparse's default ``parser_class`` is the
    parent's); ``--help`` is argparse's own."""

    def parse_known_args(self, args=None, namespace=None):  # argparse's (overloaded) signature
        _parsing.set(self.prog)
        return super().parse_known_args(args, namespace)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"error: {message}\n(see {_parsing.get() or self.prog} --help)\n")
