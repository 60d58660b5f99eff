"""The options the ``python -m recurrent_cache`` subcommands share, and how they are parsed.

A user error must print ONE line on stderr and exit non-zero, never a
traceback or argparse's usage block; numeric options are range-checked and
paths checked for emptiness when parsed, so no command ever starts with a
value it cannot run with.
"""

from __future__ import annotations

import argparse
import math
from typing import Callable, NoReturn

__all__ = ["OneLineParser", "USER_ERROR", "float_in", "greedy_refusal", "int_in", "text"]

USER_ERROR = 2  # the exit status of every command-line user error (argparse's)


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line: ``prog: error: message``."""

    def error(self, message: str) -> NoReturn:
        self.exit(USER_ERROR, f"{self.prog}: error: {message} (see --help)\n")


def int_in(low: int, high: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer in ``[low, high]``."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{value} is outside [{low}, {high}]")
        return value
    parse.__name__ = "integer"
    return parse


def float_in(low: float, high: float) -> Callable[[str], float]:
    """An argparse ``type``: a finite number in ``[low, high]``."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (math.isfinite(value) and low <= value <= high):
            raise argparse.ArgumentTypeError(f"{value:g} is outside [{low:g}, {high:g}]")
        return value
    parse.__name__ = "number"
    return parse


def text(what: str) -> Callable[[str], str]:
    """An argparse ``type``: a non-empty string without NUL characters (a path, a URL)."""
    def parse(value: str) -> str:
        if not value:
            raise argparse.ArgumentTypeError(f"an empty {what}")
        if "\0" in value:
            raise argparse.ArgumentTypeError(f"a {what} with a NUL character: {value!r}")
        return value
    parse.__name__ = what
    return parse



def greedy_refusal(temperature: float | None, top_k: int | None) -> str:
    """Why ``--top-k`` cannot be given with ``--temperature 0`` ("" when it can): greedy decoding
    takes the most likely token whatever k is.  None stands for an option not given."""
    if temperature == 0 and top_k is not None:
        return "--top-k would be ignored by --temperature 0: greedy decoding takes the most likely token"
    return ""
