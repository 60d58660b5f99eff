"""``--quick``, the same in every benchmark: a few seconds that show the script works.

A quick run measures small inputs with few repeats, on whatever load the
machine has: its figures say the benchmark runs and has the right shape, and
are not for quoting.  Every script with a ``--quick`` prints ``NOTE`` first.
"""

from __future__ import annotations

import argparse

NOTE = "quick run (--quick): a few seconds on small inputs; the figures are not for quoting"


def add_quick_option(parser: argparse.ArgumentParser, shortens: str) -> None:
    """Add ``--quick``; ``shortens`` says what it shortens (in the help)."""
    parser.add_argument("--quick", action="store_true",
                        help=f"a run of a few seconds ({shortens}); the figures are not for quoting")
