"""The command line, ``python -m recurrent_cache SUBCOMMAND ...``: one module per subcommand.

``demo`` (``demo.py``, with its modes in ``demo_prefix.py`` and
``demo_speculative.py``), ``generate``, ``inspect`` and ``convert``.  They share
``options`` (one-line parse errors, range-checked numbers), ``model_options``
(the model, read in one place), ``serving`` (the one serving loop and batch
builder), ``clients`` and ``verification`` (the demo's clients and their
check against solo runs), and ``output`` (what a failed stdout does).

``main`` dispatches to the subcommand's module, imported only when it is run,
so ``inspect`` never pays for loading a model.  It is also where any error of
the package (a ``RecurrentCacheError``) that a subcommand lets through becomes
one line, ``demo: MESSAGE``, and exit status 2: a user's mistake is never a
traceback.  Any other exception still is one, because it is a bug to report.
"""

from __future__ import annotations

import argparse
import importlib
import sys

from ..errors import RecurrentCacheError
from .options import USER_ERROR, OneLineParser
from .output import guarded_stdout

__all__ = ["COMMANDS", "INTERRUPTED", "main"]

INTERRUPTED = 130   # the exit status after Ctrl-C, as a shell reports a process ended by SIGINT

COMMANDS = {
    "demo": ("recurrent_cache.cli.demo", "run a recurrent model on the cache with continuous batching"),
    "generate": ("recurrent_cache.cli.generate", "continue one prompt with the model, streaming the text"),
    "inspect": ("recurrent_cache.cli.inspect", "describe a state blob or a 'ggsq' sequence file"),
    "convert": ("recurrent_cache.cli.convert", "write a Hugging Face Mamba / Mamba-2 directory as GGUF"),
}

EXAMPLES = """\
examples:
  python -m recurrent_cache demo
  python -m recurrent_cache generate "def fibonacci(n):"
  python -m recurrent_cache inspect state.bin
  python -m recurrent_cache convert ./mamba-130m-hf mamba-130m.gguf
  python -m recurrent_cache demo --help      # each subcommand's options and examples
"""


def main(argv: list[str] | None = None) -> int:
    """Run the subcommand named by ``argv[0]`` with the rest of ``argv``; its exit status.

    An error of the package, a failed write to stdout, or Ctrl-C, ends it with one line on stderr,
    named by the subcommand; a reader that closed the pipe, silently (see ``output``).
    """
    argv = sys.argv[1:] if argv is None else argv
    name = argv[0] if argv and argv[0] in COMMANDS else "python -m recurrent_cache"
    try:
        return guarded_stdout(name, lambda: _dispatch(argv))
    except RecurrentCacheError as exc:
        print(f"{name}: {exc}", file=sys.stderr)
        return USER_ERROR
    except KeyboardInterrupt:
        print(f"{name}: interrupted", file=sys.stderr)
        return INTERRUPTED


def _dispatch(argv: list[str]) -> int:
    """Parse the subcommand's name, import its module, run its ``main`` on the rest."""
    if not argv:
        print(f"python -m recurrent_cache: a command is needed: {', '.join(COMMANDS)} "
              "(python -m recurrent_cache --help shows what each does)", file=sys.stderr)
        return USER_ERROR
    parser = OneLineParser(prog="python -m recurrent_cache", epilog=EXAMPLES,
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("command", choices=sorted(COMMANDS),
                        help="; ".join(f"{name}: {text}" for name, (_, text) in sorted(COMMANDS.items())))
    parser.add_argument("args", nargs=argparse.REMAINDER, help="the command's own options (try --help)")
    command = parser.parse_args(argv[:1]).command
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(argv[1:]))
