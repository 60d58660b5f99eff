"""The command line, ``python -m recurrent_cache SUBCOMMAND ...``: one module per subcommand.

``main`` dispatches to the subcommand's module, imported only when it is run,
so ``inspect`` never pays for loading a model.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from .options import OneLineParser

__all__ = ["COMMANDS", "main"]

COMMANDS = {
    "demo": ("recurrent_cache.cli.demo", "run a recurrent model on the cache with continuous batching"),
    "generate": ("recurrent_cache.cli.generate", "continue one prompt with the model, streaming the text"),
    "inspect": ("recurrent_cache.cli.inspect", "describe a state blob or a 'ggsq' sequence file"),
}


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named by ``argv[0]`` with the rest of ``argv``; its exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = OneLineParser(prog="python -m recurrent_cache")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(COMMANDS.items())))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own options (try --help)")
    options = parser.parse_args(argv[:1])
    module = importlib.import_module(COMMANDS[options.command][0])
    status: int = module.main(argv[1:])
    return status
