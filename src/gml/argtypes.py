"""argparse ``type=`` converters the ``gml`` subcommands share (one definition each)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """``N`` with N >= 1, or argparse's usage error naming what was given."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value
