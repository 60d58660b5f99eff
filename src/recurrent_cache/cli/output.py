"""A failed write to stdout is one line on stderr and a non-zero exit, never a traceback.

``python -m recurrent_cache demo | head -1`` closes the pipe after one line;
``... > /dev/full`` has no room.  Either way the next write (or the final
flush) raises ``OSError``.  ``guarded_stdout`` tells such a failure apart
from every other ``OSError`` by wrapping ``sys.stdout``: only writes through
the wrapper raise ``StdoutFailed``.  After one, stdout is pointed at the null
device, as the CPython documentation recommends for ``BrokenPipeError``, so
that the interpreter's own flush at exit does not fail a second time.
"""

from __future__ import annotations

import io
import os
import sys
from collections.abc import Callable
from typing import TextIO, cast

__all__ = ["OUTPUT_FAILED", "StdoutFailed", "guarded_stdout"]

OUTPUT_FAILED = 1   # the exit status when stdout cannot be written


class StdoutFailed(Exception):
    """Writing to stdout raised ``error``."""

    def __init__(self, error: OSError) -> None:
        super().__init__(error.strerror or str(error))
        self.error = error


class _GuardedStream(io.TextIOBase):
    """``stream`` with its write and flush errors raised as ``StdoutFailed``."""

    def __init__(self, stream: TextIO) -> None:
        super().__init__()
        self.stream = stream

    def write(self, text: str) -> int:
        try:
            return self.stream.write(text)
        except OSError as error:
            raise StdoutFailed(error) from error

    def flush(self) -> None:
        try:
            self.stream.flush()
        except OSError as error:
            raise StdoutFailed(error) from error

    def isatty(self) -> bool:
        return self.stream.isatty()

    def fileno(self) -> int:
        return self.stream.fileno()


def guarded_stdout(prog: str, command: Callable[[], int]) -> int:
    """Run ``command`` with a guarded stdout; its exit status, or ``OUTPUT_FAILED`` after one
    line ``prog: cannot write to stdout: REASON`` on stderr when stdout failed."""
    stdout = sys.stdout
    sys.stdout = cast(TextIO, _GuardedStream(stdout))
    try:
        try:
            return command()
        finally:   # also when argparse exits after --help: the text must be out before the interpreter ends
            sys.stdout.flush()
    except StdoutFailed as failure:
        _silence(stdout)
        print(f"{prog}: cannot write to stdout: {failure}", file=sys.stderr)
        return OUTPUT_FAILED
    finally:
        sys.stdout = stdout


def _silence(stream: TextIO) -> None:
    """Send what ``stream`` still holds, and whatever follows, to the null device."""
    try:
        descriptor = stream.fileno()
    except (OSError, ValueError):   # not a file (a test's StringIO): nothing is flushed at exit
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, descriptor)
    finally:
        os.close(null)
