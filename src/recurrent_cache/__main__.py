"""Command line: ``python -m recurrent_cache {demo,generate,inspect,convert} ...``."""

from __future__ import annotations

import argparse
import importlib
import sys

from ._cli import OneLineParser

COMMANDS = {
    "demo": ("recurrent_cache.demo", "run a recurrent model on the cache with continuous batching"),
    "generate": ("recurrent_cache.generate", "continue one prompt with the model, streaming the text"),
    "inspect": ("recurrent_cache.blob_report", "describe a state blob or a 'ggsq' sequence file"),
    "convert": ("recurrent_cache.models.convert", "write a Hugging Face Mamba / Mamba-2 directory as GGUF"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = OneLineParser(prog="python -m recurrent_cache")
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(COMMANDS.items())))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own options (try --help)")
    options = parser.parse_args(argv[:1])
    module = importlib.import_module(COMMANDS[options.command][0])
    return module.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
