"""argparse value types shared by every subcommand."""

from __future__ import annotations

import argparse


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
